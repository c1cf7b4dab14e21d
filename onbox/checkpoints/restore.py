"""Restore the newest committed checkpoint that verifies onto a (possibly empty) local checkpoint dir.

A replacement box after a preemption starts with an empty checkpoint dir: fetch the newest committed
checkpoint, check every hash against its manifest, and only then move it into place. One that fails is never
handed to the trainer: fall back to the next newest, and say so (event `restore_verify_failed`).
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from onbox import fsutil
from onbox.checkpoints import SyncFailed, formats
from onbox.checkpoints.durable import DurableTarget

RESTORED_DIR = ".onbox-restored"  # hidden: detection ignores it, so a restored copy is not committed again


class RestoreResult(NamedTuple):
    path: Optional[str]
    name: Optional[str]
    step: Optional[int]
    source: str  # "local" (already there), "durable" (fetched now), "" (nothing)
    created: Optional[float]
    rejected: List[Tuple[str, str]]  # (checkpoint, problem) of newer ones that failed verification


def _local_matches(path: str, manifest: Dict[str, Any]) -> bool:
    """The local entry holds the same files (by size: cheap; its hash was checked when it was committed)."""
    root = path if manifest.get("kind") == "dir" else os.path.dirname(path)
    for f in manifest["files"]:
        p = os.path.join(root, f["path"])
        if not os.path.isfile(p) or os.path.getsize(p) != f["size"]:
            return False
    return True


def restore_newest(target: DurableTarget, names_newest_first: List[str], ckpt_dir: str,
                   emit: Callable[..., None], hash_name_default: str = "sha256") -> RestoreResult:
    rejected: List[Tuple[str, str]] = []
    for name in names_newest_first:
        manifest = target.read_manifest(name)
        if manifest is None:
            continue
        local_name = manifest.get("local_name") or name
        local_path = os.path.join(ckpt_dir, local_name)
        if os.path.lexists(local_path) and _local_matches(local_path, manifest):
            return RestoreResult(local_path, name, manifest.get("step"), "local", manifest.get("created"), rejected)
        if os.path.lexists(local_path):  # something else by that name: never overwrite the trainer's files
            local_path = os.path.join(ckpt_dir, RESTORED_DIR, name, local_name)
            if os.path.lexists(local_path) and _local_matches(local_path, manifest):
                return RestoreResult(local_path, name, manifest.get("step"), "local", manifest.get("created"),
                                     rejected)
        problem = _fetch_verified(target, name, manifest, local_path, hash_name_default)
        if problem is None:
            emit("checkpoint_restored", checkpoint=name, step=manifest.get("step"), path=local_path,
                 durable=target.url)
            return RestoreResult(local_path, name, manifest.get("step"), "durable", manifest.get("created"),
                                 rejected)
        rejected.append((name, problem))
        emit("restore_verify_failed", checkpoint=name, problem=problem, durable=target.url)
    return RestoreResult(None, None, None, "", None, rejected)


def _fetch_verified(target: DurableTarget, name: str, manifest: Dict[str, Any], local_path: str,
                    hash_default: str) -> Optional[str]:
    """Fetch into a staging dir beside local_path, verify, move into place. A problem string, or None."""
    algo = manifest.get("hash", hash_default)
    parent = os.path.dirname(local_path)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, ".onbox-restore-%s.%d" % (name, os.getpid()))
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    files = [f["path"] for f in manifest["files"]]
    try:
        try:
            got = target.fetch(name, files, staging, algo)
        except (OSError, SyncFailed) as e:
            return "fetch failed: %s" % e
        for f in manifest["files"]:
            size, digest = got.get(f["path"], (None, None))
            if size != f["size"]:
                return "%s: size %s, manifest says %s" % (f["path"], size, f["size"])
            if digest != f.get(algo):
                return "%s: %s mismatch (corrupted on durable storage)" % (f["path"], algo)
            res = formats.check_file(os.path.join(staging, f["path"]), full=False)
            if not res.ok:
                return "%s: %s" % (f["path"], res.problem)
        # give the files their original mtimes, so the committer recognises them (no re-commit after restore)
        for rel, _size, mtime_ns in (manifest.get("source") or {}).get("fingerprint") or []:
            p = os.path.join(staging, rel)
            if os.path.isfile(p):
                os.utime(p, ns=(mtime_ns, mtime_ns))
        if manifest.get("kind") == "dir":
            os.rename(staging, local_path)
        else:
            os.rename(os.path.join(staging, files[0]), local_path)
        fsutil.fsync_dir(parent)
        return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
