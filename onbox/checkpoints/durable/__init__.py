"""The durable side: where committed checkpoints live, and everything that reads or writes them there. This
module is what every durable target shares: the DurableTarget protocol, the names onbox writes on durable storage,
and the error for a directory that is not onbox's.

  localpath.py  a mounted path as the target (rename is atomic): LocalPathTarget
  rclone.py     an rclone remote (S3, sftp, ...): RcloneTarget; rclonecall.py: the flags and errors of its calls,
                made over one long-lived `rclone rcd` (rcd.py) as rc methods (rclonerc.py) where it can start
  targets.py    which target a --durable value means, and what `onbox run` checks about it first
  hashcopy.py   one read pass that copies and hashes; the manifest hash (SHA-256)
  manifest.py   what a MANIFEST.json or an index entry read from durable storage must hold before it is used
  index.py      checkpoints_index.json: its entries, their verification state, re-checks recorded
  retention.py  which committed checkpoints to keep (last N, best, every K steps, always the newest verified)
  runlock.py    the run's commit lock (every writer of the durable side and the index on this box)
  steptimes.py  where a commit's time goes: seconds per step, in its checkpoint_committed event

May import: the shared leaves and onbox.checkpoints (the base: names, errors). Nothing else of the package.

Layout, under the target's base:
  <run>/checkpoints/<ckpt-name>/...files...    payload
  <run>/checkpoints/<ckpt-name>/MANIFEST.json  written LAST: the commit point
  <run>/checkpoints_index.json                 every committed checkpoint
  <run>/logs/
  <run>/quarantine/<ckpt-name>.<time>/        a checkpoint a resumed attempt crashed on, or a fenced orphan
                                               (kept, never read)
  <run>/leases/<epoch:010d>.<holder>.json      one per agent launch that took the run (onbox.checkpoints.leases)
A checkpoint dir without a MANIFEST.json does not exist for any reader.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from onbox import fsutil
from onbox.checkpoints import SyncFailed

STAGING_PREFIX = ".onbox-tmp-"
# In every checkpoint dir onbox writes, from before its first payload byte until its manifest is written: a
# manifest-less dir WITH it is an interrupted commit of ours (cleaned at the next start); one WITHOUT it is
# somebody else's (the user's own checkpoints under <durable>/<run>/checkpoints/) and is never deleted.
PARTIAL_MARKER = ".onbox-partial"
QUARANTINE_DIR = "quarantine"  # <run>/quarantine/: checkpoints a resumed attempt crashed on, fenced orphans
LEASES_DIR = "leases"  # <run>/leases/: the run's leases, one file per agent launch that took it (never deleted)
LEASE_MAX_BYTES = 4 * 1024 * 1024  # a lease names its base checkpoints: ~16,000 names of 250 bytes


def foreign_entry(url: str, name: str) -> SyncFailed:
    return SyncFailed("%s/checkpoints/%s exists on durable storage without a MANIFEST.json and was not written by "
                      "onbox: not replacing it" % (url, name),
                      hint="move it away (it may be your own checkpoint), or give --durable another directory")


FileHashes = Dict[str, Tuple[int, str]]  # relpath -> (size, hex digest)


class DurableTarget(Protocol):
    url: str

    def free_space(self) -> Optional[fsutil.FreeSpace]:
        """Free bytes and inodes on the durable side, or None when the target cannot tell."""

    def list_names(self) -> List[str]:
        """Every entry under <run>/checkpoints/, committed or not (staging dirs excluded)."""

    def read_manifest(self, name: str) -> Optional[Dict[str, Any]]:
        """The parsed MANIFEST.json of a checkpoint, or None when it has none (= it does not exist)."""

    def put_payload(self, name: str, root: str, files: List[str], hash_name: str) -> FileHashes:
        """Copy files (relative to root) into <name>/, hashing in the same pass where possible."""

    def put_manifest(self, name: str, manifest: Dict[str, Any]) -> None: ...

    def remove(self, name: str) -> None:
        """Delete a checkpoint so that it stops existing at once and a kill midway leaves only what start() cleans."""

    def quarantine(self, name: str, stamp: str) -> str:
        """Move a committed checkpoint out of <run>/checkpoints/ (readers stop seeing it at once) into
        <run>/quarantine/<name>.<stamp>, whole and with its manifest; never deletes. Returns where it went."""

    def read_index(self) -> Optional[Dict[str, Any]]: ...

    def write_index(self, doc: Dict[str, Any]) -> None: ...

    def clean_leftovers(self, before_write: Optional[Callable[[], None]] = None) -> List[str]:
        """Remove what interrupted commits left (staging dirs, manifest-less dirs holding PARTIAL_MARKER, never
        a dir without it: that is not ours); return what was removed. `before_write` (the lease check) runs
        before the first deletion, and not at all when there is nothing to remove."""

    def fetch(self, name: str, files: List[str], dest: str, hash_name: str) -> FileHashes:
        """Copy a committed checkpoint's files into the existing local dir `dest`, hashing them."""

    def verify(self, name: str, manifest: Dict[str, Any]) -> List[str]:
        """Problems of the durable copy against its manifest (empty: fine)."""

    def put_logs(self, local_dir: str, names: List[str], subdir: str) -> None:
        """Copy run logs (`names`, files in local_dir) to <run>/logs/<subdir>/, each replacing its previous copy
        atomically where possible."""

    def list_leases(self) -> List[str]:
        """The file names under <run>/leases/ (every one: the caller keeps those that are lease names)."""

    def read_lease(self, name: str) -> bytes:
        """The bytes of <run>/leases/<name>, refused (untrusted.UntrustedInput) past LEASE_MAX_BYTES or when it is
        no regular file; FileNotFoundError when it is gone."""

    def put_lease(self, name: str, doc: Dict[str, Any]) -> None:
        """Write <run>/leases/<name>: the atomic-write recipe on a mounted path, an upload on a remote."""
