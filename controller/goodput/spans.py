"""A ledger's segments (a stretch of time, its part and its box), their merge, and disjoint half-open intervals (what
newer lives took of the time, what newer training took of the steps): the small geometry controller/goodput/ledger.py
is computed with."""
from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, List, Tuple


@dataclasses.dataclass(frozen=True)
class Segment:
    start: float
    end: float
    category: str
    box: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Spans:
    """Disjoint half-open intervals, sorted: what is taken (time by newer lives, steps by newer training)."""

    def __init__(self) -> None:
        self.lo: List[float] = []
        self.hi: List[float] = []

    def overlap(self, a: float, b: float) -> List[Tuple[float, float]]:
        """The parts of [a, b) that are taken."""
        out = []
        i = max(0, bisect.bisect_right(self.hi, a))
        while i < len(self.lo) and self.lo[i] < b:
            lo, hi = max(a, self.lo[i]), min(b, self.hi[i])
            if hi > lo:
                out.append((lo, hi))
            i += 1
        return out

    def add(self, a: float, b: float) -> None:
        if b <= a:
            return
        i = bisect.bisect_left(self.hi, a)
        j = i
        while j < len(self.lo) and self.lo[j] <= b:
            a, b = min(a, self.lo[j]), max(b, self.hi[j])
            j += 1
        self.lo[i:j], self.hi[i:j] = [a], [b]


def free(spans: Spans, a: float, b: float) -> List[Tuple[float, float]]:
    """The parts of [a, b) not taken."""
    out, cur = [], a
    for lo, hi in spans.overlap(a, b):
        if lo > cur:
            out.append((cur, lo))
        cur = max(cur, hi)
    if cur < b:
        out.append((cur, b))
    return out


def merge(segs: Iterable[Segment]) -> List[Segment]:
    """Sorted by time, neighbours of one category and box joined."""
    out: List[Segment] = []
    for s in sorted(segs, key=lambda x: (x.start, x.end)):
        if s.end <= s.start:
            continue
        if out and out[-1].category == s.category and out[-1].box == s.box and abs(out[-1].end - s.start) < 1e-9:
            out[-1] = dataclasses.replace(out[-1], end=max(out[-1].end, s.end))
        else:
            out.append(s)
    return out
