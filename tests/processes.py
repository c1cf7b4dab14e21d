"""The processes a test starts, read from /proc on the test's side (not through onbox.proc, the code under test),
and stopped at the end by PID and start time: `pid_alive`, `start_ticks`, `pids_with_home` and `Started`."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, List, Optional, Tuple


def _stat_fields(pid: int) -> Optional[List[str]]:
    """/proc/<pid>/stat after the command name (field 3, the state, first), or None when there is no such pid."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie has already let go of its files)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (stat field 22, what onbox records as a start time), or
    None when it is gone. A pid is handed out again; the pair (pid, start) is not, within one boot."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def pids_with_home(home: Any) -> List[int]:
    """Every process whose environment carries ONBOX_HOME=<home> (this test's unique tmp dir): the agents and
    children a test started, found even when its state file was never written (e.g. a launch still on its way
    through ssh when the test failed)."""
    return [pid for pid, _start in _with_home(home)]


def _with_home(home: Any) -> List[Tuple[int, int]]:
    return with_env("ONBOX_HOME", home)


def with_env(name: str, value: Any, argv_has: Optional[str] = None) -> List[Tuple[int, int]]:
    """(pid, start time) of every process whose environment carries NAME=<value> (and whose command line holds
    `argv_has`, when given)."""
    # The start time is read before and after the environment: equal, they name the process whose environment
    # was read (a pid recycled in between would start later).
    needle = ("%s=%s" % (name, value)).encode()
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        before = start_ticks(pid)
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            if argv_has is not None:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    if argv_has.encode() not in f.read():
                        continue
        except OSError:
            continue
        if before is not None and start_ticks(pid) == before:
            out.append((pid, before))
    return out


def kill_exact(pid: int, start: int, sig: int = signal.SIGKILL) -> bool:
    """Send `sig` to `pid` only while it is still the process that started at `start`; False when it is gone.
    Through a pidfd (Linux 5.3, Python 3.9): once it is open, a start time that still matches proves it is that
    process, and the signal cannot reach one that got the pid since."""
    opener = getattr(os, "pidfd_open", None)
    fd = None
    if opener is not None and hasattr(signal, "pidfd_send_signal"):
        try:
            fd = opener(pid)
        except OSError:  # gone (ESRCH), or a kernel without pidfds
            fd = None
    try:
        if start_ticks(pid) != start or not pid_alive(pid):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)  # type: ignore[attr-defined]
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def signal_own(home: Any, pid: int, sig: int, start: Optional[int] = None) -> None:
    """Send `sig` to `pid`, read from a state file, only as this test's own process: one whose environment
    carries ONBOX_HOME=<home> (the test's unique tmp dir), at the start time it has now, or at `start` when the
    state file recorded one. Never a pid that another process got; fails the test when it is not ours."""
    found = dict(_with_home(home)).get(pid)
    assert found is not None, "pid %d is no process of this test (none with ONBOX_HOME=%s)" % (pid, home)
    assert start is None or found == start, "pid %d started at %s, not at the recorded %s" % (pid, found, start)
    assert kill_exact(pid, found, sig), "pid %d ended before the signal" % pid


class Started:
    """Processes a test started, each remembered by pid AND start time when first seen: `stop` signals exactly
    those (never a pid that another process got since, never a session or group).

    "Start, wait, signal, collect, kill in finally" as a context manager (or call `stop` in a `finally`):
        with Started() as started:
            agent = started.popen([...onbox run --foreground...], ...)
            wait_for(...); agent.send_signal(...); out, err = agent.communicate(timeout=...)
    On the way out, pass or fail, it SIGKILLs each remembered process still running, with `home` also every
    process under that ONBOX_HOME (looking again for `settle` s for late ones), and reaps its own children."""

    def __init__(self, home: Any = None, settle: float = 0.5) -> None:
        self.home = home
        self.settle = settle
        self.refs: List[Tuple[int, int]] = []
        self.children: List[subprocess.Popen] = []

    def popen(self, argv: List[str], **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen(argv, **kwargs), remembered."""
        return self.adopt(subprocess.Popen(argv, **kwargs))

    def adopt(self, child: subprocess.Popen) -> subprocess.Popen:
        """A child started some other way (e.g. inside a network namespace): killed if it runs on, then reaped."""
        self.children.append(child)
        self.add(child.pid)
        return child

    def add(self, pid: Optional[int], start: Optional[int] = None) -> None:
        start = start if start is not None else (start_ticks(pid) if pid else None)
        if pid and start is not None and (pid, start) not in self.refs:
            self.refs.append((pid, start))

    def add_home(self, home: Any) -> None:
        """Every live process whose environment carries ONBOX_HOME=<home> (the agents and children of this test)."""
        for pid, start in _with_home(home):
            self.add(pid, start)

    def kill(self) -> None:
        """SIGKILL each remembered process that still runs."""
        for pid, start in self.refs:
            kill_exact(pid, start)

    def stop(self) -> None:
        """The end: kill what still runs (with `home`, also what lives under it), then reap the children."""
        deadline = time.monotonic() + (self.settle if self.home is not None else 0.0)
        while True:
            if self.home is not None:
                self.add_home(self.home)
            self.kill()
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for child in self.children:
            child.wait(timeout=10)

    def __enter__(self) -> "Started":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def kill_test_processes(home: Any, settle: float = 0.5) -> None:
    """SIGKILL (by pid and start time) what this test started under its ONBOX_HOME; look again for `settle` s for
    late ones."""
    Started(home, settle).stop()
