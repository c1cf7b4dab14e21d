"""What follows an attempt's exit, decided without touching anything: restart after a backoff, or end the run.

The rules, in order: a success ends the run DONE (restart = "always": restart at once); a failure under
restart = "never" ends it FAILED, and so does a failure no restart can mend (exits.RESTART_CANNOT_FIX: a container
refused its GPUs); the same failure (exits.Classification.loop_key) crash_loop_threshold times in
a row is a crash loop: FAILED, with the failure's hint; max_restarts spent: FAILED ("gave up"); else restart after
backoff_initial doubled for each failure in the streak, at most backoff_max. A failed attempt that made the
checkpoints fall back to an older checkpoint (CheckpointHook.after_failure) starts the streak again: the next
attempt starts elsewhere, so it is not the same loop.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

from onbox.config import RunConfig
from onbox.supervisor import exits
from onbox.supervisor.exits import Classification
from onbox.supervisor.state import RunState


@dataclasses.dataclass(frozen=True)
class Decision:
    """BACKOFF: restart after `delay` seconds (`reason`: what the restart follows); DONE or FAILED: the run ends
    with `message` (state.json's), the transition saying `reason` and `fields`."""

    state: RunState
    reason: str
    message: str = ""
    delay: float = 0.0
    fields: Dict[str, Any] = dataclasses.field(default_factory=dict)


class RestartPolicy:
    """The run's restart policy and the streak of failures it has seen (loop keys, the newest last)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.restart = cfg.restart
        self.max_restarts = cfg.max_restarts
        self.crash_loop_threshold = cfg.crash_loop_threshold
        self.backoff_initial = cfg.backoff_initial
        self.backoff_max = cfg.backoff_max
        self.streak: List[str] = []  # loop keys of consecutive failures

    def reset(self) -> None:
        """A new beginning (a curriculum phase ended): earlier failures are no loop of the next ones."""
        self.streak = []

    def decide(self, result: Classification, restarts: int, fell_back: bool = False) -> Decision:
        """What follows an attempt that ended with `result`, after `restarts` restarts so far. `fell_back`: the
        checkpoints quarantined the one the attempt resumed from (the next starts from an older one)."""
        if not result.failed:
            self.streak = []
            if self.restart == "always":
                return Decision(RunState.BACKOFF, "restart=always after success")
            return Decision(RunState.DONE, result.message)
        if fell_back:
            self.streak = []
        self.streak.append(result.loop_key)
        if self.restart == "never":
            return Decision(RunState.FAILED, result.message, result.message)
        if result.classification in exits.RESTART_CANNOT_FIX:
            message = "not restarting: %s; a restart cannot change that%s" % (
                result.message, (" — what to do: " + result.hint) if result.hint else "")
            return Decision(RunState.FAILED, message, message, fields={"classification": result.classification})
        same = 0
        for key in reversed(self.streak):
            if key != result.loop_key:
                break
            same += 1
        if self.crash_loop_threshold and same >= self.crash_loop_threshold:
            message = ("crash loop: the same failure (%s) %d times in a row; not restarting. %s%s"
                       % (result.classification, same, result.message,
                          (" — what to do: " + result.hint) if result.hint else ""))
            return Decision(RunState.FAILED, message, message, fields={"classification": result.classification})
        if restarts >= self.max_restarts:
            message = "gave up after %d restart(s): %s" % (restarts, result.message)
            return Decision(RunState.FAILED, message, message)
        delay = min(self.backoff_max, self.backoff_initial * (2 ** (len(self.streak) - 1)))
        return Decision(RunState.BACKOFF, result.message, delay=delay)
