"""The one stop procedure (onbox/supervisor/stop.py): the stages of a child's stop against a FakeClock and the
grace a notice gets; what asks for a stop (signals, notices, stop.request) becoming one notice (notices.py); the
same timeline driven by the loop for `onbox stop`, a backoff and a phase end through the fake process seam."""
from __future__ import annotations

import json
import os
import signal

import pytest

from onbox import fsutil
from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.proc import ExitStatus
from onbox.supervisor.loop import RunState
from onbox.supervisor.notices import NoticeIntake
from onbox.supervisor.preempt import STOP_SIGNAL
from onbox.supervisor.rundir import RunDir
from onbox.supervisor.stop import DEFAULT_GRACE, STOP_TRANSITIONS, ChildStop, StopStage, grace_for
from tests.fakes.supervisor import dies_on, exits_after
from tests.unit.test_supervisor_loop import make


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


class Intake:
    """A NoticeIntake with a FakeClock, recording its events, log lines and what it tells the peers."""

    def __init__(self, tmp_path, grace=None, sigterm_lead=None) -> None:
        self.clock = FakeClock()
        self.events, self.lines, self.peers = [], [], []
        rd = RunDir(str(tmp_path / "run"))
        self.request = rd.stop_request
        cfg = RunConfig(name="run", command=["train"], grace=grace, preempt_signal="USR1").validate()
        self.intake = NoticeIntake(cfg, rd, sigterm_lead, self.clock, lambda kind, **f: self.events.append((kind, f)),
                                   self.lines.append, lambda *notice: self.peers.append(notice))
        os.makedirs(rd.path)

    def signal(self, signum: int) -> None:
        self.intake.on_signal(signum, self.clock.monotonic(), self.clock.time())

    def check(self) -> None:
        self.intake.check_request(self.clock.monotonic(), self.clock.time())

    def grace(self) -> float:
        assert self.intake.notice is not None
        return self.intake.notice.deadline - self.clock.monotonic()


def test_the_first_notice_wins_and_a_later_one_is_recorded_as_ignored(tmp_path):
    t = Intake(tmp_path, grace=12.0)
    t.signal(signal.SIGUSR1)
    t.intake.on_notice(120.0, "aws", "spot", t.clock.monotonic(), t.clock.time())
    assert t.intake.notice is not None and t.intake.notice.source == "signal:SIGUSR1" and t.grace() == 12.0
    assert [k for k, _ in t.events] == ["preemption_notice", "notice_ignored"]
    assert t.events[1][1] == {"source": "aws", "reason": "a stop is already under way"}
    assert t.peers == [("signal:SIGUSR1", "", 12.0)] and not t.intake.by_request


def test_under_slurm_sigterm_gets_no_more_than_killwait(tmp_path):
    t = Intake(tmp_path, grace=60.0, sigterm_lead=5.0)
    t.signal(signal.SIGTERM)
    assert t.grace() == 5.0


def test_a_stop_request_is_a_notice_by_request_with_its_own_grace(tmp_path):
    t = Intake(tmp_path, grace=12.0)
    t.check()
    assert t.intake.notice is None  # no request, no notice
    fsutil.atomic_write_json(t.request, {"grace": 3})
    t.check()
    assert t.intake.by_request and t.intake.notice is not None and t.intake.notice.source == "stop"
    assert t.grace() == 3.0


def test_a_stop_request_with_an_insane_grace_falls_back_to_the_runs_grace_and_says_so(tmp_path):
    t = Intake(tmp_path, grace=12.0)
    fsutil.atomic_write_json(t.request, {"grace": -5})
    t.check()
    assert t.events[0][0] == "stop_grace_ignored" and t.events[0][1]["grace"] == "-5" and t.grace() == 12.0


def test_the_stop_signal_asks_a_stop_without_a_request_file(tmp_path):
    t = Intake(tmp_path)
    t.signal(STOP_SIGNAL)
    assert t.intake.notice is None  # asked: taken at the next check, like a request file
    t.check()
    assert t.intake.by_request and t.grace() == DEFAULT_GRACE and "stop asked by signal" in t.lines


def test_a_dead_metadata_poller_is_said_everywhere(tmp_path):
    t = Intake(tmp_path)
    t.intake._poller_died(RuntimeError("boom"))
    assert t.lines == ["the metadata poller died: RuntimeError('boom'); cloud preemption notices are OFF"]
    kind, fields = t.events[0]
    assert kind == "thread_died" and fields["thread"] == "onbox-metadata" and "USR1" in fields["hint"]


def test_other_signals_are_logged_and_ignored_and_sigchld_silently(tmp_path):
    t = Intake(tmp_path)
    t.signal(signal.SIGHUP)
    t.signal(signal.SIGCHLD)
    assert t.intake.notice is None and t.lines == ["ignoring SIGHUP"] and t.events == []


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


def test_a_phase_end_goes_through_the_same_timeline_without_a_reserve(tmp_path):
    """A phase's target reached: the checkpoint signal; a child that ignores it is killed a grace later (no early
    commit: the phase's final commit follows the exit), and the phase still ends."""
    def steps_and_ignores_term(t: float, sigs):
        if signal.SIGKILL in sigs:
            return ExitStatus(signal=signal.SIGKILL)
        with open(sup.rd.log_path, "a") as f:
            f.write('{"step": %d}\n' % int(t))
        return None

    sup, procs, ckpts, _ = make(tmp_path, [steps_and_ignores_term], grace=7.0, sync_reserve=3.0,
                                phases=[{"name": "only", "target_steps": 5}])
    assert sup.run() == RunState.DONE
    (t0, first), *rest = procs.signals
    assert first == signal.SIGTERM and [(round(t - t0, 1), s) for t, s in rest] == [(7.0, signal.SIGKILL)]
    assert len(ckpts.finals) == 1 and ckpts.finals[0][0] > t0 + 7.0
    with open(sup.rd.events_path) as f:
        events = [json.loads(line) for line in f]
    kinds = [e["type"] for e in events if e["type"] in ("phase_end_escalated", "signal_forwarded")]
    assert kinds == ["signal_forwarded", "phase_end_escalated", "signal_forwarded"]
    assert [e.get("reason") for e in events if e["type"] == "signal_forwarded"] == ["phase end", "phase end"]
