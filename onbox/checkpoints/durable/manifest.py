"""MANIFEST.json and checkpoints_index.json entries are read from durable storage, which anyone holding the
bucket's keys can write: both are checked here before any reader acts on them.

A manifest is refused (BadManifest) unless every field a reader uses has the type and the shape onbox writes:
each file path relative, without `..`, `.`, empty parts or NUL (a restore joins it to the checkpoint dir: a path
`../../x` would write outside it on every box that restores), at most one entry per path and no path that is
also another's directory, sizes whole non-negative numbers, a hash algorithm onbox can compute and a digest of
that algorithm's length for each file, a `local_name` that is one directory entry and not hidden, a `kind` of "files" (top-level files that are one checkpoint, as TensorFlow's), "file" (exactly
one file, at the top) or "dir". A refused checkpoint does not exist for restore and verify; restore quarantines
it and falls back to an older one.

An index entry is only a convenience (the manifests are the truth): one that fails `entry_problem` is dropped and
rebuilt from its manifest.
"""
from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import untrusted
from onbox.checkpoints import HOLDER_RE
from onbox.checkpoints.durable import hashcopy

# the algorithms a manifest may name, with their hex digest length: hashlib's guaranteed set, less the
# variable-length SHAKE functions (their digest has no fixed length to check)
HASH_HEX_LENGTHS = {a: hashlib.new(a).digest_size * 2 for a in sorted(hashlib.algorithms_guaranteed)
                    if not a.startswith("shake_")}
DEFAULT_HASH = "sha256"
MAX_FILES = 1_000_000
HEX = frozenset("0123456789abcdef")


