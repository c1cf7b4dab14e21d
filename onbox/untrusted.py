"""Reading what onbox does not control: the ONE place for it.

Everything read from durable storage (manifests, the checkpoints index, quarantine and log names), from config
files (run files, profiles, the box inventory, tunnels.json, pulls.json), from token files and from paths a user
or a bucket names is hostile until checked here:

- a file is read only when it is a regular file, and never past a size bound: `-f /dev/zero` must not grow the
  agent until the OOM killer takes the training job with it, and a FIFO must not hang the command forever
  (it is opened O_NONBLOCK, then refused by its fstat);
- JSON and TOML are parsed with a nesting bound: a document nested 100,000 deep is a clear error, never a
  RecursionError traceback or a tracker endpoint that answers 500 to everyone;
- a relative path from such a document is joined to its root only when it is relative, free of `..`, NUL and
  empty parts, and still under the root after symlinks are resolved: a manifest listing `../../x` must never
  make a restore write outside the checkpoint dir.

Every refusal is an UntrustedInput (a ValueError, so readers that already treat a malformed file as "no such
document" keep doing so) whose message names the file and what is wrong with it.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, List, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

# Bounds, generous for every legitimate file and small beside a GPU box's memory.
CONFIG_MAX_BYTES = 4 * 1024 * 1024  # run files, profiles, boxes.toml/json, tunnels.json, config.json
TOKEN_MAX_BYTES = 64 * 1024  # a bearer token, an API key, a password file
MANIFEST_MAX_BYTES = 64 * 1024 * 1024  # a checkpoint of ~300,000 files (DeepSpeed shards) at ~200 bytes each
INDEX_MAX_BYTES = 64 * 1024 * 1024  # checkpoints_index.json: thousands of entries with their checks
MAX_DEPTH = 64  # no document onbox reads nests deeper than ~6; 64 leaves room and stays far from recursion limits
BOM = b"\xef\xbb\xbf"


class UntrustedInput(ValueError):
    """A file or a value from outside onbox was refused; the message says which and why, `reason` only why ("is a
    FIFO (named pipe), not a regular file"), for a caller whose own message names the file already."""

    def __init__(self, message: str, reason: Optional[str] = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def reason(e: BaseException) -> str:
    """Why a read failed, for a message that names the file itself: "it is a FIFO ..." for a refusal, the OS's
    words for an OSError ("Permission denied"), else the error's own text (json's, with its position)."""
    if isinstance(e, UntrustedInput):
        return "it " + e.reason
    return str(getattr(e, "strerror", None) or e)


def describe_mode(mode: int) -> str:
    """What a non-regular file is, in words: "a FIFO (named pipe)", "a character device", ..."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(path: PathLike, limit: int, what: str = "file") -> bytes:
    """The content of the regular file `path`, refused (UntrustedInput) past `limit` bytes or when it is a FIFO,
    a device or a socket. Missing files and permission problems raise the usual OSError; a directory raises
    IsADirectoryError. Symlinks are followed: what counts is what they point at (/dev/zero is refused)."""
    p = os.fspath(path)
    # O_NONBLOCK: opening a FIFO without a writer would block forever; on a regular file it changes nothing
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), p)
        if not stat.S_ISREG(st.st_mode):
            reason = "is %s, not a regular file: refusing to read it" % describe_mode(st.st_mode)
            raise UntrustedInput("%s %s %s" % (what, p, reason), reason)
        if st.st_size > limit:
            reason = "is too large (%s, the limit is %s)" % (human(st.st_size), human(limit))
            raise UntrustedInput("%s %s %s" % (what, p, reason), reason)
        chunks: List[bytes] = []
        got = 0
        while True:  # the size may change under us (a file still being written): the bound holds regardless
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if got > limit:
                reason = "is too large (more than %s)" % human(limit)
                raise UntrustedInput("%s %s %s" % (what, p, reason), reason)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: PathLike, limit: int, what: str = "file") -> str:
    """read_bytes decoded as UTF-8 (a leading byte-order mark, as Windows editors write, is dropped).
    Bytes that are not UTF-8 raise UnicodeDecodeError (a ValueError) for the caller to word."""
    raw = read_bytes(path, limit, what)
    return raw[len(BOM):].decode("utf-8") if raw.startswith(BOM) else raw.decode("utf-8")


def depth(obj: Any, bound: int = MAX_DEPTH) -> int:
    """How deep lists and dicts nest in `obj` (a scalar is 0), counting no further than bound + 1; iterative, so
    a deep document cannot exhaust the stack here."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, d)
        if deepest > bound:
            return deepest
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_depth(obj: Any, what: str, bound: int = MAX_DEPTH) -> Any:
    """`obj` when it nests at most `bound` levels, else UntrustedInput."""
    if depth(obj, bound) > bound:
        raise UntrustedInput("%s nests more than %d levels deep: refusing it" % (what, bound),
                             "nests more than %d levels deep" % bound)
    return obj


def loads_json(text: Union[str, bytes], what: str = "document", bound: int = MAX_DEPTH) -> Any:
    """json.loads with a nesting bound: a malformed document raises ValueError (json's own, with its position),
    one nested too deep UntrustedInput, never a RecursionError."""
    if isinstance(text, bytes):
        text = (text[len(BOM):] if text.startswith(BOM) else text).decode("utf-8")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise UntrustedInput("%s nests more than %d levels deep: refusing it" % (what, bound),
                             "nests more than %d levels deep" % bound)
    return check_depth(doc, what, bound)


def read_json(path: PathLike, limit: int, what: str = "file", bound: int = MAX_DEPTH) -> Any:
    """A JSON file read with read_bytes' checks and parsed with loads_json's bound."""
    return loads_json(read_bytes(path, limit, what), "%s %s" % (what, os.fspath(path)), bound)


def relpath_problem(rel: Any) -> Optional[str]:
    """Why `rel` (a path read from a manifest, an index or a listing) cannot name something under a root, or None.
    Allowed: a relative path of non-empty parts, none of them `.` or `..`, no NUL, each part at most 255 bytes."""
    if not isinstance(rel, str):
        return "not a string (%s)" % type(rel).__name__
    if not rel:
        return "empty path"
    if "\x00" in rel:
        return "contains a NUL byte"
    if len(rel.encode("utf-8", "surrogateescape")) > 4096:
        return "longer than 4096 bytes"
    if rel.startswith("/"):
        return "absolute path"
    for part in rel.split("/"):
        if part == "..":
            return "a '..' part in it (it leads out of its directory)"
        if part in ("", "."):
            return "a '.' part in it" if part else "an empty part (//) in it"
        if len(part.encode("utf-8", "surrogateescape")) > 255:
            return "a part longer than 255 bytes"
    return None


PATH_MAX_BYTES = 4095  # Linux's PATH_MAX is 4096 bytes with the terminating NUL
NAME_MAX_BYTES = 255  # one name in a path (ext4, xfs, btrfs, tmpfs and S3-backed mounts alike)


def path_length_problem(path: str) -> Optional[str]:
    """Why the system would refuse `path` for its length (ENAMETOOLONG), or None: more than 4095 bytes in all, or a
    name in it of more than 255 bytes (as the filesystem encodes it)."""
    raw = os.fsencode(path)
    if len(raw) > PATH_MAX_BYTES:
        return "it is %d bytes long, and a path holds at most %d" % (len(raw), PATH_MAX_BYTES)
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX_BYTES:
        return "a name in it is %d bytes long (%s...), and a file or directory name holds at most %d" % (
            len(longest), longest[:24].decode("utf-8", "replace"), NAME_MAX_BYTES)
    return None


def name_problem(name: Any) -> Optional[str]:
    """Why `name` cannot be one directory entry (a checkpoint name, a local_name): relpath_problem's rules and no
    '/'."""
    problem = relpath_problem(name)
    if problem is None and "/" in name:
        return "contains '/': a single name was expected"
    return problem


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def join_under(root: PathLike, rel: Any, what: str = "path") -> str:
    """root/rel, after relpath_problem's checks and with the result (symlinks resolved) still under root (also
    resolved): UntrustedInput otherwise. What does not exist yet is resolved as far as it exists."""
    problem = relpath_problem(rel)
    if problem:
        raise UntrustedInput("%s %r refused: %s" % (what, rel, problem))
    base = os.path.realpath(os.fspath(root))
    joined = os.path.join(os.fspath(root), rel)
    if not _inside(os.path.realpath(joined), base):
        raise UntrustedInput("%s %r refused: it leads outside %s (through a symlink)" % (what, rel, root))
    return joined


def is_under(path: PathLike, root: PathLike) -> bool:
    """`path` is `root` or lies inside it, both with symlinks resolved."""
    return _inside(os.path.realpath(os.fspath(path)), os.path.realpath(os.fspath(root)))


def human(n: float) -> str:
    """Bytes for a message: 23.8 GB, 4 MiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return "%.1f %s" % (n / size, unit) if n % size else "%d %s" % (n // size, unit)
    return "%d bytes" % n


# Text from outside (a provision command's output, a box's name in a record, a checkpoint name listed from storage)
# printed to a terminal: ESC starts sequences that retitle the window, move the cursor or rewrite earlier lines
# (`ESC ]0;title BEL`), and a newline in a name forges a line of its own. Every C0 and C1 control character but
# tab, and DEL, are shown as escapes instead.
_CONTROL_CHARS = {c: "\\x%02x" % c for c in [*range(0x00, 0x09), *range(0x0a, 0x20), 0x7f, *range(0x80, 0xa0)]}


def printable(text: Any, keep_newlines: bool = False) -> str:
    """`text` safe to print: every control character (ESC, BEL, CR, NUL, C1 codes; newlines unless `keep_newlines`)
    shown as its `\\xNN` escape, so that text from outside can neither drive the terminal nor forge lines."""
    s = text if isinstance(text, str) else str(text)
    if keep_newlines:
        return "\n".join(part.translate(_CONTROL_CHARS) for part in s.split("\n"))
    return s.translate(_CONTROL_CHARS)
