"""Restore the newest committed checkpoint that verifies to the path the trainer reads.

A replacement box after a preemption starts with an empty checkpoint dir; a box that was killed during the
trainer's own save holds a torn or empty file at the very path the trainer resumes from (nanoGPT reads exactly
out_dir/ckpt.pt). Either way the verified copy goes to `<ckpt_dir>/<the name the trainer wrote>`: fetched into a
staging name beside it, every hash checked against its manifest, and only then moved into place. Whatever the
trainer left at that path is kept aside in `<ckpt_dir>/.onbox-aside/` (never deleted). A checkpoint that fails
verification is never handed over: the next newest is used and `restore_verify_failed` says so.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from onbox import fsutil, untrusted
from onbox.checkpoints import SyncFailed, formats
from onbox.checkpoints.durable import DurableTarget, hashcopy

ASIDE_DIR = ".onbox-aside"  # hidden: detection ignores it, so nothing kept aside is committed or resumed from


class RestoreResult(NamedTuple):
    path: Optional[str]
    name: Optional[str]
    step: Optional[int]
    source: str  # "local" (already there), "durable" (fetched now), "" (nothing)
    created: Optional[float]
    rejected: List[Tuple[str, str]]  # (checkpoint, problem) of newer ones that failed verification
    # (checkpoint, manifest digest, passed, problems) of every durable copy fetched and checked against its
    # manifest here (not a local copy found matching, not a fetch that failed): recorded in the index
    checks: List[Tuple[str, Optional[str], bool, List[str]]] = []
    # (checkpoint, problem) of newer ones that can never be restored: a manifest refused (manifest.BadManifest),
    # or a durable copy whose complete fetch did not match its manifest. The caller quarantines them; a fetch
    # that failed (the network, a full local disk) is only in `rejected`: it may work next time
    unusable: List[Tuple[str, str]] = []


def set_aside(ckpt_dir: str, path: str, reason: str, emit: Callable[..., None]) -> str:
    """Move a file or dir of the trainer's out of the way, into <ckpt_dir>/.onbox-aside/; never deletes.
    Only what lies directly or deeper inside the checkpoint dir is ever moved."""
    if not untrusted.is_under(os.path.dirname(os.path.abspath(path)), ckpt_dir):
        raise untrusted.UntrustedInput("refusing to move %s: it is not inside the checkpoint dir %s" % (
            path, ckpt_dir))
    aside = os.path.join(ckpt_dir, ASIDE_DIR)
    os.makedirs(aside, exist_ok=True)
    stamp = "." + time.strftime("%Y%m%dT%H%M%S")
    dest, k = os.path.join(aside, fsutil.fit_name(os.path.basename(path), stamp)), 1
    while os.path.lexists(dest):
        k += 1
        dest = os.path.join(aside, fsutil.fit_name(os.path.basename(path), "%s.%d" % (stamp, k)))
    os.rename(path, dest)
    fsutil.fsync_dir(os.path.dirname(path))
    emit("checkpoint_set_aside", path=path, moved_to=dest, reason=reason)
    return dest


def local_matches(path: str, manifest: Dict[str, Any]) -> bool:
    """The local entry holds the committed files: same sizes, and same mtimes (a restore gives them back) or,
    failing that, the same hashes."""
    root = path if manifest.get("kind") == "dir" else os.path.dirname(path)
    mtimes = {rel: m for rel, _size, m in (manifest.get("source") or {}).get("fingerprint") or []}
    algo = manifest.get("hash", hashcopy.HASH_NAME)
    for f in manifest["files"]:
        try:
            p = untrusted.join_under(root, f["path"], "checkpoint file")
            st = os.stat(p)
        except (OSError, ValueError):
            return False
        if not os.path.isfile(p) or st.st_size != f["size"]:
            return False
        if mtimes.get(f["path"]) != st.st_mtime_ns and hashcopy.hash_file(p, algo)[1] != f.get(algo):
            return False
    return True


def restore_newest(target: DurableTarget, names_newest_first: List[str], ckpt_dir: str,
                   emit: Callable[..., None], hash_name_default: str = "sha256",
                   local_wins: Optional[Callable[[Dict[str, Any]], bool]] = None) -> RestoreResult:
    """The newest committed checkpoint that verifies, at the path the trainer reads. `local_wins(manifest)`: a
    local complete checkpoint is newer than this committed one, so nothing is fetched (result path None)."""
    rejected: List[Tuple[str, str]] = []
    checks: List[Tuple[str, Optional[str], bool, List[str]]] = []
    unusable: List[Tuple[str, str]] = []
    for name in names_newest_first:
        try:
            manifest = target.read_manifest(name)
        except untrusted.UntrustedInput as e:  # manifest.BadManifest: it can never be restored, on any box
            rejected.append((name, str(e)))
            unusable.append((name, str(e)))
            emit("checkpoint_refused", checkpoint=name, problem=str(e), durable=target.url)
            continue
        if manifest is None:
            continue
        local_name = manifest.get("local_name") or name
        blocked = _blocked_locally(ckpt_dir, local_name)
        if blocked is not None:  # this box's problem, not the checkpoint's: never quarantined for it
            rejected.append((name, "%s; %s" % blocked))  # restore_rejected in checkpoint_status.json says both
            emit("restore_blocked_locally", checkpoint=name, step=manifest.get("step"), problem=blocked[0],
                 hint=blocked[1], durable=target.url)
            continue
        local_path = os.path.join(ckpt_dir, local_name)
        if local_wins is not None and local_wins(manifest):
            break
        if _present(local_path, manifest) and local_matches(local_path, manifest):
            _after_restore(ckpt_dir, local_name, manifest, emit)
            return RestoreResult(local_path, name, manifest.get("step"), "local", manifest.get("created"), rejected,
                                 checks, unusable)
        try:
            problem, checked = _fetch_verified(target, name, manifest, local_path, ckpt_dir, emit,
                                               hash_name_default)
        except OSError as e:  # the local side (a full disk, an entry in the way): say it, and try the next one
            problem = "it could not be put at %s: %s" % (local_path, e.strerror or e)
            rejected.append((name, problem))
            emit("restore_blocked_locally", checkpoint=name, step=manifest.get("step"), problem=problem,
                 hint="free or fix %s; the checkpoint itself is untouched on durable storage" % ckpt_dir,
                 durable=target.url)
            continue
        if checked:
            checks.append((name, manifest.get("digest"), problem is None, [problem] if problem else []))
        if problem is None:
            emit("checkpoint_restored", checkpoint=name, step=manifest.get("step"), path=local_path,
                 durable=target.url)
            return RestoreResult(local_path, name, manifest.get("step"), "durable", manifest.get("created"),
                                 rejected, checks, unusable)
        rejected.append((name, problem))
        if checked:
            unusable.append((name, problem))
        emit("restore_verify_failed", checkpoint=name, problem=problem, durable=target.url)
    return RestoreResult(None, None, None, "", None, rejected, checks, unusable)


def _present(local_path: str, manifest: Dict[str, Any]) -> bool:
    """Something is at the restored checkpoint's place (for a group, every member file)."""
    if manifest.get("kind") == "files":
        root = os.path.dirname(local_path)
        return all(os.path.lexists(os.path.join(root, f["path"])) for f in manifest["files"])
    return os.path.lexists(local_path)


