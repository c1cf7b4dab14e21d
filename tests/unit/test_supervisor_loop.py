"""The loop driven by scripted observations: a fake process seam and a FakeClock, so backoff schedules, the
restart cap and the preemption timeline (checkpoint signal, TERM at deadline - reserve, KILL at the deadline)
are checked to the second without waiting for them."""
from __future__ import annotations

import os
import signal
from typing import List, Optional

from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.proc import ExitStatus
from onbox.supervisor.hooks import Hooks, NoReaper, NoTelemetry
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.rundir import RunDir
from tests.fakes.supervisor import Checkpoints, FakeProcs, Script, dies_on, exits_after


def make(tmp_path, scripts: List[Script], **fields):
    clock = FakeClock()
    procs = FakeProcs(clock, scripts)
    ckpts = Checkpoints(clock)
    cfg = RunConfig(name="loop", command=["train"], notice_source="none", tick_interval=1.0, **fields).validate()
    rd = RunDir(str(tmp_path / "loop"))
    os.makedirs(rd.path)
    sup = Supervisor(cfg, rd, proc=procs, clock=clock,  # type: ignore[arg-type]
                     hooks_factory=lambda ctx: Hooks(ckpts, NoTelemetry(), NoReaper()),
                     seams=Seams(oom_reader=lambda: None, environ={}, log=lambda m: None, waiter=clock.sleep))
    return sup, procs, ckpts, clock


def test_backoff_doubles_up_to_the_cap_then_the_restart_limit_fails_the_run(tmp_path):
    sup, procs, _, _ = make(tmp_path, [exits_after(1, 1)] * 5, backoff_initial=1.0, backoff_max=4.0,
                            max_restarts=4, crash_loop_threshold=0)
    assert sup.run() == RunState.FAILED
    starts = [t for t, _ in procs.spawned]
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:])]
    assert gaps == [1 + 1, 1 + 2, 1 + 4, 1 + 4]  # 1 s of running, then 1, 2, 4, 4 (capped) of backoff
    assert "gave up after 4 restart(s)" in sup.message


def test_crash_loop_counts_the_same_class_in_a_row_only(tmp_path):
    scripts = [exits_after(1, 1), exits_after(1, 2), exits_after(1, 2), exits_after(1, 2)]
    sup, procs, _, _ = make(tmp_path, scripts, backoff_initial=0.0, crash_loop_threshold=3, max_restarts=10)
    assert sup.run() == RunState.FAILED
    assert len(procs.spawned) == 4 and "the same failure (failed) 3 times" in sup.message


def test_a_fallback_to_an_older_checkpoint_starts_the_crash_loop_count_again(tmp_path):
    """Each failed attempt is reported to the checkpoints (with how long it ran); when they answer that they
    quarantined the checkpoint the attempt resumed from, the next attempt starts elsewhere: not the same loop."""
    scripts = [exits_after(2, 1)] * 4 + [exits_after(1, 0)]
    sup, procs, ckpts, _ = make(tmp_path, scripts, backoff_initial=0.0, crash_loop_threshold=3, max_restarts=10)
    ckpts.fallbacks = [False, False, True, False]  # the 3rd failure quarantined a checkpoint
    assert sup.run() == RunState.DONE  # without the fallback the 3rd failure in a row would end the run
    assert len(procs.spawned) == 5 and ckpts.failures == [2.0] * 4


def test_without_a_fallback_the_same_failure_is_a_crash_loop(tmp_path):
    sup, procs, ckpts, _ = make(tmp_path, [exits_after(2, 1)] * 4, backoff_initial=0.0, crash_loop_threshold=3,
                                max_restarts=10)
    assert sup.run() == RunState.FAILED
    assert len(procs.spawned) == 3 and ckpts.failures == [2.0] * 3


def test_restart_always_restarts_after_success(tmp_path):
    sup, procs, _, _ = make(tmp_path, [exits_after(1, 0), exits_after(1, 0), exits_after(1, 3)],
                            restart="always", backoff_initial=0.5, max_restarts=2)
    assert sup.run() == RunState.FAILED
    assert len(procs.spawned) == 3 and sup.restarts == 2


def test_preemption_timeline_checkpoint_signal_then_term_at_reserve_then_kill_at_deadline(tmp_path):
    sup, procs, ckpts, clock = make(tmp_path, [dies_on(signal.SIGKILL)], checkpoint_signal="USR2",
                                    grace=30.0, sync_reserve=10.0)
    original_sleep = clock.sleep

    def sleep_and_preempt(seconds: float) -> None:
        original_sleep(seconds)
        if sup.state == RunState.RUNNING and sup.notice is None and clock.monotonic() >= 1005.0:
            sup._on_signal(signal.SIGTERM, None)  # what the real handler does: record only

    sup.waiter = sleep_and_preempt
    assert sup.run() == RunState.PREEMPTED
    (t0, first), *rest = procs.signals
    assert first == signal.SIGUSR2
    assert [(round(t - t0, 1), s) for t, s in rest] == [(20.0, signal.SIGTERM), (30.0, signal.SIGKILL)]
    assert len(ckpts.finals) == 1
    called_at, deadline = ckpts.finals[0]
    assert round(called_at - t0, 1) == 20.0 and round(deadline - t0, 1) == 30.0
    assert sup.last_exit["classification"] == "preempted" and sup.last_exit["signal"] == signal.SIGKILL


