"""What a goodput ledger reads of a heartbeat: a `Beat`, taken from a beat's document (a heartbeat file, the
tracker's `GET /api/v1/runs/<run>/heartbeats`) or from the tracker's stored columns (controller/tracker/goodput.py).

Everything in a beat is outside input (a box, a hand-edited file): a field of the wrong type, a bool for a number,
NaN or a number past MAX_NUMBER is read as unknown (None), never raised; a beat without its run, seq, time or state
is no Beat at all (None).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

from onbox import vocab

MAX_NUMBER = 1e13  # seconds (the year 318857) and steps: past it a number is a hand edit, read as unknown
# the states a run's agent ends in (onbox/supervisor/state.py, plus an older agent's and Slurm's words)
FINAL_STATES = vocab.ENDED_STATES
CLEAN_STATES = vocab.CLEAN_STATES  # the run ended as it was meant to
BACKOFF_STATE = vocab.BACKOFF  # its child exited and a restart follows (after the backoff)
STOPPING_STATE = vocab.STOPPING  # a notice, a stop or a fence is being handled: the trainer checkpoints and exits


def number(v: Any) -> Optional[float]:
    """A finite number within MAX_NUMBER, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # 10**400
        return None
    return f if math.isfinite(f) and abs(f) <= MAX_NUMBER else None


def whole(v: Any) -> Optional[int]:
    """A whole number >= 0 within MAX_NUMBER, else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_NUMBER else None


@dataclasses.dataclass(frozen=True)
class Beat:
    """One heartbeat as the ledger reads it (times on the box's clock, seconds since the epoch)."""

    seq: int
    time: float
    box: str
    attempt: int
    state: str
    step: Optional[int] = None  # progress.step: the newest step the trainer reported
    step_time: Optional[float] = None  # progress.time: when it was reported (older than the beat)
    first_point: Optional[Tuple[float, int]] = None  # the first record with a step this beat brought (points)
    durable_step: Optional[int] = None  # the newest durable checkpoint's step and commit time
    durable_at: Optional[float] = None
    durable_step_time: Optional[float] = None  # when the trainer reported that checkpoint's step (work at risk)
    local_step: Optional[int] = None  # the newest complete local checkpoint's step (what a restart resumes from)
    stalled: bool = False  # the agent's `stall` alert: no new step and no output while the child lives
    agent_at: Optional[float] = None  # times: when its agent started, the attempt's setup began, its child spawned
    setup_at: Optional[float] = None
    child_at: Optional[float] = None
    phase: Optional[int] = None  # the [[phase]] index: each phase counts its own steps
    interval: Optional[float] = None  # the agent's heartbeat interval (its liveness clock)
    preempted: bool = False  # a preemption notice was under way


def _dig(doc: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc


def _first_point(points: Any) -> Optional[Tuple[float, int]]:
    """The first record of a beat's `points` (columns of equal length) that carries a step and a time."""
    times, steps = _dig(points, "time"), _dig(points, "step")
    if not isinstance(times, list) or not isinstance(steps, list):
        return None
    for t, s in zip(times, steps):
        t, s = number(t), whole(s)
        if t is not None and s is not None:
            return t, s
    return None


def _has_stall(alerts: Any) -> bool:
    return isinstance(alerts, list) and any(isinstance(a, dict) and a.get("code") == "stall" for a in alerts)


def beat_from_doc(doc: Any) -> Optional[Beat]:
    """The Beat of a heartbeat document (onbox.heartbeat/1, or a tracker's thinned metric point), None when it lacks
    what every beat has: seq, time, box, attempt, state."""
    if not isinstance(doc, dict):
        return None
    seq, t, attempt = whole(doc.get("seq")), number(doc.get("time")), whole(doc.get("attempt"))
    box, state = doc.get("box"), doc.get("state")
    if seq is None or t is None or attempt is None or not isinstance(state, str):
        return None
    latest = _dig(doc, "checkpoint", "latest_durable")
    times: Dict[str, Any] = doc["times"] if isinstance(doc.get("times"), dict) else {}
    return Beat(
        seq=seq, time=t, box=box if isinstance(box, str) and box else "?", attempt=attempt, state=state.lower(),
        step=whole(_dig(doc, "progress", "step")), step_time=number(_dig(doc, "progress", "time")),
        first_point=_first_point(doc.get("points")),
        durable_step=whole(_dig(latest, "step")), durable_at=number(_dig(latest, "committed_at")),
        durable_step_time=number(_dig(latest, "step_time")),
        local_step=whole(_dig(doc, "checkpoint", "latest_local", "step")),
        stalled=_has_stall(doc.get("alerts")),
        agent_at=number(times.get("agent_started_at")), setup_at=number(times.get("setup_at")),
        child_at=number(times.get("child_started_at")), phase=whole(_dig(doc, "phase", "index")),
        interval=number(doc.get("interval_s")), preempted=isinstance(doc.get("preemption"), dict))


def beats_from_docs(docs: Iterable[Any]) -> Tuple[List[Beat], int]:
    """(the Beats of `docs` in seq order, one per seq; how many documents were no beat)."""
    by_seq: Dict[int, Beat] = {}
    bad = 0
    for doc in docs:
        b = beat_from_doc(doc)
        if b is None:
            bad += 1
        else:
            by_seq.setdefault(b.seq, b)
    return [by_seq[s] for s in sorted(by_seq)], bad