def _after_restore(ckpt_dir: str, local_name: str, manifest: Dict[str, Any], emit: Callable[..., None]) -> None:
    """What the checkpoint's format needs beside it (TensorFlow's `checkpoint` state file naming it)."""
    fmt = formats.named(manifest.get("format") or "")
    if fmt is None:
        return
    wrote = fmt.after_restore(ckpt_dir, local_name, [f["path"] for f in manifest["files"]])
    if wrote is not None:
        emit("checkpoint_restore_state", path=wrote, checkpoint=manifest.get("name"), format=fmt.name)


def _blocked_locally(ckpt_dir: str, local_name: str) -> Optional[Tuple[str, str]]:
    """(problem, what to do) when the path a checkpoint is restored to cannot be written here: the trainer's dir
    holds a symlink by that name leading outside it (onbox never writes through one). The checkpoint is good: the
    next older one is tried, and this one is restored once the entry is removed."""
    try:
        untrusted.join_under(ckpt_dir, local_name, "local_name")
    except untrusted.UntrustedInput:
        path = os.path.join(ckpt_dir, local_name)
        try:
            to = " (to %s)" % os.readlink(path)
        except OSError:
            to = ""
        return ("%s is a symlink leading outside the checkpoint dir%s: onbox does not write through it"
                % (path, untrusted.printable(to)),
                "remove it (`rm %s`): the next attempt restores this checkpoint; it stays on durable storage"
                % path)
    return None


