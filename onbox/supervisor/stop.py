"""The one stop procedure: how an attempt's child is stopped, whoever asked.

A preemption (a signal, a cloud notice, a peer node's notice), `onbox stop` and the end of a curriculum phase
(phases.py) all stop the child the same way: the checkpoint signal to its process group, a grace, SIGKILL at the
deadline (PyTorch elastic's TERM, then a monotonic deadline, then KILL). `ChildStop` is that timeline and nothing
else: it says which stage is due, the caller acts and says so in its own events (`signal_forwarded` and
`escalated` for a notice, `phase_end_escalated` for a phase end). A notice's stop also keeps time back for the
final commit (the reserve: the commit runs at deadline - reserve whatever the child is doing); a phase end commits
after the exit and keeps none back. A notice's acts are notices.py's, a phase end's the curriculum's (phases.py).
"""
from __future__ import annotations

import enum
from typing import Dict, List, Optional, Tuple

DEFAULT_GRACE = 30.0  # seconds from notice (or phase end) to hard kill when neither --grace nor the profile says


def grace_for(configured: Optional[float], lead: Optional[float]) -> float:
    """The grace of a stop: --grace (or the profile's), else what the notice says it leaves (`lead`), else
    DEFAULT_GRACE; never more than `lead`, the time the notice says is really left."""
    grace = configured if configured is not None else (lead if lead is not None else DEFAULT_GRACE)
    return min(grace, lead) if lead is not None else grace


class StopStage(str, enum.Enum):
    """How far one stop of a child has gone. Transitions (each stage is entered at most once):

    ASKED    -> RESERVE (the reserve mark, deadline - reserve, passed: the final commit runs now, and TERM follows
                when the checkpoint signal was another; a stop without a reserve, a phase end, never enters it)
                | KILLED (the deadline passed first) | EXITED
    RESERVE  -> KILLED (the deadline passed: SIGKILL to the process group) | EXITED
    KILLED   -> EXITED
    EXITED   is the end: the child's exit was seen (or there was no child: a stop during a backoff). The final
             commit runs then, unless it already ran at the reserve mark and the deadline has passed: time still
             left goes to committing what the trainer saved after the mark.
    """

    ASKED = "asked"
    RESERVE = "reserve"
    KILLED = "killed"
    EXITED = "exited"


STOP_TRANSITIONS: Dict[StopStage, Tuple[StopStage, ...]] = {
    StopStage.ASKED: (StopStage.RESERVE, StopStage.KILLED, StopStage.EXITED),
    StopStage.RESERVE: (StopStage.KILLED, StopStage.EXITED),
    StopStage.KILLED: (StopStage.EXITED,),
    StopStage.EXITED: (),
}


class ChildStop:
    """One stop's timeline, pure: the child was asked at `since` and must be gone by `deadline` (monotonic
    seconds). `reserve`: seconds kept back for the final commit (sync_reserve), None for none."""

    def __init__(self, since: float, deadline: float, reserve: Optional[float] = None) -> None:
        self.since = since
        self.deadline = deadline
        self.reserve = reserve
        self.stages: List[StopStage] = [StopStage.ASKED]  # every stage entered, in order

    @property
    def stage(self) -> StopStage:
        return self.stages[-1]

    @property
    def reserve_mark(self) -> Optional[float]:
        """When the final commit starts: deadline - reserve, but the reserve is never more than half the grace, so
        a short grace (Slurm KillWait 5 s, RunPod ~5 s) still gives the trainer time to save before the commit."""
        if self.reserve is None:
            return None
        return self.deadline - min(self.reserve, max(0.0, (self.deadline - self.since) / 2.0))

    def due(self, now: float) -> Optional[StopStage]:
        """The stage the stop enters now, if one is due (the deadline before the reserve mark); else None."""
        if self.stage in (StopStage.ASKED, StopStage.RESERVE) and now >= self.deadline:
            return self._enter(StopStage.KILLED)
        mark = self.reserve_mark
        if self.stage == StopStage.ASKED and mark is not None and now >= mark:
            return self._enter(StopStage.RESERVE)
        return None

    def exited(self, now: float) -> bool:
        """The child's exit was seen: True when the final commit runs now (see StopStage.EXITED)."""
        committed = StopStage.RESERVE in self.stages
        self._enter(StopStage.EXITED)
        return not committed or now < self.deadline

    def _enter(self, stage: StopStage) -> StopStage:
        if stage not in STOP_TRANSITIONS[self.stage]:
            allowed = ", ".join(s.value for s in STOP_TRANSITIONS[self.stage]) or "none (the stop is over)"
            raise RuntimeError("illegal stop stage %s -> %s; allowed from %s: %s"
                               % (self.stage.value, stage.value, self.stage.value, allowed))
        self.stages.append(stage)
        return stage
