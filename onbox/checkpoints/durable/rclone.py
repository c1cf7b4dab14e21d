"""The rclone durable target: object stores and anything rclone reaches (S3 and its kin, sftp, webdav, GCS, ...).

Object stores have no rename and no directories, so the protocol is: the partial marker, the payload, a check of
what landed, MANIFEST.json last; a checkpoint dir without a manifest does not exist for readers, and what an
interrupted commit left (its marker says it is onbox's) is removed at the next start. A checkpoint is deleted
marker first, manifest next, payload, marker last, so a kill anywhere leaves a committed checkpoint or a leftover
the next start recognises.

S3 facts this relies on (the tests check them against `rclone serve s3`):
- an object appears whole when its upload (one PUT, or a multipart upload's completion) ends, never half-written;
- `rclone cat` of a key that does not exist prints nothing and exits 0 (rclone reads the key as a prefix): reads
  go by a listing, and empty output reads as absent;
- a multipart upload killed half-way stays on the server, out of listings and billed, until it is aborted: the
  next start aborts the run's (a bucket lifecycle rule is the backstop, README);
- a directory `moveto` is a copy and a delete per object, in no fixed order: quarantine copies (manifest last)
  and removes the source after.
Every call is a list argv with a timeout that grows with the bytes moved (rclonecall.py has the flags), made over
the target's one `rclone rcd` (rcd.py, rclonerc.py: the same call as rc methods) or, where that cannot run, as a
process of its own.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from onbox import fsutil, untrusted
from onbox.checkpoints import INDEX, MANIFEST, SyncFailed
from onbox.checkpoints.durable import (
    LEASE_MAX_BYTES,
    LEASES_DIR,
    PARTIAL_MARKER,
    QUARANTINE_DIR,
    FileHashes,
    foreign_entry,
    hashcopy,
    manifest,
    rclonerc,
)
from onbox.checkpoints.durable.rcd import Rcd, RcdGone
from onbox.checkpoints.durable.rclonecall import (
    FRESH_UPLOAD_FLAGS,
    LEASE_LIST_FLAGS,
    LIST_FLAGS,
    NOT_FOUND_RC,
    RCLONE,
    RCLONE_FLAGS,
    failed,
    names_in,
    sizes,
    under,
)
from onbox.environment import Environment
from onbox.toolrun import call

MiB = 1024 * 1024
HASH_WORKERS = 2  # the payload's sha256 runs beside the upload (hashlib lets go of the GIL): two files at a time


class RcloneTarget:
    def __init__(self, remote: str, run: str, runner: Optional[Callable[..., Any]] = None, rclone: str = "rclone",
                 base_timeout: float = 60.0, min_rate: float = 1 * MiB, extra_flags: Sequence[str] = (),
                 daemon: Optional[bool] = None, trace: Optional[Callable[[float, List[str], str], None]] = None) -> None:
        """`runner`: the subprocess seam (a test's fake makes every call a process call). `daemon`: make the calls
        over one `rclone rcd` (rcd.py); by default when `runner` is the real one and ONBOX_RCLONE_RCD is not 0.
        `trace(seconds, args, how)`: told of each call ("rc" or "cli"), for the benchmark."""
        base = remote.rstrip("/")
        self.run_root = base + run if base.endswith(":") else base + "/" + run
        self.ckpts = self.run_root + "/checkpoints"
        self.url = self.run_root
        self.rclone = rclone
        self.runner = runner or call  # the subprocess seam (onbox.toolrun)
        self.base_timeout = base_timeout
        self.min_rate = min_rate  # bytes/s below which a transfer counts as hung
        self.flags = list(RCLONE_FLAGS) + list(extra_flags)
        if daemon is None:
            daemon = runner is None and Environment.read().rclone_rcd != "0"
        self.rcd: Optional[Rcd] = Rcd(rclone, self.flags) if daemon else None
        if self.rcd is not None:  # the daemon goes with the target (or at this process's exit), never later
            weakref.finalize(self, self.rcd.stop)
        self.trace = trace
        # every file under checkpoints/ (path -> bytes) as the last list_names() saw it, None after a write of
        # ours: the reads of one commit (which manifests exist, whose marker, what a dir holds) need no call each
        self._listing: Optional[Dict[str, int]] = None
        self._just_listed = False  # no call since list_names(): its listing is what a new one would say
        self._dir_moves: Optional[bool] = None  # the backend renames a directory in one call (sftp, local)

    # -- one place for every rclone call --------------------------------------------------------------------
    def _rc(self, args: List[str], nbytes: int = 0, check: bool = True, binary: bool = False) -> Any:
        self._just_listed = False
        t0 = time.monotonic()
        how = ["cli"]  # "rc" once the daemon answered it
        runner = self.runner
        if self.rcd is not None and self.rcd.ready():
            runner = functools.partial(self._over_rcd, args, how)
        proc = RCLONE.run([self.rclone, *args, *self.flags], self.base_timeout + nbytes / self.min_rate,
                          check=False, binary=binary, runner=runner, op=args[0], url=self.url)
        if self.trace is not None:
            self.trace(time.monotonic() - t0, args, how[0])
        if check and proc.returncode != 0:
            raise failed(proc, args[0], self.url)
        return proc

    def _over_rcd(self, args: List[str], how: List[str], argv: List[str], **kw: Any) -> Any:
        """The runner for a call made over the daemon (rclonerc.py): the same answer a process would give, or, for a
        call the rc path does not make, the process itself. A daemon that ended before the call reached it is
        started again (once); one that ended during the call fails the call (its work may or may not be done)."""
        assert self.rcd is not None
        binary = not kw.get("text")
        for _attempt in range(2):
            if not self.rcd.ready():
                break  # it cannot be had here: the process
            how[0] = "rc"
            try:
                done = rclonerc.run(self.rcd, args, kw["timeout"], binary=binary)
            except RcdGone as e:
                if e.sent:
                    return rclonerc.failed_call(argv, str(e), binary)
                if self.rcd.pid is not None:  # running, and its socket refuses (gone: a tmp cleaner): a new one
                    self.rcd.kill()
                continue
            if done is not None:
                return done
            break  # a call the rc path does not make
        how[0] = "cli"
        return self.runner(argv, **kw)

    def close(self) -> None:
        """Stop this target's rclone rcd, if one runs (a later call starts another)."""
        if self.rcd is not None:
            self.rcd.stop()

    def _lsjson(self, path: str, *opts: str) -> Optional[Dict[str, int]]:
        """{path: bytes} under `path`, None when rclone says there is no such directory (S3: an empty listing)."""
        proc = self._rc(["lsjson", path, *opts], check=False)
        if proc.returncode == NOT_FOUND_RC:
            return None
        if proc.returncode != 0:
            raise failed(proc, "lsjson", self.url)
        return sizes(proc.stdout)

    def _cat(self, path: str, limit: int) -> Optional[bytes]:
        """The bytes of a remote file, at most limit + 1 of them (--count: a bucket holding a 20 GB
        "MANIFEST.json" must not fill this box's memory); None when it cannot be read, b"" when it is absent
        on S3 (see the module docstring) or empty."""
        proc = self._rc(["cat", "--count", str(limit + 1), path], check=False, binary=True)
        return proc.stdout if proc.returncode == 0 else None

    def _cat_json(self, path: str, limit: int = untrusted.INDEX_MAX_BYTES) -> Optional[Dict[str, Any]]:
        raw = self._cat(path, limit)
        if not raw or len(raw) > limit:
            return None
        try:
            doc = untrusted.loads_json(raw, path)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def _put_json(self, path: str, doc: Dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            local = os.path.join(tmp, os.path.basename(path))
            fsutil.atomic_write_json(local, doc)
            # always sent: a renewed lease may match the last one in size and, where the backend keeps times to
            # the second (sftp), in time too, and rclone would skip it as unchanged
            self._rc(["copyto", local, path, "--ignore-times"])

    def _swap(self, name: str, put: str, doc: Optional[Dict[str, Any]] = None) -> Tuple[Any, int]:
        """One `rclone sync` into <name>/ that uploads `put` (MANIFEST.json with `doc`, or the marker) and then
        deletes the other of the two: rclone deletes only after every transfer succeeded, and looks at nothing
        else in the dir. (the call's result, not raised; the bytes of `put`)."""
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            local = os.path.join(tmp, put)
            if doc is None:
                open(local, "wb").close()
            else:
                fsutil.atomic_write_json(local, doc)
            return self._rc(["sync", tmp, "%s/%s" % (self.ckpts, name), "--include", "/" + MANIFEST,
                             "--include", "/" + PARTIAL_MARKER], check=False), os.path.getsize(local)

    def _purge_ours(self, name: str) -> None:
        """A manifest-less dir of ours: the payload first, then the marker with the dir (a purge deletes in no
        fixed order: a kill midway must not leave payload without its marker, which would read as not ours)."""
        dest = "%s/%s" % (self.ckpts, name)
        self._rc(["delete", dest, "--exclude", "/" + PARTIAL_MARKER, "--rmdirs"], check=False)
        self._rc(["purge", dest], check=False)

    # -- DurableTarget ---------------------------------------------------------------------------------------
    def free_space(self) -> Optional[fsutil.FreeSpace]:
        return None  # `rclone about` is unsupported by many backends; the remote reports ENOSPC loudly instead

    def list_names(self) -> List[str]:
        self._listing = self._lsjson(self.ckpts, *LIST_FLAGS) or {}
        self._just_listed = True
        return names_in(self._listing)

    def read_manifest(self, name: str) -> Optional[Dict[str, Any]]:
        """The checked manifest, None when there is none, BadManifest when one is there and refused."""
        if untrusted.name_problem(name):
            return None  # not one entry of the listing: never a path to follow
        listed = (under(self._listing, name) or {}).get(MANIFEST) if self._listing is not None else -1
        if listed is None:
            return None  # not in the last listing
        raw = self._cat("%s/%s/%s" % (self.ckpts, name, MANIFEST), untrusted.MANIFEST_MAX_BYTES)
        if raw is None or (not raw and listed != 0):
            return None  # gone since the listing (or, without one, absent)
        return manifest.parse(raw, name)  # an empty one listed as empty is refused there

    def put_payload(self, name: str, root: str, files: List[str], hash_name: str) -> FileHashes:
        dest = "%s/%s" % (self.ckpts, name)
        there = under(self._listing, name)
        if there is None:
            there = self._lsjson(dest, *LIST_FLAGS) or {}
        if there and PARTIAL_MARKER not in there:
            raise foreign_entry(self.run_root, name)  # somebody else's files: never overwrite them
        self._listing = None
        if PARTIAL_MARKER not in there:
            self._put_marker(name)
        total = sum(os.path.getsize(os.path.join(root, rel)) for rel in files)
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            listing = os.path.join(tmp, "files")
            with open(listing, "w", encoding="utf-8") as f:
                f.write("".join(rel + "\n" for rel in files))
            hashcopy.fault_point("before-upload")
            out = self._upload_hashing(root, dest, listing, files, hash_name, total, fresh=not there)
        problems = self.verify(name, {"files": [{"path": r, "size": s} for r, (s, _) in out.items()]})
        if problems:  # U33: trust what landed, not the exit code alone
            raise SyncFailed("upload to %s incomplete: %s" % (dest, "; ".join(problems)), errno_name="EIO")
        return out

    def _put_marker(self, name: str) -> None:
        """durable.PARTIAL_MARKER into <name>/, before any payload byte: this dir is onbox's, not committed."""
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            marker = os.path.join(tmp, PARTIAL_MARKER)
            open(marker, "wb").close()
            self._rc(["copyto", marker, "%s/%s/%s" % (self.ckpts, name, PARTIAL_MARKER)])

    def _upload_hashing(self, root: str, dest: str, listing: str, files: List[str], hash_name: str,
                        total: int, fresh: bool) -> FileHashes:
        """One `rclone copy` of the payload while the files are hashed beside it. A file the trainer rewrites
        meanwhile is caught by the committer's fingerprint check after the copy, as with a hash taken first."""
        with ThreadPoolExecutor(max_workers=max(1, min(HASH_WORKERS, len(files)))) as pool:
            pending = [(rel, pool.submit(hashcopy.hash_file, os.path.join(root, rel), hash_name))
                       for rel in sorted(files, key=lambda r: -os.path.getsize(os.path.join(root, r)))]
            try:
                # into a dir of only the marker just put there, or over a leftover of ours (each file replaced)
                how = FRESH_UPLOAD_FLAGS if fresh else ["--no-traverse", "--ignore-times"]
                self._rc(["copy", root, dest, "--files-from-raw", listing, *how], nbytes=total)
            except BaseException:
                for _rel, fut in pending:
                    fut.cancel()  # the ones not started yet: a failed upload waits for no more hashing
                raise
            out = {rel: fut.result() for rel, fut in pending}
        return {rel: out[rel] for rel in files}

    def put_manifest(self, name: str, manifest: Dict[str, Any]) -> None:
        self._listing = None
        proc, size = self._swap(name, MANIFEST, manifest)  # the manifest up (the commit point), then the marker gone
        if proc.returncode != 0 and self.verify(name, {"files": [{"path": MANIFEST, "size": size}]}):
            raise failed(proc, "sync", self.url)  # not there: not committed (else only the marker stayed: harmless)

    def remove(self, name: str) -> None:
        self._listing = None
        # the marker back first, then the manifest gone (one sync, deletions after uploads): readers stop seeing
        # it, and a kill from here on leaves a leftover of ours that the next start cleans
        proc, _ = self._swap(name, PARTIAL_MARKER)
        if proc.returncode != 0:
            raise failed(proc, "sync", self.url)  # the manifest may still be there: the payload must stay too
        self._purge_ours(name)

    def quarantine(self, name: str, stamp: str) -> str:
        src = "%s/%s" % (self.ckpts, name)
        dest = "%s/%s/%s.%s" % (self.run_root, QUARANTINE_DIR, name, stamp)
        self._listing = None
        size = sum((self._lsjson(src, *LIST_FLAGS) or {}).values())
        if self._moves_dirs():  # one rename on this backend: gone for readers at once, whole in quarantine/
            self._rc(["moveto", src, dest], nbytes=size)
            return dest
        # no directory rename (S3 and its kin): a server-side copy where the backend has one, the manifest last, so
        # a kill midway leaves the checkpoint committed where it was (and a manifest-less copy in quarantine/)
        self._rc(["copy", src, dest, "--exclude", "/" + MANIFEST, "--exclude", "/" + PARTIAL_MARKER], nbytes=size)
        self._rc(["copyto", "%s/%s" % (src, MANIFEST), "%s/%s" % (dest, MANIFEST)])
        self.remove(name)
        return dest

    def _moves_dirs(self) -> bool:
        """Whether the backend renames a directory in one call (rclone's DirMove feature); asked once."""
        if self._dir_moves is None:
            proc = self._rc(["backend", "features", self.run_root], check=False)
            try:
                self._dir_moves = proc.returncode == 0 and bool(json.loads(proc.stdout)["Features"].get("DirMove"))
            except (ValueError, KeyError, TypeError, AttributeError):
                self._dir_moves = False  # the copy protocol is right everywhere, only slower
        return self._dir_moves

    def read_index(self) -> Optional[Dict[str, Any]]:
        return self._cat_json("%s/%s" % (self.run_root, INDEX))

    def write_index(self, doc: Dict[str, Any]) -> None:
        self._put_json("%s/%s" % (self.run_root, INDEX), doc)

    def clean_leftovers(self, before_write: Optional[Callable[[], None]] = None) -> List[str]:
        # the listing the committer's first read made a moment ago will do: no call came between
        dirs = names_in(self._listing or {}) if self._just_listed else self.list_names()
        listing = self._listing or {}
        # a dir without the marker is not ours; one with a manifest is committed (the manifest rules)
        removed = [d for d in dirs if "%s/%s" % (d, PARTIAL_MARKER) in listing
                   and "%s/%s" % (d, MANIFEST) not in listing]
        if not removed:
            return []
        if before_write is not None:
            before_write()
        self._listing = None
        # S3: an upload killed half-way is still open on the server (out of listings, billed) until aborted. No
        # commit of this run is under way now (the commit lock, the lease), so every open one under checkpoints/
        # is a leftover. Backends without the command fail it and nothing changes.
        self._rc(["backend", "cleanup", self.ckpts, "-o", "max-age=0"], check=False)
        for d in removed:
            self._purge_ours(d)
        return removed

    def fetch(self, name: str, files: List[str], dest: str, hash_name: str) -> FileHashes:
        listed = under(self._listing, name) or self._lsjson("%s/%s" % (self.ckpts, name), *LIST_FLAGS) or {}
        total = sum(listed.values())
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            listing = os.path.join(tmp, "files")
            with open(listing, "w", encoding="utf-8") as f:
                f.write("".join(rel + "\n" for rel in files))
            self._rc(["copy", "%s/%s" % (self.ckpts, name), dest, "--files-from-raw", listing, "--no-traverse"],
                     nbytes=total)
        out: FileHashes = {}
        for rel in files:
            p = os.path.join(dest, rel)
            if os.path.isfile(p):
                out[rel] = hashcopy.hash_file(p, hash_name)
        return out

    def put_logs(self, local_dir: str, names: List[str], subdir: str) -> None:
        """Every one of `names` (files in local_dir) to <run>/logs/<subdir>/, in one call."""
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            listing = os.path.join(tmp, "files")
            with open(listing, "w", encoding="utf-8") as f:
                f.write("".join(n + "\n" for n in names))
            total = sum(os.path.getsize(os.path.join(local_dir, n)) for n in names)
            self._rc(["copy", local_dir, "%s/logs/%s" % (self.run_root, subdir), "--files-from-raw", listing,
                      "--no-traverse"], nbytes=total)

    def list_leases(self) -> List[str]:
        return sorted(self._lsjson("%s/%s" % (self.run_root, LEASES_DIR), *LEASE_LIST_FLAGS) or {})

    def read_lease(self, name: str) -> bytes:
        path = "%s/%s/%s" % (self.run_root, LEASES_DIR, name)
        proc = self._rc(["cat", "--count", str(LEASE_MAX_BYTES + 1), path], check=False, binary=True)
        if proc.returncode != 0 or not proc.stdout:  # S3 says nothing of a missing key: the listing tells
            if name not in (self._lsjson("%s/%s" % (self.run_root, LEASES_DIR), *LEASE_LIST_FLAGS, "--include",
                                         "/" + name) or {}):
                raise FileNotFoundError(path)
            if proc.returncode != 0:
                self._rc(["cat", "--count", str(LEASE_MAX_BYTES + 1), path], binary=True)  # raise with its message
        if len(proc.stdout) > LEASE_MAX_BYTES:
            reason = "is too large (more than %s)" % untrusted.human(LEASE_MAX_BYTES)
            raise untrusted.UntrustedInput("lease file %s %s" % (path, reason), reason)
        return bytes(proc.stdout)

    def put_lease(self, name: str, doc: Dict[str, Any]) -> None:
        self._put_json("%s/%s/%s" % (self.run_root, LEASES_DIR, name), doc)

    def verify(self, name: str, manifest: Dict[str, Any]) -> List[str]:
        """Sizes on the remote against the manifest (a full hash check happens on restore, locally)."""
        sizes_there = self._lsjson("%s/%s" % (self.ckpts, name), *LIST_FLAGS) or {}
        problems = []
        for f in manifest.get("files", []):
            if f["path"] not in sizes_there:
                problems.append("%s: missing on the remote" % f["path"])
            elif sizes_there[f["path"]] != f["size"]:
                problems.append("%s: %d bytes on the remote, expected %d" % (
                    f["path"], sizes_there[f["path"]], f["size"]))
        return problems

