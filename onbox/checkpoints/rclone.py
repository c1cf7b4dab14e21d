"""The rclone durable target: object stores and anything rclone reaches (sftp, webdav, S3, GCS, ...).

Object stores have no rename, so the protocol is: payload first, MANIFEST.json last; a checkpoint dir without a
manifest does not exist for readers, and leftovers of an interrupted upload are purged at the next start.
Every call is a list argv with a timeout that grows with the bytes moved.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

from onbox import fsutil, untrusted
from onbox.checkpoints import INDEX, MANIFEST, SyncFailed, hashcopy, manifest
from onbox.checkpoints.durable import (
    LEASE_MAX_BYTES,
    LEASES_DIR,
    PARTIAL_MARKER,
    QUARANTINE_DIR,
    FileHashes,
    foreign_entry,
)
from onbox.toolrun import Says, Tool, call, stderr_tail

RCLONE_FLAGS = ["--retries", "1", "--low-level-retries", "3", "--contimeout", "10s", "--timeout", "30s"]
NOT_FOUND_RC = 3  # rclone: "directory not found"
MiB = 1024 * 1024
INTACT = "the previous committed checkpoint is intact"
RCLONE = Tool("rclone", SyncFailed,
              missing=Says("rclone is not installed on this box", "apt-get install rclone, or use a mounted path"),
              timed_out=Says("rclone {op} timed out after {timeout:.0f} s ({url})",
                             "check the network to the remote; " + INTACT, errno_name="ETIMEDOUT"),
              failed=Says("rclone {op} failed (exit {rc}) for {url}: {stderr}",
                          "check the remote (credentials, quota, network); " + INTACT, errno_name="EIO"),
              tail=stderr_tail(lines=3, sep=" | "))


class RcloneTarget:
    def __init__(self, remote: str, run: str, runner: Optional[Callable[..., Any]] = None, rclone: str = "rclone",
                 base_timeout: float = 60.0, min_rate: float = 1 * MiB, extra_flags: Sequence[str] = ()) -> None:
        base = remote.rstrip("/")
        self.run_root = base + run if base.endswith(":") else base + "/" + run
        self.ckpts = self.run_root + "/checkpoints"
        self.url = self.run_root
        self.rclone = rclone
        self.runner = runner or call  # the subprocess seam (onbox.toolrun)
        self.base_timeout = base_timeout
        self.min_rate = min_rate  # bytes/s below which a transfer counts as hung
        self.flags = list(RCLONE_FLAGS) + list(extra_flags)

    # -- one place for every rclone call --------------------------------------------------------------------
    def _rc(self, args: List[str], nbytes: int = 0, check: bool = True, binary: bool = False) -> Any:
        return RCLONE.run([self.rclone, *args, *self.flags], self.base_timeout + nbytes / self.min_rate,
                          check=check, binary=binary, runner=self.runner, op=args[0], url=self.url)

    def _lsjson(self, path: str, *opts: str) -> Optional[List[Dict[str, Any]]]:
        proc = self._rc(["lsjson", path, *opts], check=False)
        if proc.returncode == NOT_FOUND_RC:
            return None
        if proc.returncode != 0:
            self._rc(["lsjson", path, *opts])  # raise with its message
        return json.loads(proc.stdout or "[]")

    def _cat(self, path: str, limit: int) -> Optional[bytes]:
        """The bytes of a remote file, at most limit + 1 of them (--count: a bucket holding a 20 GB
        "MANIFEST.json" must not fill this box's memory); None when it cannot be read (absent)."""
        proc = self._rc(["cat", "--count", str(limit + 1), path], check=False, binary=True)
        return proc.stdout if proc.returncode == 0 else None

    def _cat_json(self, path: str, limit: int = untrusted.INDEX_MAX_BYTES) -> Optional[Dict[str, Any]]:
        raw = self._cat(path, limit)
        if raw is None or len(raw) > limit:
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
            self._rc(["copyto", local, path])

    def _put_marker(self, name: str, check: bool = True) -> None:
        """durable.PARTIAL_MARKER into <name>/: this dir is onbox's and not (or no longer) committed."""
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            marker = os.path.join(tmp, PARTIAL_MARKER)
            with open(marker, "wb"):
                pass
            self._rc(["copyto", marker, "%s/%s/%s" % (self.ckpts, name, PARTIAL_MARKER)], check=check)

    # -- DurableTarget ---------------------------------------------------------------------------------------
    def free_space(self) -> Optional[fsutil.FreeSpace]:
        return None  # `rclone about` is unsupported by many backends; the remote reports ENOSPC loudly instead

    def list_names(self) -> List[str]:
        entries = self._lsjson(self.ckpts, "--dirs-only")
        return sorted(e["Name"] for e in entries or [] if not e["Name"].startswith("."))

    def read_manifest(self, name: str) -> Optional[Dict[str, Any]]:
        """The checked manifest, None when there is none, BadManifest when one is there and refused."""
        if untrusted.name_problem(name):
            return None  # not one entry of the listing: never a path to follow
        raw = self._cat("%s/%s/%s" % (self.ckpts, name, MANIFEST), untrusted.MANIFEST_MAX_BYTES)
        return None if raw is None else manifest.parse(raw, name)

    def put_payload(self, name: str, root: str, files: List[str], hash_name: str) -> FileHashes:
        out: FileHashes = {rel: hashcopy.hash_file(os.path.join(root, rel), hash_name) for rel in files}
        dest = "%s/%s" % (self.ckpts, name)
        total = sum(size for size, _ in out.values())
        there = self._lsjson(dest, "-R", "--files-only")
        if there and not any(e.get("Path") == PARTIAL_MARKER for e in there):
            raise foreign_entry(self.run_root, name)  # somebody else's files: never overwrite them
        self._put_marker(name)  # before any payload byte
        with tempfile.TemporaryDirectory(prefix="onbox-rclone-") as tmp:
            listing = os.path.join(tmp, "files")
            with open(listing, "w", encoding="utf-8") as f:
                f.write("".join(rel + "\n" for rel in files))
            hashcopy.fault_point("before-upload")
            self._rc(["copy", root, dest, "--files-from-raw", listing, "--no-traverse"], nbytes=total)
        problems = self.verify(name, {"files": [{"path": r, "size": s} for r, (s, _) in out.items()]})
        if problems:  # U33: trust what landed, not the exit code alone
            raise SyncFailed("upload to %s incomplete: %s" % (dest, "; ".join(problems)), errno_name="EIO")
        return out

    def put_manifest(self, name: str, manifest: Dict[str, Any]) -> None:
        self._put_json("%s/%s/%s" % (self.ckpts, name, MANIFEST), manifest)
        self._rc(["deletefile", "%s/%s/%s" % (self.ckpts, name, PARTIAL_MARKER)], check=False)

    def remove(self, name: str) -> None:
        # mark it ours again first: a kill after the manifest is gone leaves a leftover the next start cleans
        self._put_marker(name, check=False)
        self._rc(["deletefile", "%s/%s/%s" % (self.ckpts, name, MANIFEST)], check=False)
        self._rc(["purge", "%s/%s" % (self.ckpts, name)], check=False)

    def quarantine(self, name: str, stamp: str) -> str:
        dest = "%s/%s/%s.%s" % (self.run_root, QUARANTINE_DIR, name, stamp)
        # server-side where the backend can, else copy then delete: the manifest goes with the payload, so a
        # kill midway leaves the checkpoint either still committed or a manifest-carrying copy in quarantine/
        self._rc(["moveto", "%s/%s" % (self.ckpts, name), dest], nbytes=self._size_of(name))
        return dest

    def _size_of(self, name: str) -> int:
        listed = self._lsjson("%s/%s" % (self.ckpts, name), "-R", "--files-only") or []
        return sum(e.get("Size", 0) for e in listed)

    def read_index(self) -> Optional[Dict[str, Any]]:
        return self._cat_json("%s/%s" % (self.run_root, INDEX))

    def write_index(self, doc: Dict[str, Any]) -> None:
        self._put_json("%s/%s" % (self.run_root, INDEX), doc)

    def clean_leftovers(self) -> List[str]:
        dirs = self.list_names()
        if not dirs:
            return []
        found = self._lsjson(self.ckpts, "-R", "--files-only", "--include", "/*/" + MANIFEST,
                             "--include", "/*/" + PARTIAL_MARKER) or []
        with_manifest = {e["Path"].split("/", 1)[0] for e in found if e["Path"].endswith("/" + MANIFEST)}
        ours = {e["Path"].split("/", 1)[0] for e in found if e["Path"].endswith("/" + PARTIAL_MARKER)}
        removed = [d for d in dirs if d not in with_manifest and d in ours]  # a dir without the marker is not ours
        for d in removed:
            self._rc(["purge", "%s/%s" % (self.ckpts, d)], check=False)
        return removed

    def fetch(self, name: str, files: List[str], dest: str, hash_name: str) -> FileHashes:
        listed = self._lsjson("%s/%s" % (self.ckpts, name), "-R", "--files-only") or []
        total = sum(e.get("Size", 0) for e in listed)
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

    def put_log(self, local_path: str, name: str) -> None:
        self._rc(["copyto", local_path, "%s/logs/%s" % (self.run_root, name)], nbytes=os.path.getsize(local_path))

    def list_leases(self) -> List[str]:
        entries = self._lsjson("%s/%s" % (self.run_root, LEASES_DIR), "--files-only")
        return sorted(str(e.get("Name")) for e in entries or [] if isinstance(e, dict))

    def read_lease(self, name: str) -> bytes:
        path = "%s/%s/%s" % (self.run_root, LEASES_DIR, name)
        proc = self._rc(["cat", "--count", str(LEASE_MAX_BYTES + 1), path], check=False, binary=True)
        if proc.returncode != 0:
            if not self._lsjson("%s/%s" % (self.run_root, LEASES_DIR), "--files-only", "--include", "/" + name):
                raise FileNotFoundError(path)
            self._rc(["cat", "--count", str(LEASE_MAX_BYTES + 1), path], binary=True)  # raise with its message
        if len(proc.stdout) > LEASE_MAX_BYTES:
            reason = "is too large (more than %s)" % untrusted.human(LEASE_MAX_BYTES)
            raise untrusted.UntrustedInput("lease file %s %s" % (path, reason), reason)
        return bytes(proc.stdout)

    def put_lease(self, name: str, doc: Dict[str, Any]) -> None:
        self._put_json("%s/%s/%s" % (self.run_root, LEASES_DIR, name), doc)

    def verify(self, name: str, manifest: Dict[str, Any]) -> List[str]:
        """Sizes on the remote against the manifest (a full hash check happens on restore, locally)."""
        listed = self._lsjson("%s/%s" % (self.ckpts, name), "-R", "--files-only") or []
        sizes = {e["Path"]: e["Size"] for e in listed}
        problems = []
        for f in manifest.get("files", []):
            if f["path"] not in sizes:
                problems.append("%s: missing on the remote" % f["path"])
            elif sizes[f["path"]] != f["size"]:
                problems.append("%s: %d bytes on the remote, expected %d" % (f["path"], sizes[f["path"]], f["size"]))
        return problems
