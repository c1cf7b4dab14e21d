"""checkpoints_index.json: the concise list of a run's committed checkpoints (<durable>/<run>/), each with its
commit time, step, the metrics the trainer reported around it, and its verification state.

The manifests are the truth (a checkpoint exists once its MANIFEST.json does); the index is the convenience a
person or a script reads first. It is rewritten atomically (write a temp name, fsync, rename) by the committer
after each commit, by retention (a retired checkpoint leaves the index before its files go), by quarantine
(the checkpoint moves to `quarantined`), and by a re-check: a restore that fetched and verified a checkpoint,
or `onbox verify <durable>/<run>`. Every writer on a box holds the run's commit lock (runlock.commit_lock).

Schema `onbox.checkpoints_index/2` (README in this package), a superset of `/1`: every `/1` field is still
written with the same meaning, so a `/1` reader keeps working; `upgrade_entry` reads a `/1` entry as `/2`.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any, Dict, List, Optional, Tuple

from onbox import paths
from onbox.checkpoints import INDEX, INDEX_SCHEMA, INDEX_SCHEMA_V1, SyncFailed
from onbox.checkpoints.runlock import commit_lock

READABLE_SCHEMAS = (INDEX_SCHEMA_V1, INDEX_SCHEMA)
MAX_CHECKS = 10  # re-checks kept per checkpoint (newest last); older ones only in the run's events
LOCK_WAIT_S = 120.0  # how long `onbox verify` waits for a commit in flight before it skips recording
COMMIT_CHECK = "the size and sha256 of every file, computed as it was copied to durable storage"


def iso(t: Any) -> Optional[str]:
    """A unix time as ISO-8601 UTC, for people reading the index; None for no time."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def entry_from_manifest(m: Dict[str, Any]) -> Dict[str, Any]:
    """The index entry of a checkpoint just committed (or rebuilt from its manifest): verified at commit."""
    created = m.get("created")
    return {"name": m["name"], "local_name": m.get("local_name"), "kind": m.get("kind"), "step": m.get("step"),
            "created": created, "committed_at": iso(created), "bytes": m.get("bytes"), "digest": m.get("digest"),
            "hash": m.get("hash"), "metrics": m.get("metrics") or {}, "verified": True,
            "verification": {"state": "verified", "committed": {"at": created, "digest": m.get("digest"),
                                                                "hash": m.get("hash"), "checked": COMMIT_CHECK},
                             "checks": []},
            "source_fingerprint": (m.get("source") or {}).get("fingerprint"),
            # the lease it was committed under (fencing.py): whose lineage it belongs to; None without leases
            "epoch": m.get("epoch"), "holder": m.get("holder")}


def upgrade_entry(e: Dict[str, Any]) -> Dict[str, Any]:
    """An entry as /2 describes it; a /1 entry (no `verification`) was verified at commit, never re-checked."""
    if isinstance(e.get("verification"), dict) and isinstance(e["verification"].get("checks"), list):
        return e
    out = dict(e)
    out.setdefault("committed_at", iso(e.get("created")))
    out["verification"] = {"state": "verified" if e.get("verified", True) else "failed",
                           "committed": {"at": e.get("created"), "digest": e.get("digest"), "hash": e.get("hash"),
                                         "checked": COMMIT_CHECK},
                           "checks": []}
    return out


def make_check(by: str, ok: bool, problems: List[str], checked: List[str], at: float,
               host: Optional[str] = None) -> Dict[str, Any]:
    """One re-check: `by` "verify" | "restore"; `checked` what was looked at ("sha256", "format", "load")."""
    return {"at": at, "time": iso(at), "by": by, "result": "passed" if ok else "failed",
            "problems": list(problems)[:20], "checked": list(checked), "host": host or socket.gethostname()}


def apply_check(entry: Dict[str, Any], check: Dict[str, Any]) -> Dict[str, Any]:
    """The entry with `check` recorded: appended to its checks (the newest MAX_CHECKS), its state and the /1
    `verified` flag following the newest result."""
    out = upgrade_entry(entry)
    ver = dict(out["verification"])
    ver["checks"] = [*ver["checks"], check][-MAX_CHECKS:]
    ver["state"] = "verified" if check["result"] == "passed" else "failed"
    out["verification"] = ver
    out["verified"] = ver["state"] == "verified"
    return out


def record_checks(target: Any, checks: Dict[str, Dict[str, Any]], now: float) -> List[str]:
    """Record re-checks in the target's index: `checks` maps a checkpoint name to (digest, check) as
    {"digest": ..., "check": ...}. Only an entry with that name AND digest is touched (a checkpoint retired,
    quarantined or re-committed under the name since it was checked is not). The caller holds the run's
    commit lock. Returns the names recorded; writes nothing when none is (or there is no index)."""
    doc = target.read_index()
    if doc is None or not isinstance(doc.get("checkpoints"), list):
        return []
    done = []
    entries = []
    for e in doc["checkpoints"]:
        if isinstance(e, dict) and e.get("name") in checks and e.get("digest") == checks[e["name"]]["digest"]:
            e = apply_check(e, checks[e["name"]]["check"])
            done.append(e["name"])
        entries.append(upgrade_entry(e) if isinstance(e, dict) else e)
    if done:
        doc = dict(doc, schema=INDEX_SCHEMA, checkpoints=entries, updated=now)
        target.write_index(doc)
    return done


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
    from onbox import untrusted
    from onbox.checkpoints.fencing import PassiveLease

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
    from onbox.checkpoints.localpath import LocalPathTarget

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
