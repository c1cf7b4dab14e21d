"""The clock seam: monotonic time for deadlines, wall time for records, sleep. Tests pass a FakeClock."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock tests move by hand: sleep() advances time instead of waiting."""

    def __init__(self, start_wall: float = 1_700_000_000.0, start_mono: float = 1000.0) -> None:
        self._wall = start_wall
        self._mono = start_mono
        self.sleeps: list = []

    def monotonic(self) -> float:
        return self._mono

    def time(self) -> float:
        return self._wall

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(max(0.0, seconds))

    def advance(self, seconds: float) -> None:
        self._mono += seconds
        self._wall += seconds
