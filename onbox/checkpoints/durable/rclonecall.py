"""How the rclone target runs rclone: the flags every call carries, the errors a failed call becomes (with the
hint for the environment traps met in the field), and the listing a call's JSON output is read into.

A process start is most of what a small call costs (~50 ms for rclone 1.75 on a 2-core box, against an S3 API on
loopback): the calls go to one long-lived `rclone rcd` where it runs (rcd.py; a few ms each), and the target makes
few of them either way: one flat listing serves every read of a commit, uploads that must land in order share one
`rclone sync` where its order is rclone's own rule (transfers first, deletions after, and only when every transfer
succeeded).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from onbox.checkpoints import SyncFailed
from onbox.toolrun import Says, Tool, stderr_tail

# Every call: few retries (a commit is retried as a whole at the next sync interval, the previous one intact), and
# bounded waits. Parallelism (--transfers, --checkers, the S3 upload concurrency and chunk size) is left to rclone's
# defaults and to what the user set (RCLONE_* variables, the remote's config): a flag here would override theirs.
RCLONE_FLAGS = ["--retries", "1", "--low-level-retries", "3", "--contimeout", "10s", "--timeout", "30s"]
# A listing of a whole subtree: recursive, files only (object stores have no directories), and in one flat request
# stream where the backend can (S3's ListObjectsV2 without a delimiter: ~1000 keys per request, not one per dir).
# Sizes are all onbox reads of a listing: no modification times (on S3 each is a HEAD request per object, the mtime
# being metadata of rclone's) and no MIME types.
LIST_FLAGS = ["-R", "--files-only", "--fast-list", "--no-modtime", "--no-mimetype"]
LEASE_LIST_FLAGS = ["--files-only", "--no-modtime", "--no-mimetype"]  # the files of one directory
# An upload into a directory that holds nothing yet: no listing of it, no lookup of each file first. Never where a
# file may be there already: on a backend that allows two files of one name (Google Drive), that would be a second.
FRESH_UPLOAD_FLAGS = ["--no-traverse", "--no-check-dest"]
NOT_FOUND_RC = 3  # rclone: "directory not found"
INTACT = "the previous committed checkpoint is intact"
RCLONE = Tool("rclone", SyncFailed,
              missing=Says("rclone is not installed on this box", "apt-get install rclone, or use a mounted path"),
              timed_out=Says("rclone {op} timed out after {timeout:.0f} s ({url})",
                             "check the network to the remote; " + INTACT, errno_name="ETIMEDOUT"),
              failed=Says("rclone {op} failed (exit {rc}) for {url}: {stderr}",
                          "check the remote (credentials, quota, network); " + INTACT, errno_name="EIO"),
              tail=stderr_tail(lines=3, sep=" | "))

# What rclone's stderr says when the box's environment, not the remote, makes every call fail: (marker, what it
# means, what to do). Said in the message itself, so that the sync_failed event and `onbox sync` carry it.
TRAPS = [
    # rclone releases whose S3 client is built on the AWS SDK for Go v1 (Debian 12's 1.60, for one: the error is
    # that SDK's) refuse every S3 call while AWS_CA_BUNDLE is set, whatever it names: no commit ever moves a byte
    ("LoadCustomCABundleError",
     "this rclone's S3 client cannot run while AWS_CA_BUNDLE is set in the environment (an old rclone's bug)",
     "install a current rclone (https://rclone.org/install/; 1.75 works), or start onbox without AWS_CA_BUNDLE "
     "(`env -u AWS_CA_BUNDLE onbox ...`) when the remote needs no custom CA; " + INTACT),
    # onbox passes flags that rclone grew over its 1.4x and 1.5x releases (--files-from-raw, --no-check-dest,
    # backend commands): an older distribution's rclone stops at the first one it does not know
    ("unknown flag:", "this rclone is too old for the flags onbox passes",
     "install a current rclone (https://rclone.org/install/; 1.60 and 1.75 are tested); " + INTACT),
]


def failed(proc: Any, op: str, url: str) -> SyncFailed:
    """The error of an rclone call that exited non-zero; a known environment trap is named, with what to do."""
    err = RCLONE.failure(proc, op=op, url=url)
    text = proc.stderr.decode("utf-8", "replace") if isinstance(proc.stderr, bytes) else (proc.stderr or "")
    for marker, meaning, hint in TRAPS:
        if marker in text:
            return SyncFailed("%s: %s" % (err.message, meaning), hint=hint, errno_name="EIO")
    assert isinstance(err, SyncFailed)
    return err


def sizes(stdout: Any) -> Dict[str, int]:
    """`rclone lsjson` output as {path: bytes} (the paths relative to the listed dir)."""
    entries = json.loads(stdout or "[]")
    return {str(e["Path"]): int(e.get("Size", 0)) for e in entries if isinstance(e, dict) and "Path" in e}


def names_in(files: Dict[str, int]) -> List[str]:
    """The top-level directories a listing's file paths lie in (hidden ones left out)."""
    return sorted({p.split("/", 1)[0] for p in files if "/" in p and not p.startswith(".")})


def under(files: Optional[Dict[str, int]], name: str) -> Optional[Dict[str, int]]:
    """The part of a listing under directory `name`, relative to it; None when there is no listing."""
    if files is None:
        return None
    prefix = name + "/"
    return {p[len(prefix):]: n for p, n in files.items() if p.startswith(prefix)}
