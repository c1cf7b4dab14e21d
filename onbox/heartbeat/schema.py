"""The heartbeat document, `onbox.heartbeat/1`; heartbeat.schema.json documents it.

`validate()` is what the tracker runs on every incoming beat: a list of problems (empty when valid), never an
exception, whatever the input. It checks the document against heartbeat.schema.json itself (every section, by a
compiled validator of the schema keywords that file uses, schemacheck.py: a keyword it does not know fails loudly
at load, never silently) plus the tracker's own bounds (seq, time, non-finite numbers anywhere). Unknown keys are allowed so the
format can grow compatibly, within a bound: a beat nests at most onbox.untrusted.MAX_DEPTH levels (what every reader
of the tracker's answers reads), and the keys the schema does not name hold at most MAX_UNKNOWN_BYTES together.
`loads_strict()` is the JSON parser for anything a tracker stores or serves.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from onbox import vocab
from onbox.heartbeat.schemacheck import Check, Pred, compile_schema
from onbox.untrusted import MAX_DEPTH, depth, human

SCHEMA = vocab.SCHEMA_HEARTBEAT
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heartbeat.schema.json")
RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_SEQ = 2**53  # JSON numbers stay exact below this
MAX_TIME = 1e11  # seconds since the epoch: year 5138
MAX_STR = 4096
SECTIONS = ("child", "progress", "checkpoint", "gpus", "host", "spool", "preemption", "deadline")
LIST_SECTIONS = ("disks", "alerts")
PROGRESS_NUMBERS = ("loss", "eval_loss", "lr", "tokens_per_s", "samples_per_s", "epoch", "steps_per_s")
MAX_BEAT_POINTS = 10000  # records in one beat's `points` that a tracker takes (an agent sends at most 500)
NONFINITE = ("NaN", "Infinity", "-Infinity")
MAX_UNKNOWN_BYTES = 64 * 1024  # the keys the schema does not name, together, as compact JSON (a real beat has none)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def validate(doc: Any) -> List[str]:
    """Problems with one heartbeat document; [] when it is a valid onbox.heartbeat/1."""
    return validate_and_dump(doc)[0]


def validate_and_dump(doc: Any) -> Tuple[List[str], str]:
    """(problems, the document as compact JSON): the text a tracker stores, made once while checking."""
    if not isinstance(doc, dict):
        return ["a heartbeat must be a JSON object"], ""
    deep = _too_deep(doc)
    if deep:  # first: every later check (and every reader of the stored beat) may recurse
        return [deep], ""
    errs: List[str] = []
    if doc.get("schema") != SCHEMA:
        errs.append("schema must be %r" % SCHEMA)
    run = doc.get("run")
    if not isinstance(run, str) or not RUN_RE.fullmatch(run):  # fullmatch: `$` would let "run\n" through
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
    points = doc.get("points")
    if points is not None:
        errs.extend(_points_problems(points))
    alerts = doc.get("alerts")
    if isinstance(alerts, list):
        for i, a in enumerate(alerts):
            if isinstance(a, dict) and not (isinstance(a.get("code"), str) and 0 < len(a["code"]) <= 64):
                errs.append("alerts[%d].code must be a short string" % i)
    if errs:
        return errs, ""
    try:  # C speed for the common case; the walk below only names the place
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError, RecursionError) as e:
        return [_nonfinite(doc, "", 0) or "not storable as JSON: %s" % str(e)[:120]], ""
    unknown = _unknown_problem(doc)
    if unknown:
        return [unknown], ""
    return schema_problems(doc)[:MAX_ERRORS], text


def _too_deep(doc: Dict[str, Any]) -> Optional[str]:
    """Which top-level key of the beat makes it nest past MAX_DEPTH levels (the beat itself is the first), or None.
    Readers of the tracker refuse such a document (onbox.untrusted's bound): one beat must not blind them."""
    if not _nests_past(doc, MAX_DEPTH):
        return None
    for key, value in doc.items():
        levels = 1 + depth(value, 1 << 20)  # iterative: the real figure, however deep
        if levels > MAX_DEPTH:
            return "%s nests %d levels deep, more than %d" % (str(key)[:64], levels, MAX_DEPTH)
    return "nests more than %d levels deep" % MAX_DEPTH


_SCALARS = frozenset((str, int, float, bool, type(None)))


def _nests_past(doc: Any, bound: int) -> bool:
    """Whether `doc` nests more than `bound` levels: onbox.untrusted.depth's answer, a level at a time, each node's
    children typed at C speed (a beat's 500 points per column cost no Python step each: this runs on every beat
    the tracker takes)."""
    level = [doc]
    for _ in range(bound):
        deeper: List[Any] = []
        for node in level:
            children = node.values() if isinstance(node, dict) else node
            if not _SCALARS.issuperset(map(type, children)):
                deeper.extend(c for c in children if isinstance(c, (dict, list)))
        if not deeper:
            return False
        level = deeper
    return True


def _unknown_problem(doc: Dict[str, Any]) -> Optional[str]:
    """Why the keys heartbeat.schema.json does not name are too large together (None: within MAX_UNKNOWN_BYTES)."""
    known = _known_keys()
    extra = [k for k in doc if k not in known]
    if not extra:
        return None
    size = len(json.dumps({k: doc[k] for k in extra}, separators=(",", ":")).encode("utf-8"))
    if size <= MAX_UNKNOWN_BYTES:
        return None
    names = ", ".join(str(k)[:32] for k in extra[:3]) + (", ..." if len(extra) > 3 else "")
    return "the keys the schema does not name (%s) hold %s, more than %s" % (names, human(size),
                                                                              human(MAX_UNKNOWN_BYTES))


MAX_ERRORS = 10


def _points_problems(points: Any) -> List[str]:
    """What the schema cannot say of the `points` section: columns of one length, within the bound."""
    if not isinstance(points, dict):
        return ["points must be an object or null"]
    times = points.get("time")
    if not isinstance(times, list):
        return ["points.time must be a list"]
    n = len(times)
    if n > MAX_BEAT_POINTS:
        return ["points: at most %d records a beat, not %d" % (MAX_BEAT_POINTS, n)]
    errs = []
    for key in ("step", *PROGRESS_NUMBERS):
        col = points.get(key)
        if key in points and not (isinstance(col, list) and len(col) == n):
            errs.append("points.%s must be a list as long as points.time (%d)" % (key, n))
    if "step" not in points:
        errs.append("points.step: required")
    return errs


def _nonfinite(v: Any, path: str, depth: int) -> Optional[str]:
    """Where a number that JSON cannot carry (NaN, +-Infinity) hides in `v` (None: nowhere)."""
    if isinstance(v, float):
        return None if math.isfinite(v) else "%s: a number that is not finite (%r) is not JSON" % (path or "beat", v)
    if depth > 100:
        return None
    if isinstance(v, dict):
        for k, x in v.items():
            if isinstance(x, (float, dict, list)):
                bad = _nonfinite(x, "%s.%s" % (path, k) if path else str(k), depth + 1)
                if bad:
                    return bad
    elif isinstance(v, list):
        for i, x in enumerate(v):
            if isinstance(x, (float, dict, list)):
                bad = _nonfinite(x, "%s[%d]" % (path, i), depth + 1)
                if bad:
                    return bad
    return None


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e400 parses to inf: JSON has no such number, and a stored inf breaks every read
        raise ValueError("number %s is out of range" % text[:40])
    return v


def _no_constant(name: str) -> Any:
    raise ValueError("%s is not JSON" % name)


def loads_strict(text: str) -> Any:
    """json.loads that refuses what JSON has no place for: NaN/Infinity literals and numbers that overflow to
    infinity (1e400). What it accepts, json.dumps(allow_nan=False) can always write back."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


_compiled: Optional[Tuple[Pred, Check]] = None
_known: Optional[frozenset] = None


def _known_keys() -> frozenset:
    """The top-level keys heartbeat.schema.json names."""
    global _known
    if _known is None:
        _known = frozenset(load_schema()["properties"])
    return _known


def schema_problems(doc: Any) -> List[str]:
    """What heartbeat.schema.json says is wrong with `doc` ([] when it conforms)."""
    global _compiled
    if _compiled is None:
        _compiled = compile_schema(load_schema())
    valid, explain = _compiled
    if valid(doc):
        return []
    errs: List[str] = []
    explain(doc, "", errs)
    return errs


def metric_point(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """The compact numbers kept for a beat after thinning."""
    prog = doc.get("progress") or {}
    return {k: prog.get(k) for k in ("step", *PROGRESS_NUMBERS)}


def load_schema() -> Dict[str, Any]:
    with open(SCHEMA_FILE, encoding="utf-8") as f:
        return json.load(f)
