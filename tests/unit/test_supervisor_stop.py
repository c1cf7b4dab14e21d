"""The one stop procedure (onbox/supervisor/stop.py): the stages of a child's stop against a FakeClock, the grace
a notice gets, and the same timeline driven by the loop for `onbox stop` through the fake process seam."""
from __future__ import annotations

import os
import signal

import pytest

from onbox import fsutil
from onbox.clock import FakeClock
from onbox.supervisor.loop import RunState
from onbox.supervisor.stop import DEFAULT_GRACE, STOP_TRANSITIONS, ChildStop, StopStage, grace_for
from tests.unit.test_supervisor_loop import dies_on, exits_after, make


def stages_until(stop: ChildStop, clock: FakeClock, until: float, step: float = 0.5):
    """Advance the clock in steps, as the loop does; (seconds since the stop began, stage) for each stage entered."""
    t0, out = clock.monotonic(), []
    while clock.monotonic() - t0 < until:
        clock.sleep(step)
        stage = stop.due(clock.monotonic())
        if stage is not None:
            out.append((clock.monotonic() - t0, stage))
    return out


def test_every_stage_has_documented_transitions():
    doc = StopStage.__doc__ or ""
    for stage, targets in STOP_TRANSITIONS.items():
        assert stage.value.upper() in doc
        assert all(t.value.upper() in doc for t in targets)
    assert STOP_TRANSITIONS[StopStage.EXITED] == ()


def test_a_notice_stop_commits_at_the_reserve_mark_then_kills_at_the_deadline():
    clock = FakeClock()
    stop = ChildStop(clock.monotonic(), clock.monotonic() + 30.0, reserve=10.0)
    assert stop.reserve_mark == clock.monotonic() + 20.0
    assert stages_until(stop, clock, 40.0) == [(20.0, StopStage.RESERVE), (30.0, StopStage.KILLED)]
    assert stop.stages == [StopStage.ASKED, StopStage.RESERVE, StopStage.KILLED]


def test_the_reserve_is_never_more_than_half_the_grace():
    clock = FakeClock()
    stop = ChildStop(clock.monotonic(), clock.monotonic() + 4.0, reserve=10.0)
    assert stages_until(stop, clock, 5.0) == [(2.0, StopStage.RESERVE), (4.0, StopStage.KILLED)]


def test_a_stop_without_a_reserve_only_kills_at_the_deadline():
    clock = FakeClock()
    stop = ChildStop(clock.monotonic(), clock.monotonic() + 30.0)  # a phase end
    assert stop.reserve_mark is None
    assert stages_until(stop, clock, 40.0) == [(30.0, StopStage.KILLED)]


def test_a_loop_that_wakes_after_the_deadline_kills_without_the_reserve_stage():
    clock = FakeClock()
    stop = ChildStop(clock.monotonic(), clock.monotonic() + 5.0, reserve=10.0)
    assert stages_until(stop, clock, 10.0, step=10.0) == [(10.0, StopStage.KILLED)]
    assert stop.exited(clock.monotonic()) is True  # no commit ran yet: the exit's commit runs, however late


def test_each_stage_is_entered_once():
    clock = FakeClock()
    stop = ChildStop(clock.monotonic(), clock.monotonic() + 1.0, reserve=0.2)
    clock.sleep(5.0)
    assert stop.due(clock.monotonic()) == StopStage.KILLED
    assert stop.due(clock.monotonic()) is None and stop.due(clock.monotonic() + 100) is None


def test_the_exit_commits_again_only_while_time_is_left_after_the_reserve_commit():
    clock = FakeClock()
    early = ChildStop(clock.monotonic(), clock.monotonic() + 30.0, reserve=10.0)
    stages_until(early, clock, 25.0)
    assert early.exited(clock.monotonic()) is True  # saved after the mark, 5 s left: commit what it saved
    late = ChildStop(clock.monotonic(), clock.monotonic() + 30.0, reserve=10.0)
    stages_until(late, clock, 31.0)
    assert late.exited(clock.monotonic()) is False  # committed at the mark, no time left
    assert late.stage == StopStage.EXITED


def test_the_exit_before_any_stage_commits_once():
    clock = FakeClock()
    stop = ChildStop(clock.monotonic(), clock.monotonic() + 30.0, reserve=10.0)
    assert stop.exited(clock.monotonic() + 3.0) is True
    with pytest.raises(RuntimeError, match=r"allowed from exited: none \(the stop is over\)"):
        stop.exited(clock.monotonic() + 4.0)


@pytest.mark.parametrize("configured, lead, grace", [
    (None, None, DEFAULT_GRACE),  # nothing said: the default
    (None, 120.0, 120.0),  # the notice's own lead (an AWS spot notice)
    (60.0, 5.0, 5.0),  # --grace never outlasts what the notice leaves (Slurm KillWait)
    (10.0, 120.0, 10.0),
    (10.0, None, 10.0),
])
def test_the_grace_is_the_configured_one_but_never_past_the_notices_lead(configured, lead, grace):
    assert grace_for(configured, lead) == grace


def test_onbox_stop_goes_through_the_same_timeline_and_ends_stopped(tmp_path):
    sup, procs, ckpts, clock = make(tmp_path, [dies_on(signal.SIGKILL)], checkpoint_signal="USR2", grace=30.0,
                                    sync_reserve=10.0)
    original_sleep = clock.sleep

    def sleep_and_stop(seconds: float) -> None:
        original_sleep(seconds)
        if sup.state == RunState.RUNNING and not os.path.exists(sup.rd.stop_request):
            fsutil.atomic_write_json(sup.rd.stop_request, {"grace": None})

    sup.waiter = sleep_and_stop
    assert sup.run() == RunState.STOPPED
    (t0, first), *rest = procs.signals
    assert first == signal.SIGUSR2
    assert [(round(t - t0, 1), s) for t, s in rest] == [(20.0, signal.SIGTERM), (30.0, signal.SIGKILL)]
    assert [round(at - t0, 1) for at, _ in ckpts.finals] == [20.0]
    assert sup.message == "stopped on request" and not os.path.exists(sup.rd.stop_request)
    assert sup.last_exit["classification"] == "stopped"


def test_a_stop_during_a_backoff_commits_once_without_a_new_attempt(tmp_path):
    sup, procs, ckpts, clock = make(tmp_path, [exits_after(1, 1), exits_after(1, 0)], backoff_initial=60.0)
    original_sleep = clock.sleep

    def sleep_and_stop(seconds: float) -> None:
        original_sleep(min(seconds, 5.0))
        if sup.state == RunState.BACKOFF:
            fsutil.atomic_write_json(sup.rd.stop_request, {"grace": 3})

    sup.waiter = sleep_and_stop
    assert sup.run() == RunState.STOPPED
    assert len(procs.spawned) == 1 and len(ckpts.finals) == 1 and procs.signals == []