class BadManifest(untrusted.UntrustedInput):
    """A MANIFEST.json that is present but cannot be acted on; the message says which field is wrong."""


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _time(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def _optional_name(v: Any) -> Optional[str]:
    return None if v is None else untrusted.name_problem(v)


def local_name_problem(v: Any) -> Optional[str]:
    """Why `v` cannot be the name a checkpoint is restored under in the trainer's dir, or None. Besides being one
    directory entry, it is never hidden: onbox never commits a dot entry (detection skips them), and its own
    entries there are dot names (`.onbox-aside`, `.onbox-restore-*`): a manifest naming `.onbox-aside` made every
    restore try to move that dir into itself and give up on the older good checkpoints too."""
    why = _optional_name(v)
    if why is None and v is not None and v.startswith("."):
        return "a hidden name: onbox never commits one, and its own entries in the checkpoint dir are named so"
    return why


def problem(doc: Any, name: Optional[str] = None) -> Optional[str]:
    """What makes `doc` (a parsed MANIFEST.json of the checkpoint dir `name`) unusable, or None."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if name is not None and untrusted.name_problem(name):
        return "checkpoint name %r: %s" % (name, untrusted.name_problem(name))
    why = _optional_name(doc.get("name"))
    if why:
        return "name %r: %s" % (doc.get("name"), why)
    if doc.get("name") is not None and name is not None and doc["name"] != name:
        return "it names checkpoint %r but lives in %r" % (doc["name"], name)
    algo = doc.get("hash", DEFAULT_HASH)
    if not isinstance(algo, str) or algo not in HASH_HEX_LENGTHS:
        return "unknown hash algorithm %r (onbox computes %s)" % (algo, ", ".join(sorted(HASH_HEX_LENGTHS)))
    files = doc.get("files")
    if not isinstance(files, list) or not files:
        return "no file list" if not isinstance(files, list) else "an empty file list"
    if len(files) > MAX_FILES:
        return "more than %d files" % MAX_FILES
    seen = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            return "files[%d] is not an object" % i
        why = untrusted.relpath_problem(f.get("path"))
        if why:
            return "files[%d].path %r: %s" % (i, f.get("path"), why)
        if f["path"] in seen:
            return "files[%d].path %r is listed twice" % (i, f["path"])
        seen.add(f["path"])
        if not _count(f.get("size")):
            return "files[%d].size %r is not a byte count" % (i, f.get("size"))
        digest = f.get(algo)
        if not (isinstance(digest, str) and len(digest) == HASH_HEX_LENGTHS[algo] and set(digest) <= HEX):
            return "files[%d].%s %r is not a %s digest" % (i, algo, digest, algo)
    for p in seen:  # "a" and "a/b" cannot both be files
        parent = p.rpartition("/")[0]
        while parent:
            if parent in seen:
                return "%r is listed as a file and as the directory of %r" % (parent, p)
            parent = parent.rpartition("/")[0]
    kind = doc.get("kind", "dir")
    if not isinstance(kind, str) or kind not in ("file", "dir", "files"):
        return "kind %r is not 'file', 'dir' or 'files'" % (kind,)
    if kind == "file" and (len(files) != 1 or "/" in files[0]["path"]):
        return "kind 'file' with %d file(s) or a path with a directory in it" % len(files)
    if kind == "files" and (not files or any("/" in f["path"] or f["path"].startswith(".") for f in files)):
        return "kind 'files' with no file, a path with a directory in it, or a hidden name"
    why = local_name_problem(doc.get("local_name"))
    if why:
        return "local_name %r: %s" % (doc.get("local_name"), why)
    step = doc.get("step")
    if step is not None and not _count(step):
        return "step %r is not a whole non-negative number" % (step,)
    if not _time(doc.get("created")):
        return "created %r is not a time" % (doc.get("created"),)
    for key in ("bytes",):
        if doc.get(key) is not None and not _count(doc[key]):
            return "%s %r is not a byte count" % (key, doc[key])
    if doc.get("digest") is not None and not isinstance(doc["digest"], str):
        return "digest %r is not a string" % (doc["digest"],)
    if doc.get("metrics") is not None and not isinstance(doc["metrics"], dict):
        return "metrics is not an object"
    why = lease_problem(doc)
    if why:
        return why
    source = doc.get("source")
    if source is not None and not isinstance(source, dict):
        return "source is not an object"
    fp = (source or {}).get("fingerprint")
    if fp is not None:
        if not isinstance(fp, list):
            return "source.fingerprint is not a list"
        for i, row in enumerate(fp):
            if not (isinstance(row, list) and len(row) == 3 and _count(row[1]) and _count(row[2])):
                return "source.fingerprint[%d] is not [path, size, mtime_ns]" % i
            if row[0] not in seen:
                return "source.fingerprint[%d] names %r, which the file list does not hold" % (i, row[0])
    return None


def check(doc: Any, name: Optional[str] = None) -> Dict[str, Any]:
    """`doc` when it is a usable manifest of checkpoint `name`, else BadManifest saying why."""
    why = problem(doc, name)
    if why:
        raise BadManifest("MANIFEST.json%s refused: %s" % (" of %s" % name if name else "", why))
    return doc


def parse(raw: bytes, name: Optional[str] = None) -> Dict[str, Any]:
    """The bytes of a MANIFEST.json, parsed with the nesting bound and checked; BadManifest otherwise."""
    if len(raw) > untrusted.MANIFEST_MAX_BYTES:
        raise BadManifest("MANIFEST.json%s refused: larger than %s" % (
            " of %s" % name if name else "", untrusted.human(untrusted.MANIFEST_MAX_BYTES)))
    try:
        doc = untrusted.loads_json(raw, "MANIFEST.json")
    except (ValueError, UnicodeDecodeError) as e:
        raise BadManifest("MANIFEST.json%s refused: %s" % (" of %s" % name if name else "", e))
    return check(doc, name)


def entry_problem(e: Any) -> Optional[str]:
    """What makes a checkpoints_index.json entry unusable (restore, retention and `onbox checkpoints` read its
    name, step, time and metrics), or None."""
    if not isinstance(e, dict):
        return "not an object"
    why = untrusted.name_problem(e.get("name"))
    if why:
        return "name %r: %s" % (e.get("name"), why)
    why = local_name_problem(e.get("local_name"))
    if why:
        return "local_name %r: %s" % (e.get("local_name"), why)
    if e.get("step") is not None and not _count(e["step"]):
        return "step %r is not a whole non-negative number" % (e["step"],)
    if not _time(e.get("created")):
        return "created %r is not a time" % (e.get("created"),)
    if e.get("metrics") is not None and not isinstance(e["metrics"], dict):
        return "metrics is not an object"
    for key in ("digest", "hash"):
        if e.get(key) is not None and not isinstance(e[key], str):
            return "%s %r is not a string" % (key, e[key])
    if e.get("verification") is not None and not isinstance(e["verification"], dict):
        return "verification is not an object"
    return lease_problem(e)


def lease_problem(doc: Dict[str, Any]) -> Optional[str]:
    """The lease a checkpoint was committed under (fencing.py), optional: `epoch` a whole number, `holder` a
    holder's name (both absent or null for one committed without leases)."""
    epoch, holder = doc.get("epoch"), doc.get("holder")
    if epoch is not None and not _count(epoch):
        return "epoch %r is not a whole non-negative number" % (epoch,)
    if holder is not None and not (isinstance(holder, str) and HOLDER_RE.match(holder)):
        return "holder %r is not a lease holder's name" % (holder,)
    return None


FormatCheck = Callable[[str], Tuple[str, str, Optional[str]]]  # one file: (kind, note, problem or None)


def check_files(ckpt_dir: str, manifest: Dict[str, Any], format_check: Optional[FormatCheck] = None,
                rows: Optional[List[Dict[str, Any]]] = None) -> List[str]:
    """Every file the manifest lists: present, the right size, the right hash, and what `format_check` says of it
    when given (verify's full format check). Each file's row goes to `rows` when given.

    The hash of one file and the CRC pass of another run in parallel threads (hashlib and zlib release the GIL
    on large buffers), so a verify costs about one hash pass of wall time on a box with two cores or more.
    """
    from concurrent.futures import Future, ThreadPoolExecutor

    problems = []
    algo = manifest.get("hash", hashcopy.HASH_NAME)
    entries = [e for e in manifest.get("files", []) if isinstance(e, dict)]
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        jobs: List[Tuple[Optional["Future[Tuple[int, str]]"], Optional["Future[Tuple[str, str, Optional[str]]]"]]] = []
        paths: List[Optional[str]] = []
        for entry in entries:
            try:  # a listed path outside the checkpoint (../, absolute, a symlink out) is never opened
                path: Optional[str] = untrusted.join_under(ckpt_dir, entry.get("path"), "listed path")
            except untrusted.UntrustedInput:
                path = None
            paths.append(path)
            if (path is not None and os.path.isfile(path) and not os.path.islink(path)
                    and os.path.getsize(path) == entry.get("size")):
                jobs.append((pool.submit(hashcopy.hash_file, path, algo),
                             pool.submit(format_check, path) if format_check is not None else None))
            else:
                jobs.append((None, None))
        for entry, path, (hash_job, format_job) in zip(entries, paths, jobs):
            rel = entry.get("path", "")
            row: Dict[str, Any] = {"path": rel, "size": entry.get("size"), "kind": "", "ok": True, "problem": None,
                                   "note": ""}
            problem = None
            if path is None:
                problem = "refused: %s" % (untrusted.relpath_problem(rel) or "it leads outside the checkpoint")
            elif os.path.islink(path):
                problem = "a symlink (%s), not a file of the checkpoint" % os.readlink(path)
            elif not os.path.isfile(path):
                problem = "missing"
            elif hash_job is None:
                problem = "size %d, manifest says %s (truncated or replaced)" % (os.path.getsize(path), entry.get("size"))
            elif hash_job.result()[1] != entry.get(algo, entry.get("hash")):
                problem = "%s mismatch (content corrupted)" % algo
            elif format_job is not None:
                kind, note, problem = format_job.result()
                row.update(kind=kind, note=note)
            if problem:
                problems.append("%s: %s" % (rel, problem))
                row.update(ok=False, problem=problem)
            if rows is not None:
                rows.append(row)
    return problems
