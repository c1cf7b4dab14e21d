"""The supervisor meets a fence (a newer lease holds the run), driven through the fake process seam and a
FakeClock: the trainer is stopped within half a sync interval, nothing more is committed, and the run ends in the
terminal state `fenced` (exit 1, last_exit fenced naming where the run continues), whatever it was doing."""
from __future__ import annotations

import signal
from typing import Any, Dict, Optional

from onbox.supervisor.loop import RunState, exit_code_for
from onbox.supervisor.state import TRANSITIONS
from tests.unit.test_supervisor_loop import Checkpoints, dies_on, exits_after, make

FENCE = {"run": "loop", "epoch": 1, "holder": "gpu1-aaaa-1111", "newer_epoch": 2, "newer_holder": "gpu2-bbbb-2222",
         "host": "gpu2", "refused": "lease check"}


class FencedAt(Checkpoints):
    """Checkpoints whose lease is fenced from monotonic time `at` on (or at the first restore)."""

    def __init__(self, clock: Any, at: float = float("inf"), at_restore: bool = False) -> None:
        super().__init__(clock)
        self.at = at
        self.at_restore = at_restore
        self.restores = 0

    def restore(self) -> Optional[str]:
        self.restores += 1
        if self.at_restore:
            self.at = self.clock.monotonic()
        return None

    def fenced(self) -> Optional[Dict[str, Any]]:
        return dict(FENCE) if self.clock.monotonic() >= self.at else None


def fenced_run(tmp_path, scripts, at=None, at_restore=False, **fields):
    sup, procs, _, clock = make(tmp_path, scripts, sync_interval=4.0, **fields)
    ckpts = FencedAt(clock, at=clock.monotonic() + at if at is not None else float("inf"), at_restore=at_restore)
    sup.hooks.checkpoints = ckpts
    return sup, procs, ckpts, clock


def test_a_fence_stops_the_trainer_within_half_a_sync_interval_and_ends_fenced(tmp_path):
    sup, procs, _ckpts, clock = fenced_run(tmp_path, [dies_on(signal.SIGKILL)], at=10.0)  # ignores TERM
    t0 = clock.monotonic()
    assert sup.run() == RunState.FENCED
    sent = [(round(t - t0, 3), sig) for t, sig in procs.signals]
    assert sent[0][1] == signal.SIGTERM and 10.0 <= sent[0][0] <= 11.0  # seen within a tick (1 s here)
    assert sent[-1][1] == signal.SIGKILL and sent[-1][0] - sent[0][0] <= 2.0 + 1e-6  # the grace: sync_interval / 2
    last = sup.last_exit or {}
    assert last["classification"] == "fenced" and "gpu2-bbbb-2222 (gpu2)" in last["hint"]
    assert last["hint"] == "the run continues on gpu2-bbbb-2222 (gpu2); nothing to do on this box"
    assert exit_code_for(sup.state) == 1 and sup.message.startswith("fenced: the run continues on")
    assert sup.state_doc()["fenced"]["newer_epoch"] == 2


def test_a_trainer_that_exits_on_term_is_recorded_as_fenced_not_preempted(tmp_path):
    sup, procs, _ckpts, _ = fenced_run(tmp_path, [dies_on(signal.SIGTERM)], at=3.0)
    assert sup.run() == RunState.FENCED
    assert [sig for _, sig in procs.signals] == [signal.SIGTERM]
    assert sup.last_exit["classification"] == "fenced" and "Signal 15" in sup.last_exit["message"]


def test_a_fence_at_the_first_restore_starts_no_attempt(tmp_path):
    sup, procs, ckpts, _ = fenced_run(tmp_path, [exits_after(5, 0)], at_restore=True)
    assert sup.run() == RunState.FENCED
    assert procs.spawned == [] and ckpts.restores == 1
    assert sup.last_exit["classification"] == "fenced" and "no child was running" in sup.last_exit["message"]


def test_a_fence_during_a_backoff_ends_fenced_without_another_attempt(tmp_path):
    sup, procs, _ckpts, _ = fenced_run(tmp_path, [exits_after(1, 1), exits_after(100, 0)], at=3.0,
                                      backoff_initial=60.0, crash_loop_threshold=0)
    assert sup.run() == RunState.FENCED
    assert len(procs.spawned) == 1 and sup.last_exit["classification"] == "fenced"


def test_a_fence_during_a_preemption_stop_ends_fenced_not_preempted(tmp_path):
    """A preempted run ends 75 and may be requeued: a fenced one must not, whatever stop came first."""
    sup, procs, _ckpts, clock = fenced_run(tmp_path, [dies_on(signal.SIGKILL)], at=2.5, grace=30.0)
    t0 = clock.monotonic()
    sup.intake.on_notice(30.0, "aws", "spot", t0 + 1.0, clock.time())
    assert sup.run() == RunState.FENCED
    assert sup.last_exit["classification"] == "fenced"
    killed = [t - t0 for t, sig in procs.signals if sig == signal.SIGKILL]
    assert killed and killed[0] <= 2.5 + 1.0 + 2.0 + 1e-6  # brought forward from the notice's 30 s


def test_the_final_commit_runs_once_and_waits_for_the_commit_in_flight(tmp_path):
    """Nothing new is committed after a fence (the hook refuses it), but the commit in flight is waited for: it
    ends refused at its next lease check, or as a race-window orphan the new holder quarantines."""
    sup, _procs, ckpts, _ = fenced_run(tmp_path, [dies_on(signal.SIGTERM)], at=3.0)
    sup.run()
    assert len(ckpts.finals) == 1


def test_fenced_is_terminal_and_reached_from_starting_running_and_stopping_only():
    reach = {s for s, targets in TRANSITIONS.items() if RunState.FENCED in targets}
    assert reach == {RunState.STARTING, RunState.RUNNING, RunState.STOPPING} and RunState.FENCED.terminal


def test_a_fenced_slurm_job_is_never_requeued():
    from onbox.slurm.job import SlurmJob, requeue_decision

    job = SlurmJob(job_id="42")
    ok, why = requeue_decision(job, "fenced", "SIGUSR1", "USR1")
    assert not ok and "fenced" in why


def test_a_fenced_node_0_tells_its_peers_to_stop_as_any_stop_does(tmp_path):
    sup, _procs, _ckpts, _clock = fenced_run(tmp_path, [dies_on(signal.SIGTERM)], at=2.0)
    told = []
    sup.intake.tell_peers = lambda source, detail, lead: told.append((source, detail, lead))
    assert sup.run() == RunState.FENCED
    [(source, detail, lead)] = told
    assert source == "fenced" and "gpu2-bbbb-2222" in detail and 0 < lead <= 2.0
