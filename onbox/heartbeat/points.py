"""The trainer's own points in each beat: every metric record the agent parsed since the previous beat (loss,
eval_loss, lr, tokens_per_s, ... with its step and its time) as the beat's `points` section, so that a tracker
draws curves at the trainer's resolution, not one point per beat.

The section is columns of equal length, one entry per record in the order the records were parsed:

    {"time": [1700000000.123, ...], "step": [1201, ...], "loss": [2.31, ...], "lr": [0.0003, ...],
     "thinned": 0, "dropped": 0}

`time` (seconds since the epoch on the box's clock, millisecond resolution) and `step` (the record's step, else the
newest step known when it was parsed; null when none is) are always there; a metric field (FIELDS) is there when
some record carried it, null where a record did not; a value that is not finite travels as "NaN", "Infinity" or
"-Infinity".

Bounded: at most MAX_POINTS records a beat (500: more than 16 records a second at the default 30 s interval).
Past it the records are thinned evenly, each kind on its own (records that carry the same fields: an eval record
that comes every few hundred steps is never thinned away for the train records around it), the first and the last
of each kind kept; `thinned` counts the records left out, `dropped` those the agent lost before the beat (it keeps
at most 10,000 between two beats: onbox/telemetry/progress.py PointLog).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from onbox.telemetry.metrics import FIELDS

MAX_POINTS = 500
METRICS = tuple(f for f in FIELDS if f != "step")


def evenly(n: int, k: int) -> List[int]:
    """k of the indices 0..n-1, evenly spread, the first and the last among them (k >= 2); all when k >= n; the
    last alone when k == 1."""
    if k >= n:
        return list(range(n))
    if k <= 0:
        return []
    if k == 1:
        return [n - 1]
    return [(j * (n - 1) + (k - 1) // 2) // (k - 1) for j in range(k)]


def shares(sizes: Sequence[int], budget: int) -> List[int]:
    """How many of each group to keep within `budget`: the smaller groups whole, the rest split evenly among the
    larger ones (water filling), never more than a group has."""
    order = sorted(range(len(sizes)), key=lambda g: sizes[g])
    out = [0] * len(sizes)
    left = budget
    for rank, g in enumerate(order):
        share = left // (len(order) - rank)
        out[g] = min(sizes[g], share)
        left -= out[g]
    return out


def thin(points: Sequence[Any], limit: int = MAX_POINTS) -> List[int]:
    """The indices of the records to keep (at most `limit`, in their order): each kind of record (the set of
    fields it carries) thinned evenly on its own."""
    if len(points) <= limit:
        return list(range(len(points)))
    groups: Dict[Any, List[int]] = {}
    for i, point in enumerate(points):
        groups.setdefault(frozenset(point[2]), []).append(i)
    members = list(groups.values())
    keep: List[int] = []
    for idx, k in zip(members, shares([len(m) for m in members], limit)):
        keep.extend(idx[j] for j in evenly(len(idx), k))
    return sorted(keep)


def beat_points(points: Sequence[Any], dropped: int = 0, limit: int = MAX_POINTS) -> Dict[str, Any]:
    """The beat's `points` section from PointLog.take()'s records ([time_ms, step, {field: value}], values
    JSON-safe) and its count of dropped records."""
    keep = thin(points, limit)
    kept = [points[i] for i in keep]
    out: Dict[str, Any] = {"time": [int(p[0]) / 1000.0 for p in kept], "step": [p[1] for p in kept]}
    for field in METRICS:
        if any(field in p[2] for p in kept):
            out[field] = [p[2].get(field) for p in kept]
    out["thinned"] = len(points) - len(kept)
    out["dropped"] = int(dropped)
    return out
