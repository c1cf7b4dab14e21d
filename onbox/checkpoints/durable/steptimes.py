"""Where a commit's time goes: wall seconds per step, recorded by whoever runs the step (the committer, a target's
put_payload) into the recorder of the commit under way in this thread, so the DurableTarget protocol stays as it
is. The checkpoint_committed event carries them; tests/bench/bench_checkpoints.py prints them beside cp + sync.
Outside a recording, phase() only runs its block."""
from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Dict, Iterator, Optional


class PhaseTimes:
    """Seconds per phase name, summed over every time a phase ran, in the order the phases first ran."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    def rounded(self) -> Dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}


_current: "contextvars.ContextVar[Optional[PhaseTimes]]" = contextvars.ContextVar("onbox_commit_phases",
                                                                                default=None)


@contextlib.contextmanager
def recording(times: PhaseTimes) -> Iterator[PhaseTimes]:
    """Record the phases run in this thread into `times` until the block ends."""
    token = _current.set(times)
    try:
        yield times
    finally:
        _current.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    times = _current.get()
    if times is None:
        yield
        return
    # a measurement of real work for people to read, never a deadline: the real clock, not the clock seam
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times.seconds[name] = times.seconds.get(name, 0.0) + time.perf_counter() - t0
