"""Where the trainer's output goes, once the loop has read it: each line to the telemetry hook and to the run's one
ProgressFeed (onbox/telemetry/progress.py, the only parser of the trainer's progress); each record the feed takes to
the telemetry hook, the hang watch (hang.py: each line, for an eval it announces, and each record, for the step
cadence) and, while an attempt is under way, to the curriculum (phases.py).

ONBOX_METRICS_FILE keeps every earlier attempt's and phase's records: the feed has read all of them before the next
attempt starts, so a record that reaches the curriculum is always the current attempt's.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from onbox.telemetry.progress import ProgressFeed

HookCall = Callable[..., Any]  # RunJournal.hook: (what, fn, *args), a failing hook said, never raised


class OutputRoute:
    """`on_line` for the attempt launcher; `read_metrics_file` each loop step and at shutdown. `telemetry()` and
    `curriculum()` are looked up at each call (the hooks are made after the launcher that feeds this)."""

    def __init__(self, feed: ProgressFeed, hook: HookCall, telemetry: Callable[[], Any], curriculum: Callable[[], Any],
                 attempt_running: Callable[[], bool], watch: Any = None) -> None:
        self.feed = feed
        self.watch = watch
        self.hook = hook
        self.telemetry = telemetry
        self.curriculum = curriculum
        self.attempt_running = attempt_running

    def on_line(self, line: str) -> None:
        self.hook("telemetry.on_output", self.telemetry().on_output, line)
        if self.watch is not None:
            self.watch.on_line(line)
        fields = self.feed.on_output(line)
        if fields:
            self.on_record(fields)

    def read_metrics_file(self) -> None:
        for fields in self.feed.read_metrics_file():
            self.on_record(fields)

    def on_record(self, fields: Dict[str, float]) -> None:
        self.hook("telemetry.on_progress", self.telemetry().on_progress, fields)
        if self.watch is not None:
            self.watch.on_record(fields)
        if self.attempt_running():
            self.curriculum().on_progress(fields)
