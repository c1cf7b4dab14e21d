"""The wall and CPU time of one command, measured to the millisecond, for the benchmarks that time short commands.

Why not `subprocess.run(argv, timeout=T)` around a clock: with a timeout, Popen.wait polls for the child's end with
sleeps that double from 1 ms up to 50 ms, so the clock stops at the first poll after the exit: a child that takes
64 ms reads as ~114 ms (the polls fall at about 1, 3, 7, 15, 31, 63, 113, 163 ms). That quantum made a 64 ms
`onbox --version` look 1.7x a 60 ms `import click`. Here the wait is a poll(2) on a pidfd, which wakes at the exit
(Linux 5.3, Python 3.9); without pidfds, a 1 ms poll of wait4(WNOHANG). Either way the wait is bounded by `timeout`,
after which the child (ours, never reaped before the kill) is killed and the run fails.
"""
from __future__ import annotations

import os
import select
import subprocess
import time
from typing import Any, List, NamedTuple


class Timed(NamedTuple):
    wall: float  # seconds from the start to the reaped exit
    cpu: float  # user + system seconds of the child (and of its reaped children), the kernel's accounting


def run_timed(argv: List[str], timeout: float, **popen: Any) -> Timed:
    """Run argv (stdout and stderr to /dev/null unless given); CalledProcessError on a non-zero exit,
    TimeoutExpired after `timeout` s."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, **popen)
    try:
        usage = _reap(proc, time.monotonic() + timeout)
        wall = time.perf_counter() - t0
        if usage is None:
            raise subprocess.TimeoutExpired(argv, timeout)
    finally:
        proc.kill()  # a no-op once reaped (returncode set): a pid is never signalled after its reaping
        proc.wait()
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv)
    return Timed(wall, usage.ru_utime + usage.ru_stime)


def _reap(proc: subprocess.Popen, deadline: float) -> Any:
    """Wait until `proc` exits (its rusage, returncode set) or the deadline passes (None, not reaped)."""
    opener = getattr(os, "pidfd_open", None)
    if opener is not None:
        fd = opener(proc.pid)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)  # readable once the process has ended
            if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                return None
        finally:
            os.close(fd)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            return usage
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)
