"""A resume that went backwards: onbox restored a checkpoint at step S before the attempt, and the trainer's first
training report is far below S — it ignored ONBOX_RESUME_FROM (a trainer that never loads what it is given), or
loaded something else (an older file of its own, a framework that skips a step dir it did not write). Every step
between is trained again, and nothing else says so: `resume_from_scratch` fires only when nothing was restored.

The check (ResumeCheck), fed the run's events and the trainer's progress records:
- armed by `checkpoint_resume` (the restore, with the restored checkpoint's step) once the attempt it was for starts
  (`state` -> running); an attempt that starts without a restore (from scratch, or the first one) is not judged;
  nor is the first attempt of a new phase of a curriculum (`phase_started`: its command may count its own steps);
- judged on the first record of the attempt that holds a step and a loss (the trainer's first training report: a
  progress bar drawn before training starts, `0/5000`, holds no loss), and only on that one;
- backwards when that step is below half the restored step AND at least MIN_LOST steps below it. A trainer that
  reports the restored step, or the next one, or any step past it, passes; so does a restore with no step known.
  A record that also says an epoch of 1 or more is not judged: its step may count within the epoch (Lightning's
  progress bar `Epoch 4: 1/100`).

The verdict stands for the rest of the attempt (the alert `resume_backwards`, critical), and is said once as the
event of the same name; the next attempt starts without it.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from onbox import vocab

MIN_LOST = 3  # steps below the restored one before a first report counts as backwards (with the half rule)
FRACTION = 0.5  # ... and below this share of it


def went_backwards(first: int, restored: int) -> bool:
    """The first reported step is far below the restored checkpoint's (module docstring)."""
    return first < restored * FRACTION and restored - first >= MIN_LOST


def _int(v: Any) -> Optional[int]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
        return None
    return int(v)


class ResumeCheck:
    """Fed every event (`on_event`) and every progress record (`on_record`), in order; `verdict` is the attempt's
    finding while it stands: {attempt, restored_step, first_step, checkpoint, path}."""

    def __init__(self) -> None:
        self._restored: Optional[Dict[str, Any]] = None  # the restore for the attempt about to start
        self._new_phase = False
        self._armed: Optional[Dict[str, Any]] = None  # the restore of the running attempt, until its first report
        self.verdict: Optional[Dict[str, Any]] = None

    def on_event(self, ev: Mapping[str, Any]) -> None:
        kind = ev.get("type")
        if kind == vocab.EV_CHECKPOINT_RESUME:
            step = _int(ev.get("step"))
            self._restored = None if step is None or step <= 0 else {
                "restored_step": step, "checkpoint": ev.get("checkpoint"), "path": ev.get("path"),
                "source": ev.get("source")}
        elif kind == vocab.EV_PHASE_STARTED:
            self._new_phase = True
        elif kind == vocab.EV_STATE and ev.get("new") == vocab.RUNNING:  # an attempt starts: what was restored for it
            self._armed = None if self._new_phase else self._restored
            self._restored, self._new_phase, self.verdict = None, False, None
            if self._armed is not None:
                self._armed["attempt"] = _attempt(ev.get("reason"))

    def on_record(self, fields: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """One progress record; the verdict when this record makes one (said once), else None."""
        armed = self._armed
        if armed is None:
            return None
        step, loss = _int(fields.get("step")), fields.get("loss")
        if step is None or loss is None:
            return None  # not a training report yet
        self._armed = None  # only the first report is judged
        epoch = fields.get("epoch")
        if isinstance(epoch, (int, float)) and not isinstance(epoch, bool) and epoch >= 1:
            return None
        if not went_backwards(step, armed["restored_step"]):
            return None
        self.verdict = dict(armed, first_step=step)
        return self.verdict


def _attempt(reason: Any) -> Optional[int]:
    """The attempt number from the running transition's reason ("attempt 2 pid 4242")."""
    words = str(reason or "").split()
    if len(words) >= 2 and words[0] == "attempt" and words[1].isdigit():
        return int(words[1])
    return None


def describe(verdict: Mapping[str, Any]) -> str:
    """The alert's message."""
    attempt = verdict.get("attempt")
    return ("%s reported step %s first, far below step %s of the checkpoint onbox restored for it (%s): the trainer "
            "ignored ONBOX_RESUME_FROM or loaded something else, and trains those steps again" % (
                "attempt %s" % attempt if attempt is not None else "the attempt", verdict.get("first_step"),
                verdict.get("restored_step"), verdict.get("checkpoint") or verdict.get("path") or "?"))


HINT = ("make the trainer load the path in $ONBOX_RESUME_FROM (or pass `--resume-arg '--resume={ckpt}'` when it takes "
        "the path as a flag); `onbox checkpoints RUN` lists what was restored and what is committed")
