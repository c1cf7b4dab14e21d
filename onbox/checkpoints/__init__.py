"""Checkpoints that outlive the box: detect complete ones, commit them to durable storage (manifest last),
verify, index, retain, restore. The supervisor drives it through onbox.checkpoints.hook.CheckpointCommitHook.

This module is the base every part shares: the names onbox writes (MANIFEST, INDEX, the schemas), a lease
holder's name rule, and the errors of a commit (SyncFailed and its kin).

  durable/      the durable side: the DurableTarget protocol, a mounted path or an rclone remote as the target,
                hashcopy, manifest, index, retention, the commit lock, steptimes (its __init__ names each module)
  formats/      format checks without torch (torch zips and pickles, safetensors, JSON), the step a checkpoint
                records, what a checkpoint directory is (HF Trainer, save_pretrained, DCP, DeepSpeed)
  local/        the box's checkpoint dir: candidates and when each is complete (detect.py), restore into it
  commit.py     the commit protocol (payload, fsyncs, manifest last, index, retention)
  leases/       run leases: the pure rules (file names, the document, who holds a run, lineage) and fencing.py,
                the lease an agent holds (take, the check before every write, renewals, release; PassiveLease)
  verify.py     `onbox verify`; recheck.py: its record in the index, under the commit lock and the lease
  hook/         CheckpointCommitHook, the CheckpointHook the supervisor calls: a thin façade over its parts (the
                status file, the local dir scanner, the lease holder, the commit scheduler, the restorer)
  runfacts.py   what a run's durable storage says of it, read only (newest committed step, its lease): `onbox match`
  listing.py    the onbox.checkpoints/1 document (`onbox checkpoints --json`) that onboxctl's pull and gate read

May import: the shared leaves (errors, fsutil, untrusted, clock, proc, toolrun, paths, environment). Never the
supervisor: hook/ implements the seam in onbox.supervisor.hooks structurally, and onbox.subsystems wires it in.
"""
from __future__ import annotations

import errno
import re
from typing import Any, Dict, Optional

from onbox import vocab
from onbox.errors import JobFailed

MANIFEST = "MANIFEST.json"
INDEX = "checkpoints_index.json"
MANIFEST_SCHEMA = vocab.SCHEMA_MANIFEST
INDEX_SCHEMA = vocab.SCHEMA_INDEX  # a superset of /1 (index.py)
INDEX_SCHEMA_V1 = vocab.SCHEMA_INDEX_V1
# a lease holder's name (leases): what a manifest's `holder` must match, read back from durable storage
HOLDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")

LOUD_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT", errno.EIO: "EIO", errno.EACCES: "EACCES",
               errno.EPERM: "EPERM", errno.EROFS: "EROFS"}


class SyncFailed(JobFailed):
    """A commit to durable storage failed. The previous committed checkpoint is intact (U33: never 'synced')."""

    def __init__(self, message: str, hint: Optional[str] = None, errno_name: Optional[str] = None,
                 details: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(message, hint)
        self.errno_name = errno_name
        self.details = dict(details or {})


class DurableFull(SyncFailed):
    """The preflight found too few free bytes or inodes on the durable side (U7); no copy was started."""


class NotARealDir(SyncFailed):
    """A directory onbox writes under the durable root is a symlink or not a directory: nothing was written (a
    retry cannot mend it; a person must look)."""


def sync_failed_from_oserror(where: str, e: OSError) -> SyncFailed:
    name = LOUD_ERRNOS.get(e.errno or 0) or errno.errorcode.get(e.errno or 0, "E?")
    hints = {
        "ENOSPC": "the durable side is out of space or inodes (U7): check `df -h` and `df -i` there",
        "EDQUOT": "the durable side's quota is exhausted: free space there or raise the quota",
        "EIO": "the durable storage reported an I/O error: check the mount (network volume, NFS) and retry",
        "EACCES": "no permission to write the durable dir: check its owner and mode",
        "EPERM": "no permission to write the durable dir: check its owner and mode",
        "EROFS": "the durable dir is on a read-only mount",
    }
    return SyncFailed("commit to %s failed: %s (%s)" % (where, e.strerror or e, name),
                      hint=hints.get(name, "check the durable storage and retry with `onbox sync`"), errno_name=name)
