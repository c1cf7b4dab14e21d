"""Whether the trainer's output is recognised as metrics: once the child has printed for `metrics_hint_minutes`
and no line was recognised, the `metrics_unrecognised` event says so with the flag to use; once a record finally
comes, `metrics_recognised` says the warning is over. The heartbeat hook (hook.py) feeds it under its lock and
emits what `check` returns outside it (an emitted event calls back into the hook).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from onbox import vocab

HINT = ("give the shape with --metrics-regex, e.g. --metrics-regex 'step (?P<step>\\d+) .*loss (?P<loss>[-+.\\deE]+)' "
        "(named groups: step, loss, eval_loss, lr, tokens_per_s, samples_per_s, epoch), or have the trainer append "
        "JSON lines to $ONBOX_METRICS_FILE")


class MetricsHint:
    """The hint of one supervision: said at most once (`hinted`), and its end said once a record comes."""

    def __init__(self, hint_seconds: float) -> None:
        self.hint_seconds = hint_seconds
        self.first_output: Optional[float] = None  # monotonic time of the child's first line
        self.lines = 0
        self.hinted = False  # metrics_unrecognised was emitted (once a supervision)
        self.heard = False  # a progress record came (in this supervision)
        self._recognised_pending = False

    def on_output(self, mono: float) -> None:
        self.lines += 1
        if self.first_output is None:
            self.first_output = mono

    def on_record(self) -> None:
        if self.hinted and not self.heard:
            self._recognised_pending = True
        self.heard = True

    def check(self, mono: float) -> List[Tuple[str, Dict[str, Any]]]:
        """The events to emit now, (kind, fields) each: metrics_recognised, metrics_unrecognised, or none."""
        said: List[Tuple[str, Dict[str, Any]]] = []
        if self._recognised_pending:
            self._recognised_pending = False
            said.append((vocab.EV_METRICS_RECOGNISED, {}))
        if (not self.hinted and self.hint_seconds > 0 and not self.heard and self.first_output is not None
                and mono - self.first_output >= self.hint_seconds):
            self.hinted = True
            minutes = self.hint_seconds / 60.0
            said.append((vocab.EV_METRICS_UNRECOGNISED, {
                "lines": self.lines, "minutes": minutes,
                "message": "the job has printed %d lines in %s min and none of them was recognised as a metric: no "
                           "step, no loss in status or heartbeats" % (self.lines, "%g" % minutes),
                "hint": HINT}))
        return said
