"""How a run ends, said once: the final commit of its newest complete checkpoint (the checkpoint hook's `final`,
whose summary the hints name), and what each end after a stop records and says.

The loop (loop.py) decides WHEN the run ends and makes the transition; `RunEndings` says WHAT that end is, as an
`Ending` (the state, state.json's message, the transition's reason and fields):
  final(d)            the final commit, bounded by the monotonic deadline `d`; the `final_checkpoint` event
  after_stop()        a notice's stop is over: stopped on request, a session limit (the exit classified
                      session_limit, with how to continue: deadline.py), or preempted by the notice's source
  fenced()            a newer lease holds the run: last_exit says fenced (also when no child was running to stop)
  preempted_message() state.json's message once Slurm's requeue is known (onbox/slurm/job.py): a preemption's, or
                      a session limit's hint that the requeued job resumes by itself
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Optional

from onbox.supervisor import exits as cls
from onbox.supervisor.attempts import AttemptLauncher
from onbox.supervisor.deadline import continue_hint
from onbox.supervisor.notes import preempted_message
from onbox.supervisor.notices import NoticeIntake
from onbox.supervisor.state import RunState


@dataclasses.dataclass
class Ending:
    """A terminal state, state.json's message and the transition's reason and fields."""

    state: RunState
    message: str
    reason: str
    fields: Dict[str, Any] = dataclasses.field(default_factory=dict)


class RunEndings:
    """The ends of one run. `final` calls the checkpoint hook's final commit through `hook` (the journal's guarded
    call, so a failing hook cannot kill the loop); `checkpoints` gives the hook (made after this object's parts)."""

    def __init__(self, run: str, intake: NoticeIntake, launcher: AttemptLauncher,
                 hook: Callable[..., Any], checkpoints: Callable[[], Any], emit: Callable[..., None]) -> None:
        self.run = run
        self.intake = intake
        self.launcher = launcher
        self.hook = hook
        self.checkpoints = checkpoints
        self.emit = emit
        self.final_summary: Optional[Dict[str, Any]] = None  # what the last final commit committed

    def final(self, deadline: float, **fields: Any) -> None:
        """The final commit of the newest complete checkpoint that can finish before `deadline` (monotonic)."""
        summary = self.hook("checkpoints.final", self.checkpoints().final, deadline)
        if isinstance(summary, dict) and summary.get("name"):
            self.final_summary = summary
        self.emit("final_checkpoint", summary=summary, **fields)

    def after_stop(self) -> Ending:
        """A notice's stop is over (not a fence's: `fenced`)."""
        if self.intake.by_request:
            return Ending(RunState.STOPPED, "stopped on request", "onbox stop")
        if self.intake.session_limit:
            return self._session_limit()
        source = self.intake.notice.source if self.intake.notice else "?"
        return Ending(RunState.PREEMPTED, "preempted (%s)" % source, source)  # shutdown says what comes next

    def _session_limit(self) -> Ending:
        """PREEMPTED by the run's deadline: the exit is classified session_limit, with how to continue (the
        checkpoint the final commit made durable, or the newest one); shutdown adds a Slurm requeue's outcome."""
        d = self.intake.deadline
        assert d is not None
        summary = self.final_summary or {}
        checkpoint = summary.get("name") or (os.path.basename(self.launcher.resume_from)
                                             if self.launcher.resume_from else None)
        hint = continue_hint(self.run, checkpoint, d.source, requeued=False)
        self.launcher.record_session_limit(hint)
        self.emit("session_limit", at=d.at, source=d.source, checkpoint=checkpoint,
                  hint=(self.launcher.last_exit or {}).get("hint"))
        return Ending(RunState.PREEMPTED, "session limit: stopped before the %s deadline; %s" % (d.source, hint),
                      cls.SESSION_LIMIT)

    def fenced(self) -> Ending:
        """FENCED: exit 1, last_exit says fenced (also when no child was running to be stopped)."""
        fence = self.intake.fence or {}
        if (self.launcher.last_exit or {}).get("classification") != cls.FENCED:
            self.launcher.record_fence(fence)
        return Ending(RunState.FENCED, "fenced: %s" % (self.launcher.last_exit or {}).get("hint"), "fenced",
                      {"newer_epoch": fence.get("newer_epoch"), "newer_holder": fence.get("newer_holder")})

    def preempted_message(self, message: str, requeue: Optional[Dict[str, Any]]) -> str:
        """A PREEMPTED run's message once the Slurm requeue (`requeue`: the outcome, None without one) is known;
        a session limit keeps `message` unless the job was requeued."""
        if not self.intake.session_limit:
            return preempted_message(self.intake.notice.source if self.intake.notice else "?", requeue, self.run)
        if not (requeue and requeue.get("ok")) or self.intake.deadline is None:
            return message
        checkpoint = (self.final_summary or {}).get("name")
        hint = continue_hint(self.run, checkpoint, self.intake.deadline.source, requeued=True)
        self.launcher.record_session_limit(hint)
        return "session limit: stopped before the deadline; requeued as Slurm job %s; %s" % (
            requeue.get("job_id"), hint)
