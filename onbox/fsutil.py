"""Crash-consistent file writes and free-space readings: the ONE place for these.

The recipe: write a temp file in the same directory, flush, fsync the file, os.replace onto the final
name, fsync the directory (an fsync of the file does not persist its directory entry).

Files are private by default (0600; run directories 0700): a run's files carry its command line, its output and
its configuration, which are nobody else's business on a shared box. Pass mode=0o644 for a file meant for others.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
from typing import Any, Callable, NamedTuple, Optional, Union

from onbox import untrusted

PathLike = Union[str, "os.PathLike[str]"]

TMP_PREFIX = ".onbox-tmp-"
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700

# The errors of a disk that refuses writes, whoever is writing: full (bytes or inodes: U6, U7), over quota, failing,
# remounted read-only. A writer that must outlive them (the agent) catches exactly these; anything else is a bug.
DISK_FAULTS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT", errno.EIO: "EIO", errno.EROFS: "EROFS"}


def fsync_dir(path: PathLike) -> None:
    """fsync a directory so that renames and creations inside it survive a power cut."""
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (e.g. certain FUSE/NFS mounts) refuse fsync on a directory
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(path: PathLike, data: Union[bytes, str], mode: int = PRIVATE_FILE) -> None:
    """Replace `path` with `data` so that a reader sees the old or the new content, never a mix."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    payload = data.encode("utf-8") if isinstance(data, str) else data
    import tempfile  # here: tempfile pulls in shutil, random, bz2, lzma, and readers (`onbox status`) never write

    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def atomic_write_json(path: PathLike, obj: Any, mode: int = PRIVATE_FILE) -> None:
    """atomic_write of a JSON document, sorted and indented so diffs and golden files stay stable."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode=mode)


def read_json(path: PathLike, limit: int = untrusted.MANIFEST_MAX_BYTES, what: str = "file") -> Any:
    """A JSON state file (state.json, config.json, a status file ...), read through onbox.untrusted: a regular file
    only, at most `limit` bytes (default: the largest document onbox writes, a manifest), nested at most
    untrusted.MAX_DEPTH deep. A refusal is an UntrustedInput, a ValueError like a malformed document, so every
    caller that treats "not JSON" as "no such document" treats /dev/zero or a 100,000-deep file the same way."""
    return untrusted.read_json(path, limit, what)


def append_jsonl(path: PathLike, obj: Any) -> None:
    """Append one JSON line with a single write(2) on an O_APPEND fd (whole lines, even with several writers)."""
    line = (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def make_private_dir(path: PathLike) -> None:
    """Create `path` (and its parents) and make it 0700, also when it existed with wider permissions."""
    os.makedirs(os.fspath(path), mode=PRIVATE_DIR, exist_ok=True)
    if os.stat(os.fspath(path)).st_mode & 0o777 != PRIVATE_DIR:
        os.chmod(os.fspath(path), PRIVATE_DIR)


def open_private_append(path: PathLike) -> int:
    """An O_APPEND fd on `path`, created 0600 (logs the agent or the child write)."""
    return os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)


def readable_by_others(path: PathLike) -> Optional[int]:
    """The permission bits of `path` when its group or others may read it (a secret should be 0600), else None."""
    try:
        mode = os.stat(os.fspath(path)).st_mode & 0o777
    except OSError:
        return None
    return mode if mode & 0o044 else None


class FreeSpace(NamedTuple):
    """statvfs of the filesystem holding a path, as an unprivileged writer sees it."""

    path: str
    free_bytes: int  # bytes available to non-root (f_bavail * f_frsize)
    total_bytes: int
    free_inodes: int  # f_favail; 0 on filesystems without inode limits reports as -1 (see has_inode_limit)
    total_inodes: int

    @property
    def has_inode_limit(self) -> bool:
        return self.total_inodes > 0


def nearest_existing(path: PathLike, exists: Callable[[str], bool] = os.path.exists) -> str:
    """`path` made absolute, or its nearest ancestor that exists (a dir that is still to be created)."""
    probe = os.path.abspath(os.fspath(path))
    while not exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return probe


def free_space(path: PathLike) -> FreeSpace:
    """Free bytes AND free inodes (U7: disks die on inodes before bytes). Walks up to the nearest existing dir."""
    probe = nearest_existing(path)
    st = os.statvfs(probe)
    return FreeSpace(
        path=probe,
        free_bytes=st.f_bavail * st.f_frsize,
        total_bytes=st.f_blocks * st.f_frsize,
        free_inodes=st.f_favail if st.f_files > 0 else -1,
        total_inodes=st.f_files,
    )


def disk_fault(error: BaseException) -> Optional[str]:
    """The errno name when `error` says the disk refuses writes (DISK_FAULTS), else None."""
    return DISK_FAULTS.get(error.errno) if isinstance(error, OSError) and error.errno else None


def space_problem(path: PathLike, min_bytes: int = 1 << 20, min_inodes: int = 64) -> Optional[str]:
    """Why the filesystem holding `path` cannot take a run's records now ("full (12 KiB free)", "out of inodes",
    "read-only"), or None. statvfs only: writes nothing. Counts what this user may use (root: the reserve too)."""
    try:
        st = os.statvfs(nearest_existing(path))
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return "read-only"
    root = os.geteuid() == 0
    free = (st.f_bfree if root else st.f_bavail) * st.f_frsize
    if free < min_bytes:
        return "full (%d KiB free)" % (free // 1024)
    inodes = st.f_ffree if root else st.f_favail
    if st.f_files > 0 and inodes < min_inodes:
        return "out of inodes (%d free, U7)" % inodes
    return None


def is_writable_dir(path: PathLike) -> bool:
    """True when a file can really be created in `path` (access(2) lies on read-only mounts and for root)."""
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=os.fspath(path))
    except OSError:
        return False
    os.close(fd)
    os.unlink(tmp)
    return True


def dir_problem(path: PathLike) -> Optional[str]:
    """Why `path` cannot serve as a writable directory (None when it can): it, or the nearest ancestor that
    exists when it does not exist yet, must be a directory a file can really be created in. Creates nothing."""
    probe = nearest_existing(path, exists=os.path.lexists)
    if not os.path.isdir(probe):
        return "%s is not a directory" % probe
    if not is_writable_dir(probe):
        return "%s is not writable" % probe
    return None


def json_safe(obj: Any) -> Any:
    """JSON has no NaN or Infinity (a diverged loss): a non-finite float anywhere in `obj` becomes the string "NaN",
    "Infinity" or "-Infinity", the convention of progress.json, the heartbeats and every `--json`. Keys become
    strings, tuples lists: what json.dumps(allow_nan=False) then always takes."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


