"""Multi-phase curricula: a run file's `[[phase]]` tables (checked in phasespec.py), run one after another by the
one supervisor loop.

    [[phase]]
    name = "broad"                      # letters, digits, '.', '_', '-'
    target_steps = 20000                # the trainer's own step count (a resumed trainer continues it)
    # target_tokens = 4e10, tokens_per_step = 2097152   (onbox reads steps: tokens = steps x tokens_per_step)
    args = ["--data", "web"]            # appended to the run's command (or: command = [...] replaces it)
    lr = 3e-4                           # the LR policy, handed to the command as ONBOX_PHASE_LR, ..._MIN_LR,
    lr_schedule = "cosine"              #   ..._LR_SCHEDULE, ..._WARMUP_STEPS: the trainer applies it
    warmup_steps = 2000
    env = { DATA_MIX = "web" }
    criteria = ["eval_loss < 2.5"]      # all must hold at the end of the phase (METRIC < <= > >= NUMBER)
    on_fail = "fail"                    # or "continue": record the failed criteria and go on

What onbox can honestly do, and does: it reads the step (and the metrics) from the trainer's own output and
ONBOX_METRICS_FILE, the records of the run's one progress feed (onbox/telemetry/progress.py) that the loop hands on
while an attempt is under way (`on_progress`). When the phase's target is reached it asks the child to stop as for a
preemption (the checkpoint signal to its process group; SIGKILL after the grace), or the command ends the phase
itself by exiting 0. Then the criteria are checked on the newest value of each metric seen in the phase; the
phase's final checkpoint is committed, and the next phase's command starts from it (ONBOX_RESUME_FROM, {ckpt} in
the resume args). A phase whose criteria fail ends the run FAILED (on_fail = "fail", the default) or is recorded
and passed (on_fail = "continue"). A crash inside a phase is a crash: the restart policy restarts the same phase.

The current phase is part of the run's persisted state (state.json `phase`), so a relaunch after a preemption
resumes inside it. Every phase but the last needs a target; the last one may run until its command exits 0.
"""
from __future__ import annotations

import dataclasses
import signal
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox.clock import Clock
from onbox.config import RunConfig, parse_signal
from onbox.errors import UsageError
from onbox.fsutil import json_safe
from onbox.supervisor.phasespec import PhaseSpec, parse_phases
from onbox.supervisor.stop import ChildStop, StopStage, grace_for

__all__ = ["Curriculum", "NoCurriculum", "PhaseSpec", "Verdict", "curriculum_for", "parse_phases"]


@dataclasses.dataclass
class Verdict:
    """How a phase ended: `next_phase` (the new index) to go on, else the run ends DONE (ok) or FAILED."""

    ended: str
    ok: bool
    message: str
    next_phase: Optional[int] = None


