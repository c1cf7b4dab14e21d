"""checkpoints_index.json: the concise list of a run's committed checkpoints (<durable>/<run>/), each with its
commit time, step, the metrics the trainer reported around it, and its verification state.

The manifests are the truth (a checkpoint exists once its MANIFEST.json does); the index is the convenience a
person or a script reads first. It is rewritten atomically (write a temp name, fsync, rename) by the committer
after each commit, by retention (a retired checkpoint leaves the index before its files go), by quarantine
(the checkpoint moves to `quarantined`), and by a re-check: a restore that fetched and verified a checkpoint,
or `onbox verify <durable>/<run>` (recheck.py). Every writer on a box holds the run's commit lock
(runlock.commit_lock).

Schema `onbox.checkpoints_index/2` (README in this package), a superset of `/1`: every `/1` field is still
written with the same meaning, so a `/1` reader keeps working; `upgrade_entry` reads a `/1` entry as `/2`.
"""
from __future__ import annotations

import socket
import time
from typing import Any, Dict, List, Optional

from onbox.checkpoints import INDEX_SCHEMA, INDEX_SCHEMA_V1

READABLE_SCHEMAS = (INDEX_SCHEMA_V1, INDEX_SCHEMA)
MAX_CHECKS = 10  # re-checks kept per checkpoint (newest last); older ones only in the run's events
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
