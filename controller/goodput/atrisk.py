"""Work at risk: how much training a loss of the box now would cost. It is what a relaunch goes back to: the newest
*durable* checkpoint (the recovery point), so it is the time and the steps since that checkpoint's step.

    steps at risk = the newest step - the newest durable checkpoint's step
    time at risk  = when the newest step was seen - when the trainer reported that checkpoint's step (its
                    `step_time`; its commit time where the agent does not say it), both on the box's clock

With no durable checkpoint yet, every step is at risk (the time is unknown: the beats do not carry the run's
start). Past the bound (`--max-at-risk`), the row carries the alert `at_risk`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

ALERT = "at_risk"


def format_duration(seconds: Optional[float]) -> str:
    """30m, 2h, 45s, 1.5s: the short form status prints."""
    if seconds is None:
        return "-"
    if seconds >= 5400:
        return "%.1fh" % (seconds / 3600.0)
    if seconds >= 90:
        return "%dm" % (seconds // 60)
    return "%ds" % seconds if seconds >= 10 else "%.1fs" % seconds


@dataclasses.dataclass(frozen=True)
class AtRisk:
    seconds: Optional[float]
    steps: Optional[int]
    durable_step: Optional[int]
    bound: Optional[float] = None

    @property
    def alert(self) -> bool:
        return self.bound is not None and self.seconds is not None and self.seconds > self.bound

    def label(self) -> str:
        """`12m/340` (time/steps), `-/340` with the time unknown, `-` with nothing known."""
        if self.seconds is None and self.steps is None:
            return "-"
        return "%s/%s" % (format_duration(self.seconds) if self.seconds is not None else "-",
                          self.steps if self.steps is not None else "-")

    def to_dict(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), alert=self.alert)


def work_at_risk(step: Optional[int], step_time: Optional[float], durable_step: Optional[int],
                 durable_at: Optional[float], bound: Optional[float] = None) -> AtRisk:
    if durable_step is None:
        return AtRisk(None, step, None, bound)
    steps = max(0, step - durable_step) if step is not None else None
    seconds = max(0.0, step_time - durable_at) if step_time is not None and durable_at is not None else None
    if steps == 0 and seconds is None:
        seconds = 0.0
    return AtRisk(None if seconds is None else round(seconds, 3), steps, durable_step, bound)
