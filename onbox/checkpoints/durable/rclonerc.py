"""The rclone target's calls made over a running `rclone rcd` (rcd.py) instead of a process each: the same call as
its command line says it (`lsjson PATH -R --files-only`, `copy SRC DST --files-from-raw F`, ...), turned into rc
methods with the same meaning, and the answer turned back into what the command would have given (exit code,
stdout, stderr), so that rclone.py reads both alike. A call this module does not know (an op or a flag not in the
tables below) returns None: the caller runs it as a process.

  lsjson PATH           operations/list {fs: PATH, opt: recurse, filesOnly, noModTime, noMimeType}
  cat --count N PATH    GET /[DIR]/NAME (--rc-serve), at most N bytes read
  copyto SRC DST        operations/copyfile {srcFs, srcRemote, dstFs, dstRemote} (a file: what onbox copies)
  copy / sync SRC DST   sync/copy, sync/sync {srcFs, dstFs}
  moveto SRC DST        sync/move {srcFs, dstFs} (a directory: what onbox moves)
  delete PATH           operations/delete {fs}, then with --rmdirs operations/rmdirs {fs, leaveRoot}
  purge PATH            operations/purge {fs, remote: ""}
  backend features P    operations/fsinfo {fs} (its Features, as `backend features` prints them)
  backend CMD P -o K=V  backend/command {command, fs, opt}
Flags become the call's `_filter` (--include, --exclude, --files-from-raw) and `_config` (--fast-list,
--no-traverse, --no-check-dest, --ignore-times: rclone's own option names). Exit codes as rclone's: 3 directory
not found, 4 file not found, 1 any other error.
"""
from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, List, Optional, Tuple

from onbox.checkpoints.durable.rcd import Rcd

FILTERS = {"--include": "IncludeRule", "--exclude": "ExcludeRule", "--files-from-raw": "FilesFromRaw"}
CONFIG = {"--fast-list": "UseListR", "--no-traverse": "NoTraverse", "--no-check-dest": "NoCheckDest",
          "--ignore-times": "IgnoreTimes"}
LIST_OPTS = {"-R": "recurse", "--files-only": "filesOnly", "--no-modtime": "noModTime",
             "--no-mimetype": "noMimeType"}
SWITCHES = {"--rmdirs"}
VALUED = {"--count", "-o"}
SYNCS = {"copy": "sync/copy", "sync": "sync/sync", "moveto": "sync/move"}


class Call:
    """One command line, read: its op, its operands and what its flags ask."""

    def __init__(self, args: List[str]) -> None:
        self.op = args[0]
        self.operands: List[str] = []
        self.filters: Dict[str, List[str]] = {}
        self.config: Dict[str, bool] = {}
        self.opt: Dict[str, bool] = {}
        self.switches: set = set()
        self.values: Dict[str, List[str]] = {}
        rest = iter(args[1:])
        for a in rest:
            if a in FILTERS:
                self.filters.setdefault(FILTERS[a], []).append(next(rest))
            elif a in CONFIG:
                self.config[CONFIG[a]] = True
            elif a in LIST_OPTS:
                self.opt[LIST_OPTS[a]] = True
            elif a in SWITCHES:
                self.switches.add(a)
            elif a in VALUED:
                self.values.setdefault(a, []).append(next(rest))
            elif a.startswith("-"):
                raise ValueError("a flag the rc path does not know: %s" % a)
            else:
                self.operands.append(a)

    def extras(self) -> Dict[str, Any]:
        """The call's `_filter` and `_config`, as rc takes them."""
        out: Dict[str, Any] = {}
        if self.filters:
            out["_filter"] = dict(self.filters)
        if self.config:
            out["_config"] = dict(self.config)
        return out


def split(path: str) -> Tuple[str, str]:
    """`remote:dir/name` -> (`remote:dir`, `name`); a file at a remote's root -> (`remote:`, `name`)."""
    head, sep, name = path.rpartition("/")
    if sep:
        return head, name
    prefix, colon, name = path.rpartition(":")
    return prefix + colon, name


