"""Fakes the supervisor loop receives, for driving it by scripted observations on a FakeClock: a process seam whose
attempts follow scripts (FakeProcs, with the scripts `exits_after` and `dies_on`) and a checkpoint hook that records
its calls (Checkpoints); and the loop's part for a telemetry hook driven without it (`loop_step`)."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from onbox.clock import FakeClock
from onbox.proc import Child, ExitStatus, ProcInfo, ProcRef, Stopped

# An attempt's script: given (seconds since spawn, signals received so far) -> an ExitStatus once it has ended.
Script = Callable[[float, List[int]], Optional[ExitStatus]]


def exits_after(seconds: float, code: int) -> Script:
    return lambda t, sigs: ExitStatus(code=code) if t >= seconds else None


def dies_on(sig: int) -> Script:
    return lambda t, sigs: ExitStatus(signal=sig) if sig in sigs else None


class FakeProcs:
    """The ProcessSeam surface the supervisor uses, answering from scripts; records every signal with its time."""

    def __init__(self, clock: FakeClock, scripts: List[Script]) -> None:
        self.clock = clock
        self.scripts = list(scripts)
        self.spawned: List[Tuple[float, List[str]]] = []
        self.signals: List[Tuple[float, int]] = []
        self._current: Optional[Tuple[Child, Script, float, List[int]]] = None

    def spawn(self, argv, env, cwd, log_path) -> Child:
        script = self.scripts.pop(0)
        pid = 1000 + len(self.spawned)
        self.spawned.append((self.clock.monotonic(), list(argv)))
        child = Child(pid=pid, sid=pid, pgid=pid, start_time=pid)
        self._current = (child, script, self.clock.monotonic(), [])
        return child

    def poll(self, child: Child) -> Optional[ExitStatus]:
        assert self._current is not None and self._current[0].pid == child.pid
        _, script, t0, sigs = self._current
        return script(self.clock.monotonic() - t0, sigs)

    def signal_group(self, pgid: int, sig: int) -> bool:
        self.signals.append((self.clock.monotonic(), int(sig)))
        if self._current is not None:
            self._current[3].append(int(sig))
        return True

    def kill_session(self, sid, timeout, log=None, leader_start=None, also=None, on_step=None) -> Stopped:
        return Stopped()

    def descendants(self, root: ProcRef) -> List[ProcInfo]:
        return []

    def marked(self, name: str, value: str) -> List[ProcInfo]:
        return []

    def start_time_of(self, pid: int) -> Optional[int]:
        return None

    def reap_zombies(self, keep=()) -> List[int]:
        return []


class Checkpoints:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.finals: List[Tuple[float, float]] = []  # (called at, deadline)
        self.fallbacks: List[bool] = []  # what after_failure answers, one per failed attempt (then False)
        self.failures: List[float] = []  # the attempt lengths it was told

    def restore(self):
        return None

    def after_failure(self, seconds: float) -> bool:
        self.failures.append(seconds)
        return self.fallbacks.pop(0) if self.fallbacks else False

    def periodic(self) -> None:
        return None

    def final(self, deadline: float):
        self.finals.append((self.clock.monotonic(), deadline))
        return None


def loop_step(hook: Any, *lines: str) -> None:
    """What a step of the supervisor loop hands a telemetry hook (a HeartbeatHook built outside a loop: its own
    progress feed, `hook.feed`): each new line of the child's output to the hook and, parsed once, to the feed;
    then the records appended to ONBOX_METRICS_FILE; each record the feed takes goes to the hook's on_progress."""
    for line in lines:
        hook.on_output(line)
        fields = hook.feed.on_output(line)
        if fields:
            hook.on_progress(fields)
    for fields in hook.feed.read_metrics_file():
        hook.on_progress(fields)