class Curriculum:
    """The phase layer the loop calls: which command an attempt runs, when to stop it, what its end means."""

    def __init__(self, specs: List[PhaseSpec], saved: Optional[Dict[str, Any]], checkpoint_signal: signal.Signals,
                 grace: float, clock: Clock, emit: Callable[..., None]) -> None:
        self.specs = specs
        self.checkpoint_signal = checkpoint_signal
        self.grace = grace
        self.clock = clock
        self.emit = emit
        self.index = 0
        self.history: List[Dict[str, Any]] = []  # the phases that ended, in order
        self.values: Dict[str, Any] = {}  # the newest value of each metric seen in the current phase
        self.started_at: Optional[float] = None
        self.start_step: Optional[int] = None
        self.stop: Optional[ChildStop] = None  # the target was reached and the child asked to stop (stop.py)
        self.status = "pending"  # of the current phase: pending, running, ending, then its end's (last phase)
        self.attempt_step: Optional[int] = None  # the step seen in the current attempt (targets use only it)
        if saved:
            self._load(saved)

    @property
    def spec(self) -> PhaseSpec:
        return self.specs[self.index]

    def _load(self, saved: Dict[str, Any]) -> None:
        """The phase a relaunch resumes in: found by name (the run file may have been edited with --resume)."""
        names = [s.name for s in self.specs]
        name = saved.get("name")
        if name not in names:
            raise UsageError("the run was in phase %r, which its [[phase]] tables no longer have (%s)"
                             % (name, ", ".join(names)),
                             hint="restore that phase in the run file, or start a new run under another --name")
        self.index = names.index(name)
        self.history = [h for h in saved.get("history") or [] if isinstance(h, dict)]
        metrics = saved.get("metrics")
        self.values = dict(metrics) if isinstance(metrics, dict) else {}
        self.started_at = saved.get("started_at")
        self.start_step = saved.get("start_step")
        self.status = str(saved.get("status") or "pending")
        if self.status == "ending":  # an agent that adopts the child it had asked to stop: a fresh grace to end
            now = self.clock.monotonic()
            self.stop = ChildStop(now, now + self.grace)

    # ---- what the loop calls ----------------------------------------------------------------------------
    def attempt(self, command: List[str], resume_args: List[str], resume_from: Optional[str]
                ) -> Tuple[List[str], List[str], Dict[str, str]]:
        """An attempt starts in the current phase: its command, resume args and ONBOX_PHASE* environment."""
        spec = self.spec
        self.stop, self.attempt_step, self.status = None, None, "running"
        if self.started_at is None:
            self.started_at = self.clock.time()
            self.emit("phase_started", phase=spec.name, index=self.index, count=len(self.specs),
                      target_steps=spec.target_step, resume_from=resume_from, start_step=self.start_step)
        else:
            self.emit("phase_resumed", phase=spec.name, index=self.index, resume_from=resume_from)
        argv = list(spec.command) if spec.command else list(command) + list(spec.args)
        resume = list(spec.resume_args) if spec.resume_args is not None else list(resume_args)
        return argv, resume, spec.child_env(self.index, len(self.specs), self.start_step)

    def on_progress(self, fields: Mapping[str, Any]) -> None:
        """A record of the trainer's progress in the attempt under way (the loop's feed has parsed it)."""
        self.values.update(fields)
        if isinstance(fields.get("step"), (int, float)):
            self.attempt_step = int(fields["step"])

    def signal_due(self, now: float) -> Optional[signal.Signals]:
        """The signal to send the running child now: the checkpoint signal once its step reached the phase's
        target, SIGKILL when it is still there a grace later; else None."""
        if self.stop is not None:  # a phase end keeps no reserve: its final commit follows the exit
            if self.stop.due(now) == StopStage.KILLED:
                self.emit("phase_end_escalated", phase=self.spec.name, signal="SIGKILL", grace=self.grace)
                return signal.SIGKILL
            return None
        target = self.spec.target_step
        if target is None or self.attempt_step is None or self.attempt_step < target:
            return None
        self.stop, self.status = ChildStop(now, now + self.grace), "ending"
        self.emit("phase_target_reached", phase=self.spec.name, step=self.attempt_step, target_steps=target)
        return self.checkpoint_signal

    def after_exit(self, failed: bool) -> Optional[Verdict]:
        """The child ended. None when this is no end of the phase (it failed on its own: the restart policy
        decides, in the same phase); else how the phase ended and what comes next."""
        if failed and self.stop is None:
            return None
        spec, n = self.spec, len(self.specs)
        checks = [c.check(self.values) for c in spec.criteria]
        ok = all(c["ok"] for c in checks)
        step = self.attempt_step if self.attempt_step is not None else self.values.get("step")
        label = "phase %d/%d %r" % (self.index + 1, n, spec.name)
        how = ("reached its target step %s (ended at step %s)" % (spec.target_step, step) if self.stop is not None
               else "ended (its command exited 0 at step %s)" % step)
        record = {"name": spec.name, "started_at": self.started_at, "ended_at": self.clock.time(), "end_step": step,
                  "criteria": checks, "metrics": dict(self.values),
                  "status": "completed" if ok else "criteria_failed"}
        if not ok and spec.on_fail == "fail":
            record["status"] = self.status = "failed"
            self.history.append(record)
            message = "%s %s but its criteria failed: %s" % (label, how, "; ".join(c["why"] for c in checks
                                                                                   if not c["ok"]))
            self.emit("phase_failed", phase=spec.name, step=step, criteria=checks, reason=message)
            return Verdict(spec.name, False, message)
        self.history.append(record)
        failed_note = "" if ok else " (criteria failed, on_fail = continue: %s)" % "; ".join(
            c["why"] for c in checks if not c["ok"])
        self.emit("phase_completed", phase=spec.name, index=self.index, step=step, criteria=checks,
                  criteria_ok=ok, metrics=dict(self.values))
        if self.index + 1 >= n:
            self.status = "completed" if ok else "criteria_failed"
            return Verdict(spec.name, True, "%s %s: the curriculum is complete%s" % (label, how, failed_note))
        self.index += 1
        self.values, self.started_at, self.start_step, self.stop, self.status = {}, None, step, None, "pending"
        return Verdict(spec.name, True, "%s %s%s; starting phase %d/%d %r from its final checkpoint" % (
            label, how, failed_note, self.index + 1, n, self.spec.name), next_phase=self.index)

    def state_fields(self) -> Dict[str, Any]:
        """What the phase adds to state.json."""
        return {"phase": self.to_state()}

    def to_state(self) -> Dict[str, Any]:
        """state.json's `phase`: what a relaunch resumes from, and what status and training_status.md show."""
        spec = self.spec
        return json_safe({"name": spec.name, "index": self.index, "count": len(self.specs), "target_steps": spec.target_step,
                "target_tokens": spec.target_tokens, "step": self.values.get("step"), "start_step": self.start_step,
                "started_at": self.started_at, "status": self.status,
                "criteria": [c.text for c in spec.criteria], "metrics": dict(self.values),
                "names": [s.name for s in self.specs], "history": list(self.history)})


class NoCurriculum:
    """A run without [[phase]] tables: every attempt runs the run's own command, nothing ends a phase."""

    def attempt(self, command: List[str], resume_args: List[str], resume_from: Optional[str]
                ) -> Tuple[List[str], List[str], Dict[str, str]]:
        return command, resume_args, {}

    def on_progress(self, fields: Mapping[str, Any]) -> None:
        return None

    def signal_due(self, now: float) -> Optional[signal.Signals]:
        return None

    def after_exit(self, failed: bool) -> Optional[Verdict]:
        return None

    def state_fields(self) -> Dict[str, Any]:
        return {}


def curriculum_for(cfg: RunConfig, saved: Optional[Dict[str, Any]], clock: Clock,
                   emit: Callable[..., None]) -> Curriculum | NoCurriculum:
    """The run's Curriculum, or a NoCurriculum for a run without [[phase]] tables."""
    if not cfg.phases:
        return NoCurriculum()
    return Curriculum(parse_phases(cfg.phases), saved if isinstance(saved, dict) else None,
                      parse_signal(cfg.checkpoint_signal, "checkpoint_signal"), grace_for(cfg.grace, None), clock,
                      emit)
