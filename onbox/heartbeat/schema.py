"""The heartbeat document, `onbox.heartbeat/1`; heartbeat.schema.json documents it.

`validate()` is what the tracker runs on every incoming beat: a list of problems (empty when valid), never an
exception, whatever the input. Unknown keys are allowed so the format can grow compatibly.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Mapping

SCHEMA = "onbox.heartbeat/1"
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heartbeat.schema.json")
RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_SEQ = 2**53  # JSON numbers stay exact below this
MAX_TIME = 1e11  # seconds since the epoch: year 5138
MAX_STR = 4096
SECTIONS = ("child", "progress", "checkpoint", "gpus", "host", "spool", "preemption")
LIST_SECTIONS = ("disks", "alerts")
PROGRESS_NUMBERS = ("loss", "eval_loss", "lr", "tokens_per_s", "samples_per_s", "epoch", "steps_per_s")
NONFINITE = ("NaN", "Infinity", "-Infinity")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def validate(doc: Any) -> List[str]:
    """Problems with one heartbeat document; [] when it is a valid onbox.heartbeat/1."""
    if not isinstance(doc, dict):
        return ["a heartbeat must be a JSON object"]
    errs: List[str] = []
    if doc.get("schema") != SCHEMA:
        errs.append("schema must be %r" % SCHEMA)
    run = doc.get("run")
    if not isinstance(run, str) or not RUN_RE.match(run):
        errs.append("run must be a run name (letters, digits, '.', '_', '-'; at most 128)")
    for key in ("attempt", "seq"):
        v = doc.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_SEQ):
            errs.append("%s must be an integer >= 0" % key)
    t = doc.get("time")
    if not (isinstance(t, (int, float)) and _is_num(t) and 0 <= t < MAX_TIME):
        errs.append("time must be a number of seconds since the epoch")
    for key in ("box", "state"):
        v = doc.get(key)
        if not isinstance(v, str) or not 0 < len(v) <= 256:
            errs.append("%s must be a non-empty string" % key)
    if "interval_s" in doc and doc["interval_s"] is not None and not (_is_num(doc["interval_s"]) and doc["interval_s"] >= 0):
        errs.append("interval_s must be a number >= 0")
    for key in SECTIONS:
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            errs.append("%s must be an object or null" % key)
    for key in LIST_SECTIONS:
        v = doc.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, dict) for x in v)):
            errs.append("%s must be a list of objects" % key)
    prog = doc.get("progress")
    if isinstance(prog, dict):
        step = prog.get("step")
        if step is not None and (not _is_int(step) or not 0 <= step < MAX_SEQ):
            errs.append("progress.step must be an integer >= 0 or null")
        for key in PROGRESS_NUMBERS:
            v = prog.get(key)
            if v is not None and not _is_num(v) and v not in NONFINITE:
                errs.append("progress.%s must be a number, null or one of %s" % (key, "/".join(NONFINITE)))
    alerts = doc.get("alerts")
    if isinstance(alerts, list):
        for i, a in enumerate(alerts):
            if isinstance(a, dict) and not (isinstance(a.get("code"), str) and 0 < len(a["code"]) <= 64):
                errs.append("alerts[%d].code must be a short string" % i)
    return errs


def metric_point(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """The compact numbers kept for a beat after thinning."""
    prog = doc.get("progress") or {}
    return {k: prog.get(k) for k in ("step", *PROGRESS_NUMBERS)}


def load_schema() -> Dict[str, Any]:
    with open(SCHEMA_FILE, encoding="utf-8") as f:
        return json.load(f)
