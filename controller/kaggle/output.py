"""A Kaggle run's output brought home (`onboxctl kaggle pull`) and what its session said (`onboxctl kaggle status`).

`kaggle kernels output` downloads the newest version's output; only the run's committed tree
(`onbox-durable/<run>/`) and the session's outcome (`onbox-kaggle.json`) are asked for (--file-pattern). They land
in a staging dir beside DEST, then each committed checkpoint (one with its MANIFEST.json) moves to
DEST/<run>/checkpoints/<name>/ (the layout `onboxctl pull` writes), is verified here with onbox's own verifier
(sizes and hashes against the manifest, format checks, a torch load when torch is installed) and recorded in the
pulls record under the box `kaggle:<owner>` (a name no inventory box can have), like every pull.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Any, Callable, Dict, List, Optional

from controller.kaggle.cli import KaggleCli
from controller.kaggle.kernel_main import DURABLE_DIR, LOG_PREFIX, OUTCOME_FILE, OUTCOME_SCHEMA
from controller.pull import PullReport, PullsRecord, verified_line, verify_local
from onbox import untrusted
from onbox.errors import JobFailed

MANIFEST = "MANIFEST.json"


def box_of(owner: str) -> str:
    """The pulls record's box for a Kaggle owner's kernels."""
    return "kaggle:" + owner


def outcome_in_log(lines: List[str]) -> Optional[Dict[str, Any]]:
    """The session's outcome from its log: the last `onbox-kaggle: {...}` line kernel_main.py printed."""
    for line in reversed(lines):
        if line.startswith(LOG_PREFIX + "{"):
            try:
                doc = json.loads(line[len(LOG_PREFIX):])
            except ValueError:
                return None
            return doc if isinstance(doc, dict) and doc.get("schema") == OUTCOME_SCHEMA else None
    return None


def _step(manifest_path: str) -> Optional[int]:
    try:
        step = untrusted.read_json(manifest_path, untrusted.MANIFEST_MAX_BYTES, "manifest").get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _replace(src: str, dst: str, aside: str) -> None:
    """dst becomes src; what was at dst goes to `aside` (inside the staging dir, removed with it)."""
    if os.path.lexists(dst):
        os.rename(dst, aside)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)


def pull(cli: KaggleCli, ref: str, owner: str, run: str, dest: str, load: Optional[bool] = None,
         record: Optional[PullsRecord] = None, say: Callable[[str], None] = lambda m: None) -> PullReport:
    """Download the newest version's committed run, verify each checkpoint, record the outcome."""
    t0 = time.monotonic()
    dest_root = os.path.abspath(dest)
    local_root = os.path.join(dest_root, run)
    staging = os.path.join(dest_root, ".onbox-kaggle-" + run)
    if os.path.lexists(staging):
        shutil.rmtree(staging)  # what an interrupted pull of this run left: fetched anew
    os.makedirs(staging)
    try:
        say("downloading the output of %s (the run's committed tree only)" % ref)
        cli.output(ref, staging, r"^(%s/%s/|%s$)" % (DURABLE_DIR, re.escape(run), re.escape(OUTCOME_FILE)))
        tree = os.path.join(staging, DURABLE_DIR, run)
        ckpt_root = os.path.join(tree, "checkpoints")
        names = sorted(n for n in os.listdir(ckpt_root) if os.path.isfile(os.path.join(ckpt_root, n, MANIFEST))) \
            if os.path.isdir(ckpt_root) else []
        if not names:
            raise JobFailed("the newest output of %s holds no committed checkpoint of run %s" % (ref, run),
                            hint="see how its session ended: onboxctl kaggle status %s" % run)
        record = record or PullsRecord()
        results = []
        for name in names:
            if untrusted.name_problem(name):
                continue
            staged, local = os.path.join(ckpt_root, name), os.path.join(local_root, "checkpoints", name)
            fresh = _sha256(os.path.join(staged, MANIFEST))
            if not (os.path.isfile(os.path.join(local, MANIFEST)) and _sha256(os.path.join(local, MANIFEST)) == fresh):
                _replace(staged, local, os.path.join(staging, "replaced-" + name))
            step = _step(os.path.join(local, MANIFEST))
            v = verify_local(local, load)
            say(verified_line(name, v))
            result = {"name": name, "step": step, "manifest_sha256": fresh, "path": local, "attempts": 1,
                      "pulled_at": time.time(), "ok": v["ok"], "loaded": v.get("loaded"), "checked": v.get("checked"),
                      "error": v.get("error"), "verified_at": time.time(), "kernel": ref}
            record.record(box_of(owner), run, local_root, name, result)
            results.append(result)
        for rel in ("checkpoints_index.json", "logs"):
            if os.path.lexists(os.path.join(tree, rel)):
                _replace(os.path.join(tree, rel), os.path.join(local_root, rel), os.path.join(staging, "old-" + rel))
        if os.path.isfile(os.path.join(staging, OUTCOME_FILE)):
            os.replace(os.path.join(staging, OUTCOME_FILE), os.path.join(local_root, OUTCOME_FILE))
        logs = [n for n in os.listdir(staging) if n.endswith(".log")]
        if logs:  # the session's log, which `kaggle kernels output` always writes as <slug>.log
            os.replace(os.path.join(staging, logs[0]), os.path.join(local_root, "kaggle-session.log"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    newest = max(results, key=lambda r: (r["step"] if isinstance(r["step"], int) else -1, r["name"]))
    return PullReport(box=box_of(owner), run=run, dest=local_root, checkpoints=results, newest=newest["name"],
                      ok=all(r["ok"] for r in results), seconds=round(time.monotonic() - t0, 3))