def _fetch_verified(target: DurableTarget, name: str, manifest: Dict[str, Any], local_path: str, ckpt_dir: str,
                    emit: Callable[..., None], hash_default: str) -> Tuple[Optional[str], bool]:
    """Fetch into a staging dir beside local_path, verify, keep what is at local_path aside, move into place.
    (a problem string or None, whether the durable copy was checked: False when the fetch itself failed)."""
    algo = manifest.get("hash", hash_default)
    parent = os.path.dirname(local_path)
    os.makedirs(parent, exist_ok=True)
    # the staging name stays short whatever the checkpoint's name (a legal 248-byte name plus a prefix and a
    # suffix would pass the 255-byte limit of a file name)
    staging = os.path.join(parent, fsutil.fit_name(".onbox-restore-" + name, ".%d" % os.getpid()))
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    files = [f["path"] for f in manifest["files"]]
    try:
        try:
            got = target.fetch(name, files, staging, algo)
        except untrusted.UntrustedInput as e:  # a payload file that leads out of the checkpoint (a symlink)
            return "refused: %s" % e, True
        except (OSError, SyncFailed) as e:
            return "fetch failed: %s" % e, False
        for f in manifest["files"]:
            size, digest = got.get(f["path"], (None, None))
            if size != f["size"]:
                return "%s: size %s, manifest says %s" % (f["path"], size, f["size"]), True
            if digest != f.get(algo):
                return "%s: %s mismatch (corrupted on durable storage)" % (f["path"], algo), True
            res = formats.check_file(os.path.join(staging, f["path"]), full=False)
            if not res.ok:
                return "%s: %s" % (f["path"], res.problem), True
        # give the files their original mtimes, so the committer recognises them (no re-commit after restore)
        for rel, _size, mtime_ns in (manifest.get("source") or {}).get("fingerprint") or []:
            p = os.path.join(staging, rel)  # rel is one of the file list's paths (manifest.problem checks it)
            if os.path.isfile(p):
                os.utime(p, ns=(mtime_ns, mtime_ns))
        # the trainer's own (torn, empty, older or quarantined) copy: kept aside, never deleted
        for there in ([os.path.join(parent, f) for f in files] if manifest.get("kind") == "files" else [local_path]):
            if os.path.lexists(there):
                set_aside(ckpt_dir, there, "replaced by the verified copy of %s from durable storage" % name, emit)
        if manifest.get("kind") == "dir":
            os.rename(staging, local_path)
        elif manifest.get("kind") == "files":  # a group (TensorFlow's index and shards): each under its name
            for f in files:
                os.rename(os.path.join(staging, f), os.path.join(parent, f))
        else:
            os.rename(os.path.join(staging, files[0]), local_path)
        fsutil.fsync_dir(parent)
        _after_restore(ckpt_dir, os.path.basename(local_path), manifest, emit)
        return None, True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
