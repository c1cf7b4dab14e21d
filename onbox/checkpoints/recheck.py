"""`onbox verify`'s record in a run's checkpoints_index.json: a re-check of committed checkpoints is a write like any
other, so it is made under the run's commit lock (when the run has a run dir on this box) and under the lease this
box holds on that target (fencing.PassiveLease), or not at all.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, List, Optional, Tuple

from onbox import paths, untrusted
from onbox.checkpoints import INDEX, SyncFailed
from onbox.checkpoints.durable.index import make_check, record_checks
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.durable.runlock import commit_lock
from onbox.checkpoints.leases.fencing import PassiveLease

LOCK_WAIT_S = 120.0  # how long `onbox verify` waits for a commit in flight before it skips recording


def durable_run_root(path: str) -> Optional[str]:
    """The <durable>/<run> dir holding an index that a verified `path` belongs to: that dir itself, its
    checkpoints/ dir, or one checkpoint in it; None for anything else (a file, a pulled copy without an index)."""
    path = os.path.abspath(path)
    up1, up2 = os.path.dirname(path), os.path.dirname(os.path.dirname(path))
    for root, ok in ((path, True), (up1, os.path.basename(path) == "checkpoints"),
                     (up2, os.path.basename(up1) == "checkpoints")):
        if ok and os.path.isfile(os.path.join(root, INDEX)) and os.path.isdir(os.path.join(root, "checkpoints")):
            return root
    return None


def _lease_of(run_dir: Optional[str], target: Any, run: str) -> Any:
    """The lease a writer on this box that is not the agent holds on `target`: what the run's agent recorded in
    its checkpoint_status.json (fencing.PassiveLease), or none at all."""
    recorded = None
    if run_dir is not None:
        try:
            status = untrusted.read_json(os.path.join(run_dir, paths.CHECKPOINT_STATUS_FILE),
                                         untrusted.CONFIG_MAX_BYTES, "checkpoint status")
        except (OSError, ValueError):
            status = None
        lease = status.get("lease") if isinstance(status, dict) else None
        recorded = lease if isinstance(lease, dict) else None
    return PassiveLease(target, run, recorded)


def record_verification(path: str, rows: List[Dict[str, Any]], now: float,
                        lock_timeout: float = LOCK_WAIT_S) -> Tuple[List[str], Optional[str]]:
    """Record `onbox verify`'s per-checkpoint results (VerifyReport.checkpoints) in the index of the durable run
    dir `path` belongs to, under the run's commit lock when that run has a run dir on this box (its agent, or
    `onbox sync`, may be committing right now). Returns (names recorded, a warning when nothing could be)."""
    root = durable_run_root(path)
    if root is None or not rows:
        return [], None
    base, run = os.path.split(root)
    checks = {r["name"]: {"digest": r.get("digest"), "check": make_check("verify", bool(r.get("ok")),
                                                                          r.get("problems") or [],
                                                                          r.get("checked") or [], now)}
              for r in rows}
    run_dir = paths.run_dir(run)
    here = paths.valid_run_name(run) and os.path.isdir(run_dir)
    lock = commit_lock(run_dir, lock_timeout) if here else contextlib.nullcontext()
    where = os.path.join(root, INDEX)
    target = LocalPathTarget(base, run)
    try:
        with lock:
            # a re-check's record rewrites the index: a write like any other, made only under the lease this box
            # holds on this target (or on a run that has no leases); another box's holder may be rewriting it now
            _lease_of(run_dir if here else None, target, run).check("the index record of a re-check")
            return record_checks(target, checks, now), None
    except TimeoutError:
        return [], "not recorded in %s: run %s's commit lock stayed busy for %.0f s" % (where, run, lock_timeout)
    except (OSError, SyncFailed) as e:
        return [], "not recorded in %s: %s" % (where, e)
