"""A resume that went backwards (issue 32, item 6): the heartbeat hook, fed the run's events and the trainer's output
as the supervisor loop feeds it, says at once (the event `resume_backwards` and a critical beat alert) when the
trainer's first training report after a restore is far below the restored checkpoint's step; and never for a
trainer that reports the restored step, the next one, counts within an epoch, reports a bar before training, or
starts after a restore from scratch. The beats go to a real file sink."""
from __future__ import annotations

import json
import os

import pytest

from onbox.clock import FakeClock
from onbox.heartbeat.collect import BoxReaders
from onbox.heartbeat.hook import HeartbeatHook
from onbox.heartbeat.sinks import FileSink
from tests.fakes.recorders import EventRecorder
from tests.fakes.run_context import run_context
from tests.fakes.supervisor import loop_step
from tests.polling import wait_for

STATE = {"run": "r1", "state": "running", "attempt": 1, "child_pid": None, "restarts": 1, "attempts": [],
         "last_exit": None}


class Supervised(EventRecorder):
    """The supervisor's emit: each event recorded, and handed to the telemetry hook as the loop does."""

    hook = None

    def __call__(self, event_type, **fields):
        super().__call__(event_type, **fields)
        if self.hook is not None:
            self.hook.on_event(dict(fields, type=event_type))


def make(tmp_path):
    emit = Supervised()
    ctx = run_context(tmp_path, clock=FakeClock(), durable=None, heartbeat_interval=30.0, emit=emit)
    readers = BoxReaders(gpu=lambda: {"available": False, "reason": "none", "gpus": []}, host=lambda: {},
                         disks=lambda paths: [])
    out = str(tmp_path / "beats.jsonl")
    hook = emit.hook = HeartbeatHook(ctx, readers=readers, sinks=[FileSink(out)], close_timeout=10.0)
    return ctx, hook, out


def beats(path, n):
    """The first `n` beats the sink wrote (its sender thread writes them: polled, bounded)."""
    def read():
        if not os.path.exists(path):
            return None
        with open(path) as f:
            got = [json.loads(x) for x in f]
        return got if len(got) >= n else None
    return wait_for(read, 10, "%d beats in %s" % (n, path), 0.01)


def restored_then_started(hook, step, attempt=1, phase=False):
    """What the supervisor says before an attempt: the restore (its checkpoint's step), then the attempt runs."""
    if step is not None:
        hook.on_event({"type": "checkpoint_resume", "path": "/ck/state_%06d.json" % step,
                       "checkpoint": "state_%06d.json" % step, "step": step, "source": "durable"})
    if phase:
        hook.on_event({"type": "phase_started", "phase": "finetune"})
    hook.on_event({"type": "state", "old": "backoff", "new": "running", "reason": "attempt %d pid 4242" % attempt})


def test_a_trainer_that_starts_far_below_the_restored_step_is_said_at_once(tmp_path):
    ctx, hook, out = make(tmp_path)
    hook.tick(STATE)  # start
    restored_then_started(hook, 400)
    loop_step(hook, '{"step": 1, "loss": 2.31}')  # it ignored ONBOX_RESUME_FROM
    [ev] = ctx.emit.of("resume_backwards")
    assert (ev["restored_step"], ev["first_step"], ev["attempt"], ev["checkpoint"]) == (400, 1, 1,
                                                                                        "state_000400.json")
    hook.tick(STATE)  # the beat goes at once (a new alert), not an interval later
    beat = beats(out, 2)[-1]
    [alert] = [a for a in beat["alerts"] if a["code"] == "resume_backwards"]
    assert alert["severity"] == "critical" and beat["reason"] in ("alert", "event")
    assert "reported step 1 first, far below step 400 of the checkpoint onbox restored" in alert["message"]
    assert "ONBOX_RESUME_FROM" in alert["hint"]
    loop_step(hook, '{"step": 2, "loss": 2.30}', '{"step": 3, "loss": 2.29}')  # said once, stands for the attempt
    assert len(ctx.emit.of("resume_backwards")) == 1
    hook.tick(STATE)
    restored_then_started(hook, None, attempt=2)  # the next attempt starts without it
    hook.tick(dict(STATE, attempt=2))
    assert all(a["code"] != "resume_backwards" for a in beats(out, 3)[-1]["alerts"])
    hook.close(STATE)


@pytest.mark.parametrize("why,step,lines", [
    ("reports the restored step", 400, ['{"step": 400, "loss": 1.0}']),
    ("reports the next step", 400, ['{"step": 401, "loss": 1.0}']),
    ("draws a bar before training (no loss), then resumes", 400, ["  0%|          | 0/5000 [00:00<?, ?it/s]",
                                                                 '{"step": 401, "loss": 1.0}']),
    ("counts its steps within the epoch", 400, ['{"epoch": 4, "step": 1, "loss": 1.0}']),
    ("counts epochs as the checkpoint does", 3, ['{"step": 3, "loss": 1.0}']),
    ("was restored from scratch", None, ['{"step": 1, "loss": 1.0}']),
    ("starts a new phase of a curriculum", 400, ['{"step": 1, "loss": 1.0}']),
])
def test_a_resume_that_went_on_from_the_checkpoint_says_nothing(tmp_path, why, step, lines):
    ctx, hook, out = make(tmp_path)
    hook.tick(STATE)
    restored_then_started(hook, step, phase=why.startswith("starts a new phase"))
    loop_step(hook, *lines)
    loop_step(hook, '{"step": 2, "loss": 1.0}')  # only the first training report is judged
    hook.tick(dict(STATE, state="backoff"))
    assert ctx.emit.of("resume_backwards") == [], why
    assert all(a["code"] != "resume_backwards" for a in beats(out, 2)[-1]["alerts"]), why
    hook.close(STATE)


def test_far_below_means_under_half_and_at_least_three_steps_lost():
    from onbox.telemetry.resumecheck import went_backwards

    assert went_backwards(0, 100) and went_backwards(1, 10) and went_backwards(0, 3)
    assert not went_backwards(60, 100)  # above half: a trainer whose own step count lags its checkpoint's label
    assert not went_backwards(0, 2) and not went_backwards(1, 3)  # two steps: within a step count's unit slack
