"""Numbered crash points for the replayers in patterns.py, and a fork helper that SIGKILLs a child at one.

A replayer calls `point(label)` at every boundary where a real save can be interrupted with a different result on
disk: after a file was created (empty), after part of its bytes, after all of them, after a rename, after each
file a rotation deleted. Counting them once (`list_points`) and then forking one child per point
(`run_to_point`) enumerates every on-disk state a SIGKILL during that save can leave, deterministically, in
milliseconds per trial; `run_killed_after` kills at a random wall-clock time instead.

Only the test child is ever signalled, by the PID fork returned.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, List, Optional


class _Points:
    def __init__(self) -> None:
        self.target: Optional[int] = None
        self.count = 0
        self.labels: Optional[List[str]] = None

    def hit(self, label: str) -> None:
        self.count += 1
        if self.labels is not None:
            self.labels.append(label)
        if self.target is not None and self.count == self.target:
            os.kill(os.getpid(), signal.SIGKILL)


_POINTS = _Points()


def point(label: str) -> None:
    """A place inside a replayed save where a kill leaves a distinct on-disk state."""
    _POINTS.hit(label)


def list_points(write: Callable[..., Any], *args: Any, **kwargs: Any) -> List[str]:
    """Run `write` in this process (it does write its files) and return the label of each crash point in order;
    point k (1-based) of a later run_to_point is labels[k-1]."""
    saved = (_POINTS.target, _POINTS.count, _POINTS.labels)
    _POINTS.target, _POINTS.count, _POINTS.labels = None, 0, []
    try:
        write(*args, **kwargs)
        return list(_POINTS.labels or [])
    finally:
        _POINTS.target, _POINTS.count, _POINTS.labels = saved


def _child(write: Callable[..., Any], target: Optional[int], args: tuple, kwargs: dict) -> None:
    code = 0
    try:
        _POINTS.target, _POINTS.count, _POINTS.labels = target, 0, None
        write(*args, **kwargs)
    except BaseException:  # a forked child must never return into the test runner
        code = 70
    finally:
        os._exit(code)


def _wait(pid: int, timeout: float) -> int:
    """Exit status as subprocess does: -signal when killed. The child is SIGKILLed if it outlives `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return -os.WTERMSIG(status)
        time.sleep(0.001)


def run_to_point(write: Callable[..., Any], k: int, *args: Any, timeout: float = 30.0, **kwargs: Any) -> int:
    """Fork a child that runs `write` and SIGKILLs itself at crash point k; returns its status (-9 when the point
    was reached, 0 when the save finished first, 70 when it raised)."""
    pid = os.fork()
    if pid == 0:
        _child(write, k, args, kwargs)
    return _wait(pid, timeout)


def run_killed_after(write: Callable[..., Any], delay: float, *args: Any, timeout: float = 30.0,
                     **kwargs: Any) -> int:
    """Fork a child that runs `write`; SIGKILL it `delay` seconds later unless it finished. Returns its status."""
    pid = os.fork()
    if pid == 0:
        _child(write, None, args, kwargs)
    time.sleep(delay)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return _wait(pid, timeout)
