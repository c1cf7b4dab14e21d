"""A run's deadline: the wall-clock time its session ends, and when the checkpoint must be asked for to beat it.

The launch resolves the deadline (onbox/launch/deadline.py: --deadline, Slurm's EndTime, a Kaggle session, a
profile's session hours) into config.json's deadline_at (epoch seconds) and deadline_source. The supervisor asks
for the checkpoint at

    ask_at = at - (grace + commit + margin)

grace: the run's (--grace or the profile's, else DEFAULT_GRACE): the trainer's time to save after the checkpoint
signal, KILL after it; commit: what the final commit of the newest complete checkpoint takes by the run's own
measured throughput (the checkpoint hook's `commit_estimate()`; 0 without durable storage); margin:
deadline_margin (default 60 s: the agent's exit, the final state and log writes, a requeue, clock error). ask_at is
recomputed at every loop step, as checkpoints grow and the throughput is measured; once `now >= ask_at` the
NoticeIntake takes a `session_limit` notice like any other (notices.py): the checkpoint signal at once, KILL a
grace later (at - margin - commit), then the final commit, which may run until at - margin. The run ends
PREEMPTED (exit 75) with the classification `session_limit` and a hint that says how to continue.

Wall-clock on purpose: a platform ends a session by its clock, so a clock step moves ask_at with it.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from onbox import vocab

SESSION_LIMIT = vocab.EXIT_SESSION_LIMIT  # the notice's source and the exit's classification


class SessionDeadline:
    """The deadline of one run: `at` (wall-clock epoch seconds), where it came from (`source`: flag, slurm,
    kaggle, profile:<name>), the stop's `grace` and the `margin` kept after the final commit. `estimate`: the
    newest commit estimate (seconds), set by `update`."""

    def __init__(self, at: float, source: str, grace: float, margin: float) -> None:
        self.at = float(at)
        self.source = source
        self.grace = float(grace)
        self.margin = float(margin)
        self.estimate = 0.0
        self.asked_at: Optional[float] = None  # wall time the checkpoint was asked for (the notice was taken)
        self._saved_ask_at: Optional[float] = None  # the ask_at state.json holds (ask_at_moved)

    @classmethod
    def of(cls, cfg: Any, grace: float) -> Optional["SessionDeadline"]:
        """The run's deadline from its configuration (None: the run has none)."""
        if cfg.deadline_at is None:
            return None
        return cls(cfg.deadline_at, cfg.deadline_source or "deadline", grace, cfg.deadline_margin)

    def update(self, estimate: Optional[float]) -> None:
        """The commit estimate now (None: nothing to commit, 0 s)."""
        self.estimate = max(0.0, float(estimate or 0.0))

    @property
    def ask_at(self) -> float:
        """When the checkpoint signal goes (wall-clock)."""
        return self.at - (self.grace + self.estimate + self.margin)

    @property
    def kill_at(self) -> float:
        """When the child must be gone (wall-clock): the commit's time and the margin are left after it."""
        return self.at - self.margin - self.estimate

    @property
    def commit_by(self) -> float:
        """When the final commit must be done (wall-clock)."""
        return self.at - self.margin

    def ask_at_moved(self) -> bool:
        """True (once) when ask_at moved by a second or more since it was last said so: state.json is rewritten
        then, so that `onbox status` shows it."""
        if self._saved_ask_at is not None and abs(self.ask_at - self._saved_ask_at) < 1.0:
            return False
        self._saved_ask_at = self.ask_at
        return True

    def due(self, now_wall: float) -> bool:
        return now_wall >= self.ask_at

    def to_dict(self, now_wall: float) -> Dict[str, Any]:
        """state.json's, the beats' and `onbox status`'s `deadline` block."""
        return {"at": self.at, "source": self.source, "ask_at": round(self.ask_at, 3),
                "left_s": round(self.at - now_wall, 3), "commit_estimate_s": round(self.estimate, 3),
                "grace_s": self.grace, "margin_s": self.margin, "asked_at": self.asked_at}


def continue_hint(run: str, checkpoint: Optional[str], source: str, requeued: bool) -> str:
    """How a run stopped by its deadline goes on: a relaunch (here or elsewhere), a Slurm requeue, a new Kaggle
    session."""
    resumes = ("it resumes from %s" % checkpoint) if checkpoint else "it starts from scratch: no checkpoint was committed"
    if requeued:
        return "Slurm requeued the job: when it runs again %s" % resumes
    if source == "slurm":
        return ("relaunch to continue: submit the job again (or `scontrol requeue` it; --requeue makes the agent do "
                "it), and `onbox run --name %s`: %s" % (run, resumes))
    if source == "kaggle":
        return ("relaunch to continue: in a new Kaggle session (save a version, or start the notebook again), "
                "`onbox run --name %s` with the same --durable: %s" % (run, resumes))
    return "relaunch to continue: `onbox run --name %s`: %s" % (run, resumes)