class TokenFileRefused(OSError):
    """A token file that is not a regular file, is larger than untrusted.TOKEN_MAX_BYTES or is not UTF-8 text.
    An OSError, so every reader that already words "cannot read the token file" words this too; its strerror
    says why ("it is a character device ...")."""


def read_token_file(path: str) -> str:
    """A token file's token: its first line, stripped ("" for an empty file; `~` expanded). The ONE token reader
    (agent sinks, the log-tail redaction, the controller, the tracker). Raises OSError: missing, unreadable, or
    refused (TokenFileRefused): `--tracker-token-file /dev/zero` must be one clear line, never a read that grows
    until the OOM killer ends it, and a FIFO must not hang the command."""
    p = os.path.expanduser(path)
    try:
        text = untrusted.read_text(p, untrusted.TOKEN_MAX_BYTES, "token file")
    except untrusted.UntrustedInput as e:
        raise TokenFileRefused(errno.EINVAL, "it " + e.reason, p)  # the caller's message names the file
    except UnicodeDecodeError as e:
        raise TokenFileRefused(errno.EINVAL, "it is not UTF-8 text (byte %d)" % e.start, p)
    return re.split(r"\r\n|\r|\n", text, maxsplit=1)[0].strip()  # the first line, as text mode reads lines


NAME_MAX = 255  # bytes in one file name on every Linux filesystem onbox writes to


def fit_name(name: str, suffix: str = "", prefix: str = "") -> str:
    """prefix + name + suffix, with `name` shortened (and a hash of it kept, so two long names stay apart) when
    the whole would pass NAME_MAX bytes: a staging or set-aside name built from a legal 248-byte checkpoint name
    must still be a legal name."""
    whole = prefix + name + suffix
    if len(whole.encode("utf-8", "surrogateescape")) <= NAME_MAX:
        return whole
    import hashlib

    tag = "~" + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    room = NAME_MAX - len((prefix + tag + suffix).encode("utf-8", "surrogateescape"))
    short = name.encode("utf-8", "surrogateescape")[:max(room, 0)].decode("utf-8", "ignore")
    return prefix + short + tag + suffix