def test_notice_during_backoff_ends_preempted_without_a_new_attempt(tmp_path):
    sup, procs, ckpts, clock = make(tmp_path, [exits_after(1, 1), exits_after(1, 0)], backoff_initial=60.0)
    original_sleep = clock.sleep

    def sleep_and_preempt(seconds: float) -> None:
        original_sleep(min(seconds, 5.0))
        if sup.state == RunState.BACKOFF:
            sup._on_signal(signal.SIGUSR1, None)

    sup.waiter = sleep_and_preempt
    assert sup.run() == RunState.PREEMPTED
    assert len(procs.spawned) == 1 and len(ckpts.finals) == 1
    assert sup.state_doc()["preemption"]["source"] == "signal:SIGUSR1"


def test_short_grace_keeps_half_for_the_trainer_and_commits_again_after_it_saved(tmp_path):
    """Slurm's KillWait (5 s) or RunPod (~5 s) is shorter than sync_reserve (10 s): the early commit must not run
    at once, before the trainer saved; and what the trainer saved before exiting is committed after all."""
    def saves_then_exits(t: float, sigs: List[int]) -> Optional[ExitStatus]:
        return ExitStatus(code=0) if sigs and t >= 8.0 else None  # the notice comes at 5 s; saved and out 3 s later

    sup, procs, ckpts, clock = make(tmp_path, [saves_then_exits], grace=4.0, sync_reserve=10.0)
    original_sleep = clock.sleep

    def sleep_and_preempt(seconds: float) -> None:
        original_sleep(min(seconds, 0.5))
        if sup.state == RunState.RUNNING and sup.notice is None and clock.monotonic() >= 1005.0:
            sup._on_signal(signal.SIGTERM, None)

    sup.waiter = sleep_and_preempt
    assert sup.run() == RunState.PREEMPTED
    t0 = procs.signals[0][0]  # the checkpoint signal
    calls = [(round(at - t0, 1), round(deadline - t0, 1)) for at, deadline in ckpts.finals]
    assert calls[0] == (2.0, 4.0)  # half the 4 s grace kept for the trainer, not the whole 10 s reserve
    assert len(calls) == 2 and calls[1][0] < 4.0 and calls[1][1] == 4.0  # again once the child exited in time


def test_a_checkpoint_saved_after_the_reserve_mark_still_gets_a_final_commit_when_time_is_left(tmp_path):
    # grace 30, reserve 10: the final commit runs at +20 s while the child is still saving its on-signal
    # checkpoint (the valuable one); the child exits at +25 s. The 5 s left must go to committing what it just
    # saved, not be thrown away because "the final commit already ran".
    def saves_then_exits(t: float, sigs: List[int]) -> Optional[ExitStatus]:
        return ExitStatus(code=0) if signal.SIGUSR2 in sigs and t >= 1005.0 + 25.0 - 1000.0 else None

    sup, procs, ckpts, clock = make(tmp_path, [saves_then_exits], checkpoint_signal="USR2", grace=30.0,
                                    sync_reserve=10.0)
    original_sleep = clock.sleep

    def sleep_and_preempt(seconds: float) -> None:
        original_sleep(seconds)
        if sup.state == RunState.RUNNING and sup.notice is None and clock.monotonic() >= 1005.0:
            sup._on_signal(signal.SIGTERM, None)

    sup.waiter = sleep_and_preempt
    assert sup.run() == RunState.PREEMPTED
    t0 = procs.signals[0][0]
    assert [round(at - t0) for at, _ in ckpts.finals] == [20, 25]
    assert {round(d - t0) for _, d in ckpts.finals} == {30}
    assert signal.SIGKILL not in [s for _, s in procs.signals]


def test_a_signal_that_lands_during_a_tick_is_acted_on_before_the_rest_of_it(tmp_path):
    """SIGTERM lands while the tick's periodic commit runs: the child is signalled before the tick's beat (the
    first beat of an agent loads the GPU readings: a signal waited ~10 ms for it), and the beat still comes after."""
    order: List[str] = []

    class Beats(NoTelemetry):
        def tick(self, state):
            order.append("beat")

    sup, procs, ckpts, clock = make(tmp_path, [dies_on(signal.SIGTERM)], grace=30.0, sync_reserve=0.0)
    sup.hooks = Hooks(ckpts, Beats(), NoReaper())
    periodic = ckpts.periodic

    def periodic_then_signal() -> None:
        periodic()
        if sup.state == RunState.RUNNING and clock.monotonic() >= 1003.0 and sup.notice is None:
            order.append("signal lands")
            sup._on_signal(signal.SIGTERM, None)

    ckpts.periodic = periodic_then_signal  # type: ignore[method-assign]
    original = procs.signal_group

    def signal_group(pgid, sig):
        order.append("child signalled")
        return original(pgid, sig)

    procs.signal_group = signal_group  # type: ignore[method-assign]
    assert sup.run() == RunState.PREEMPTED
    landed = order.index("signal lands")
    assert order[landed + 1] == "child signalled", order
    assert "beat" in order[landed + 1:], order  # the rest of the tick was done after
