"""Test-only seams shared by the trainer scripts in this folder.

Nothing here changes what a framework writes or in which order: the tracer only records the framework's own
writes, and a die-at point only SIGKILLs the process at a named place inside the framework's own save, by
wrapping the real method or the real torch file writer (never by re-implementing a save).

Environment (all optional, all test-only):
  ONBOX_TEST_DIE_AT=<point>[@N]   SIGKILL this process the Nth time (default: the first) <point> is reached.
                                  Each script lists its points in --help and refuses an unknown one (exit 2).
  ONBOX_TEST_DIE_ONCE=<file>      die only while <file> does not exist, and create it just before dying: under a
                                  supervisor that restarts the command, only the first attempt dies.
  ONBOX_TEST_DIE_RECORDS=<k>      for the `during-*` points of a torch.save: die after k tensor records (default 1).
  ONBOX_TEST_SAVE_MB=<MiB>        ballast: a persistent buffer of this size in the model, so every save writes
                                  that much more (random-time kills then land inside a save often).
  ONBOX_TEST_TRACE=<file>         append one JSON line per filesystem write made under the trace root (the
                                  script's output dir) and in the temp dir: opens for writing, renames, removals,
                                  mkdirs, symlinks, and the begin/end of every torch.save / safetensors write.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

ENV_DIE = "ONBOX_TEST_DIE_AT"
ENV_DIE_ONCE = "ONBOX_TEST_DIE_ONCE"
ENV_DIE_RECORDS = "ONBOX_TEST_DIE_RECORDS"
ENV_SAVE_MB = "ONBOX_TEST_SAVE_MB"
ENV_TRACE = "ONBOX_TEST_TRACE"

DIE_MARK = "onbox-test: SIGKILL at"


def offline() -> None:
    """No hub, no telemetry, no experiment trackers: the trainers run with nothing outside the machine."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
                "DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS", "WANDB_DISABLED", "TOKENIZERS_PARALLELISM"):
        os.environ.setdefault(key, "false" if key == "TOKENIZERS_PARALLELISM" else "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def die(point: str) -> None:
    """SIGKILL ourselves: no handler, no flush of anything the framework had buffered, like a lost box."""
    once = os.environ.get(ENV_DIE_ONCE)
    if once:
        os.close(os.open(once, os.O_WRONLY | os.O_CREAT, 0o644))
    sys.stdout.write("%s %s\n" % (DIE_MARK, point))
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class DieAt:
    """The ONBOX_TEST_DIE_AT point of this run, counted: `reached(p)` kills at the Nth arrival at the armed point."""

    def __init__(self, points: Sequence[str]) -> None:
        self.points = tuple(points)
        raw = os.environ.get(ENV_DIE, "").strip()
        self.point, self.nth, self.count = "", 1, 0
        if raw:
            point, _, nth = raw.partition("@")
            if point not in self.points:
                sys.stderr.write("%s=%s: unknown point; this trainer knows: %s\n" % (ENV_DIE, raw, ", ".join(self.points)))
                raise SystemExit(2)
            self.point = point
            self.nth = int(nth) if nth else 1
            once = os.environ.get(ENV_DIE_ONCE)
            if once and os.path.exists(once):
                self.point = ""  # an earlier attempt already died here
        self.records = int(os.environ.get(ENV_DIE_RECORDS, "1") or "1")

    def arrive(self, point: str) -> bool:
        """Count an arrival at `point`; True when it is the fatal one (for seams that must die inside a call)."""
        if point != self.point:
            return False
        self.count += 1
        return self.count == self.nth

    def reached(self, point: str) -> None:
        if self.arrive(point):
            die(point)


def ballast_numel() -> int:
    """float32 elements of the ONBOX_TEST_SAVE_MB ballast (0: none)."""
    mb = float(os.environ.get(ENV_SAVE_MB, "0") or "0")
    return int(mb * (1 << 20)) // 4


# ----------------------------------------------------------------------------------------------------------------
# torch.save seams: the real C++ zip writer, wrapped so a kill lands at a chosen point inside a real torch.save.

class _DyingWriter:
    """Delegates to the real torch._C.PyTorchFileWriter; dies after `after_records` tensor records when armed."""

    def __init__(self, real: Any, point: str, after_records: int) -> None:
        self._real, self._point, self._left = real, point, after_records

    def write_record(self, name: str, *args: Any) -> Any:
        out = self._real.write_record(name, *args)
        if name.startswith("data/"):
            self._left -= 1
            if self._left <= 0:
                die(self._point)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def dying_torch_save(point: str, after_records: Optional[int], only: Callable[[str], bool] = lambda p: True
                     ) -> Iterator[None]:
    """Within the block, the next torch.save to a file path accepted by `only` dies inside the real writer:
    after_records=None dies right after the writer opened (and truncated) the file, before a byte is written;
    after_records=k dies after k tensor records were handed to the writer (a torn zip: no central directory)."""
    import torch

    real_cls = torch._C.PyTorchFileWriter

    def make(target: Any, *args: Any) -> Any:
        real = real_cls(target, *args)
        if not isinstance(target, str) or not only(target):
            return real
        if after_records is None:
            die(point)
        return _DyingWriter(real, point, after_records or 1)

    torch._C.PyTorchFileWriter = make  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch._C.PyTorchFileWriter = real_cls  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------------------------
# The save tracer.

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_AUDITED = {"os.rename": "rename", "os.replace": "replace", "os.remove": "remove", "os.rmdir": "rmdir",
            "os.mkdir": "mkdir", "shutil.rmtree": "rmtree", "os.symlink": "symlink", "os.truncate": "truncate",
            "shutil.copyfile": "copyfile"}


class Trace:
    """One JSON object a line: {"seq", "op", "path"[, "dst"]}; paths relative to the root, temp-dir paths as
    "$TMP/<name>". Lines go straight to an fd opened before the audit hook exists (no recursion)."""

    def __init__(self, out_file: str, root: str) -> None:
        self.root = os.path.realpath(root)
        self.tmp = os.path.realpath(tempfile.gettempdir())
        self.fd = os.open(out_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.seq = 0
        self.lock = threading.Lock()

    def rel(self, path: Any) -> Optional[str]:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)):
            return None
        full = os.path.realpath(os.path.join(os.getcwd(), os.fspath(path)))
        if full == self.root or full.startswith(self.root + os.sep):
            return os.path.relpath(full, self.root)
        if os.path.dirname(full) == self.tmp:
            return "$TMP/" + os.path.basename(full)
        return None

    def emit(self, op: str, path: Any, dst: Any = None) -> None:
        rel = self.rel(path) if path != "<buffer>" else path
        rel_dst = self.rel(dst) if dst is not None else None
        if rel is None and rel_dst is None:
            return
        with self.lock:
            self.seq += 1
            rec = {"seq": self.seq, "op": op, "path": rel}
            if dst is not None:
                rec["dst"] = rel_dst
            os.write(self.fd, (json.dumps(rec) + "\n").encode())

    def audit(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS:
                self.emit("open-w", path)
        elif event in _AUDITED:
            if event in ("os.remove", "os.rmdir", "os.mkdir") and args[-1] not in (None, -1):
                return  # relative to a dir fd: the inside of a shutil.rmtree, which is recorded itself
            if event in ("os.rename", "os.replace", "os.symlink", "shutil.copyfile"):
                self.emit(_AUDITED[event], args[0], args[1])
            else:
                self.emit(_AUDITED[event], args[0])


def _wrap_save(trace: Trace, module: Any, name: str, op: str, path_arg: int) -> None:
    real = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        target = args[path_arg] if len(args) > path_arg else kwargs.get("f", kwargs.get("filename"))
        path = target if isinstance(target, (str, bytes, os.PathLike)) else "<buffer>"
        trace.emit(op + "-begin", path)
        out = real(*args, **kwargs)
        trace.emit(op + "-end", path)
        return out

    setattr(module, name, wrapper)


def install_trace(root: str) -> Optional[Trace]:
    """Start recording when ONBOX_TEST_TRACE names a file. Call after torch (and safetensors, where used) can be
    imported: torch.save and safetensors' file writer are wrapped to record begin/end (their bytes are written
    by native code that Python's audit hooks do not see)."""
    out_file = os.environ.get(ENV_TRACE)
    if not out_file:
        return None
    trace = Trace(out_file, root)
    import torch

    _wrap_save(trace, torch, "save", "torch.save", 1)
    try:
        import safetensors.torch as st
    except ImportError:
        pass
    else:
        # safetensors.torch.save_file looks serialize_file up in its module at call time.
        _wrap_save(trace, st, "serialize_file", "safetensors", 1)
    sys.addaudithook(trace.audit)
    return trace


def read_trace(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_sequence(events: list) -> list:
    """A trace reduced to the order in which final files got their content, comparable between a real save and a
    replayed one: ("write", path) for bytes written under the final name, ("atomic", path) for a temp file
    written and then renamed onto path, ("rmtree", dir) for a directory being deleted. mkdirs and torch.save into
    memory are dropped. safetensors' own writer is native code: it writes a hidden
    .tmpXXXXXX beside the target and renames it (seen with strace), so its begin counts as "atomic"."""
    renamed = {e["path"]: e["dst"] for e in events if e["op"] in ("rename", "replace") and e.get("dst")}
    out: list = []
    prev = None
    for e in events:
        op, path = e["op"], e["path"]
        if path in (None, "<buffer>"):
            continue
        if op in ("open-w", "torch.save-begin"):
            if prev == ("open-w", path):
                continue  # the same file opened again by the same write (mkstemp's fd, then open(name, "wb"))
            item = ("atomic", renamed[path]) if path in renamed else ("write", path)
        elif op == "safetensors-begin":
            item = ("atomic", path)
        elif op in ("rmtree", "remove", "rmdir"):
            item = ("rmtree", path if op != "remove" else path.split(os.sep)[0])
            if out and out[-1] == item:
                continue  # the files of one directory being deleted
        else:
            continue
        prev = (op, path)
        out.append(item)
    return out