def _failed(args: List[str], status: int, doc: Dict[str, Any], binary: bool) -> "subprocess.CompletedProcess[Any]":
    err = str(doc.get("error") or "HTTP status %d" % status)
    return failed_call(args, err, binary, rc=(3 if "directory not found" in err else 4) if status == 404 else 1)


def failed_call(args: List[str], error: str, binary: bool, rc: int = 1) -> "subprocess.CompletedProcess[Any]":
    """What a call that failed with `error` gives, as a process would: exit `rc`, the error on stderr."""
    text = "ERROR : %s" % error
    return subprocess.CompletedProcess(args, rc, b"" if binary else "", text.encode() if binary else text)


def _done(args: List[str], out: Any, binary: bool) -> "subprocess.CompletedProcess[Any]":
    if binary and isinstance(out, str):
        out = out.encode()
    return subprocess.CompletedProcess(args, 0, out, b"" if binary else "")


def run(rcd: Rcd, args: List[str], timeout: float, binary: bool) -> Optional["subprocess.CompletedProcess[Any]"]:
    """The command line `args` (without the binary and the common flags) made over `rcd`; None when it is not one
    this module makes. Raises rcd.RcdGone and subprocess.TimeoutExpired (rcd.Rcd.call)."""
    try:
        c = Call(args)
    except (ValueError, StopIteration):
        return None
    steps = _steps(c)
    if steps is None:
        return None
    if c.op == "cat":
        [path] = c.operands
        fs, name = split(path)
        status, data = rcd.read(fs, name, int(c.values["--count"][0]), timeout)
        if status != 200:
            try:
                doc = json.loads(data or b"{}")
            except ValueError:
                doc = {}
            return _failed(args, status, doc if isinstance(doc, dict) else {}, binary)
        return _done(args, data if binary else data.decode("utf-8", "replace"), binary)
    reply: Dict[str, Any] = {}
    for method, params in steps:
        status, reply = rcd.call(method, params, timeout)
        if status != 200:
            return _failed(args, status, reply, binary)
    if c.op == "lsjson":
        return _done(args, json.dumps(reply.get("list") or []), binary)
    if c.op == "backend" and c.operands[0] == "features":
        return _done(args, json.dumps(reply), binary)
    return _done(args, "", binary)


def _steps(c: Call) -> Optional[List[Tuple[str, Dict[str, Any]]]]:
    """The rc calls (method, params) that make `c`, in order; None for a call this module does not make."""
    ops = c.operands
    if c.op == "lsjson" and len(ops) == 1 and not c.switches and not c.values:
        return [("operations/list", dict(fs=ops[0], remote="", opt=dict(c.opt), **c.extras()))]
    if c.opt or c.switches - ({"--rmdirs"} if c.op == "delete" else set()):
        return None
    if c.op == "cat" and len(ops) == 1 and list(c.values) == ["--count"] and not c.filters and not c.config:
        return []
    if c.values.get("-o") and c.op != "backend":
        return None
    if c.op == "copyto" and len(ops) == 2 and not c.filters:
        (src_fs, src), (dst_fs, dst) = split(ops[0]), split(ops[1])
        return [("operations/copyfile", dict(srcFs=src_fs, srcRemote=src, dstFs=dst_fs, dstRemote=dst,
                                             **c.extras()))]
    if c.op in SYNCS and len(ops) == 2:
        return [(SYNCS[c.op], dict(srcFs=ops[0], dstFs=ops[1], **c.extras()))]
    if c.op == "delete" and len(ops) == 1:
        steps = [("operations/delete", dict(fs=ops[0], **c.extras()))]
        if "--rmdirs" in c.switches:
            steps.append(("operations/rmdirs", dict(fs=ops[0], remote="", leaveRoot=True)))
        return steps
    if c.op == "purge" and len(ops) == 1 and not c.filters:
        return [("operations/purge", dict(fs=ops[0], remote="", **c.extras()))]
    if c.op == "backend" and len(ops) == 2 and ops[0] == "features":
        return [("operations/fsinfo", dict(fs=ops[1]))]
    if c.op == "backend" and len(ops) == 2 and not c.filters and not c.config:
        opt = dict(v.partition("=")[::2] for v in c.values.get("-o", []))
        return [("backend/command", dict(command=ops[0], fs=ops[1], opt=opt))]
    return None
