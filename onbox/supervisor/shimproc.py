"""The keeper's own life, in the process the agent forked (supervisor/shim.py says why a fork and what it keeps
the same for the child): its signals, its session and descriptors, the child started by ProcessSeam.spawn, the
wait, the report on the pipe and the exit record. Only os calls and modules the agent had imported before the fork:
an import or a lock taken here could wait forever on a lock another thread of the agent held when it forked.
"""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Callable, Dict, List, Optional

from onbox import fsutil, vocab
from onbox.proc import ExitStatus, ProcessSeam

SCHEMA = vocab.SCHEMA_CHILD_EXIT  # the exit record's
RECORD_TRIES = 20  # writes of the record a keeper tries, a second apart (a full disk may be freed meanwhile)
# the signals whose default action ends a process, and that no one sends a process for its own faults (SEGV, ...)
STAY = frozenset(s for s in (getattr(signal, n, None) for n in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGXCPU",
    "SIGPWR", "SIGIO", "SIGSTKFLT")) if s is not None) | frozenset(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))


def keep(seam: ProcessSeam, argv: List[str], env: Dict[str, str], cwd: Optional[str], log_path: str, record: str,
          w: int, mask: Any, namer: Optional[Callable[[], None]], boot: Optional[str]) -> int:
    """The keeper's whole life: the child started, waited for, its exit said on `w` and written to `record`; the
    keeper's exit code (0 once the record is written). `mask`: the agent's signal mask, the child's again."""
    import gc

    gc.disable()  # no collection runs the agent's finalizers here (a buffered file flushed twice)
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
            if handler is signal.SIG_IGN or sig in (signal.SIGKILL, signal.SIGSTOP):
                continue  # an ignored signal stays ignored: the child inherits it as it did from the agent
            if sig in STAY:
                signal.signal(sig, _nothing)
            elif callable(handler) or sig == signal.SIGCHLD:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.setsid()
    _only(w)
    if namer is not None:
        namer()
    try:
        child = ProcessSeam.spawn(seam, argv, env, cwd, log_path)
    except OSError as e:
        _say(w, {"error": "os", "errno": e.errno, "strerror": e.strerror or str(e), "filename": e.filename})
        return 1
    except ValueError as e:  # Popen refuses an argument or variable it cannot pass (a NUL byte)
        _say(w, {"error": "value", "message": str(e)})
        return 1
    _say(w, {"started": child.pid, "start_time": child.start_time})
    while True:
        try:
            _, status = os.waitpid(child.pid, 0)
            break
        except InterruptedError:
            continue
    ended = ExitStatus.from_wait(status)
    _say(w, {"exit": {"code": ended.code, "signal": ended.signal}})  # the agent first: it acts on it at once
    os.close(w)
    doc = {"schema": SCHEMA, "pid": child.pid, "start_time": child.start_time, "boot_id": boot,
           "code": ended.code, "signal": ended.signal, "ended_at": time.time()}
    for _ in range(RECORD_TRIES):
        if _write_record(record, doc):
            return 0
        time.sleep(1.0)
    return 1


def _nothing(signum: int, frame: Any) -> None:
    """The keeper's handler: it stays for its child (only SIGKILL ends it first)."""


def _only(keep: int) -> None:
    """stdin, stdout and stderr on /dev/null, every other inherited descriptor closed but `keep`."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _say(w: int, msg: Dict[str, Any]) -> None:
    try:  # one write under PIPE_BUF: whole; a gone agent (EPIPE) is no error of the keeper's
        os.write(w, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass


def _write_record(path: str, doc: Dict[str, Any]) -> bool:
    """The record, atomically (a temporary name, fsync, rename, fsync of the dir): os calls only, no lock the
    agent's threads may have held (tempfile's, logging's) is taken here."""
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, ".%s.%d.tmp" % (base, os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, fsutil.PRIVATE_FILE)
        try:
            os.write(fd, (json.dumps(doc, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsutil.fsync_dir(directory)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False

