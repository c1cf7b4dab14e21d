"""The goodput ledger's rules, one timeline each (a run's beats written out by hand, times in seconds from 0): what
each part is, where a life's time goes when it ends each way, and the healthy runs that must come out whole."""
from __future__ import annotations

import pytest

from controller.goodput.fold import Fold, fold
from controller.goodput.ledger import ledger_of
from controller.goodput.records import Beat, beat_from_doc


class Run:
    """Beats of one run, seq given in order; each life (box, attempt, agent) with its times."""

    def __init__(self) -> None:
        self.beats = []

    def beat(self, t, step=None, state="running", box="b0", attempt=0, agent=0.0, setup=0.0, child=1.0, **kw):
        self.beats.append(Beat(seq=len(self.beats) + 1, time=float(t), box=box, attempt=attempt, state=state,
                               step=step, step_time=float(t) if step is not None else None, agent_at=agent,
                               setup_at=setup, child_at=child, interval=1.0, **kw))
        return self

    def steps(self, t0, t1, s0, **kw):
        """A beat a second from t0 to t1, one step a second from s0."""
        for i, t in enumerate(range(t0, t1 + 1)):
            self.beat(t, s0 + i, **kw)
        return self

    def ledger(self, now=None):
        led = ledger_of(fold(self.beats).contexts, now)
        assert sum(led.parts.values()) == pytest.approx(led.wall, abs=1e-9)
        return led


def parts(led):
    return {k: round(v, 6) for k, v in led.parts.items() if v}


def test_a_healthy_run_is_all_productive_after_its_start_and_loses_nothing():
    led = Run().beat(1).steps(2, 100, 1, durable_step=None).beat(101, 100, state="done").ledger()
    assert parts(led) == {"restoring": 1.0, "starting": 1.0, "productive": 99.0}
    assert led.losses == [] and led.recomputed_steps == 0 and led.kept_steps == 100 and led.restarts == 0
    assert led.goodput == pytest.approx(99 / 101)


def test_a_live_run_counts_its_step_in_progress_and_a_silent_one_goes_down():
    run = Run().beat(1).steps(2, 50, 1)
    live = run.ledger(now=52.0)  # the last beat 2 s ago: 2 intervals, it trains
    assert live.live and live.end == 52.0 and parts(live)["productive"] == 50.0
    silent = run.ledger(now=80.0)  # 30 intervals without a beat: lost, down since its last beat
    assert not silent.live and parts(silent)["down"] == 30.0 and [x.why for x in silent.losses] == ["lost"]


def test_a_crash_loses_the_steps_since_the_checkpoint_it_resumes_from():
    run = Run().beat(1).steps(2, 30, 1, durable_step=20, durable_at=21.0)
    run.beat(31, 30, state="backoff", durable_step=20)  # the child crashed at step 30 (t 31)
    run.steps(36, 60, 21, attempt=1, setup=34.0, child=35.0, durable_step=20)  # resumed from 20 after a 3 s backoff
    led = run.ledger(now=60.0)
    assert led.recomputed_steps == 10 and led.kept_steps == 45  # steps 21-30 twice, each counted once
    assert [(x.why, x.steps) for x in led.losses] == [("crashed", 10)]
    # 21..30 trained from t 21 to 31 the first time: recomputed; the backoff is down, the new setup restoring
    assert parts(led) == {"restoring": 2.0, "starting": 2.0, "productive": 43.0, "recomputed": 10.0, "down": 3.0}


def test_a_restart_from_scratch_makes_every_earlier_step_recomputed():
    run = Run().beat(1).steps(2, 20, 1).beat(21, 20, state="backoff")
    run.steps(23, 30, 1, attempt=1, setup=22.0, child=22.5)  # no checkpoint: it starts over at step 1
    led = run.ledger(now=30.0)
    assert led.recomputed_steps == 8 and led.kept_steps == 20  # 1..20 trained, 1..8 again
    assert led.losses[0].steps == 8


def test_a_resume_from_an_older_checkpoint_loses_what_the_newer_lives_did_too():
    # life 1 resumes from 40 and trains to 60; life 2 falls back to 30 (the 40 checkpoint was corrupt)
    run = Run().beat(1).steps(2, 51, 1).beat(52, 50, state="backoff", durable_step=40)
    run.steps(55, 74, 41, attempt=1, setup=53.0, child=54.0).beat(75, 60, state="backoff", attempt=1, setup=53.0,
                                                                   child=54.0)
    run.steps(78, 100, 31, attempt=2, setup=76.0, child=77.0, durable_step=30)
    led = run.ledger(now=100.0)
    # 31..50 of life 0 and 41..53 of life 1 were trained again; 54..60 of life 1 are still the lineage's
    assert led.kept_steps == 60 and [x.steps for x in led.losses] == [20, 13]


def test_a_stall_alert_makes_the_stretch_without_steps_stalled_not_training():
    run = Run().beat(1).steps(2, 10, 1)
    for t in range(11, 41):  # no step for 30 s; the agent's stall alert from t 31
        run.beat(t, 9, stalled=t >= 31)
    run.steps(41, 50, 10)
    led = run.ledger(now=50.0)
    assert parts(led)["stalled"] == pytest.approx(30.0)  # from the last step (t 10) to the last alert (t 40)
    assert led.recomputed_steps == 0


def test_a_pause_without_the_stall_alert_is_training_time():
    # an eval (output, no step) that the agent does not call a stall: the time goes to the next step, productive
    run = Run().beat(1).steps(2, 10, 1)
    for t in range(11, 41):
        run.beat(t, 9)
    run.steps(41, 50, 10)
    assert "stalled" not in parts(run.ledger(now=50.0))


def test_a_preemption_notice_is_down_from_the_notice_and_the_step_in_flight_is_lost():
    run = Run().beat(1).steps(2, 20, 1, durable_step=10).beat(20.5, 19, state="stopping", durable_step=10)
    run.beat(21.5, 19, state="preempted", durable_step=19)  # checkpointed its newest step on the notice
    run.steps(25, 40, 20, attempt=1, setup=23.0, child=24.0, durable_step=19)
    led = run.ledger(now=40.0)
    assert [(x.why, x.steps) for x in led.losses] == [("preempted", 0)] and led.preemptions == 1
    assert parts(led)["recomputed"] == pytest.approx(0.5)  # t 20 (its last step) to the notice at 20.5
    assert parts(led)["down"] == pytest.approx(2.5)  # the notice to the next setup: the stop, the requeue


def test_a_trainer_that_trains_through_its_grace_keeps_those_steps_in_training():
    run = Run().beat(1).steps(2, 10, 1).beat(10.5, 10, state="stopping")
    run.beat(11, 11, state="stopping").beat(12, 12, state="stopping").beat(12.5, 12, state="preempted")
    run.steps(15, 20, 11, attempt=1, setup=13.0, child=14.0, durable_step=10)  # resumed from 10: 11, 12 lost
    led = run.ledger(now=20.0)
    assert led.losses[0].steps == 2 and parts(led)["recomputed"] == pytest.approx(1.5)  # t 10.5-12: 11 and 12


def test_a_clean_stop_and_a_done_run_end_productive():
    stopped = Run().beat(1).steps(2, 10, 1).beat(10.5, 10, state="stopping").beat(12, 10, state="stopped").ledger()
    assert "down" not in parts(stopped) and stopped.losses == [] and stopped.end == 12.0


def test_a_run_that_failed_for_good_loses_the_steps_past_its_final_durable_checkpoint():
    led = Run().beat(1).steps(2, 30, 1, durable_step=20).beat(31, 30, state="failed", durable_step=20).ledger()
    assert led.kept_steps == 20 and led.recomputed_steps == 10 and [x.why for x in led.losses] == ["failed"]


def test_overlapping_lives_count_the_older_ones_time_apart():
    # b0 is cut off at t 20 but trains on to t 40 (its spooled beats arrive after the heal: lower seqs, later times);
    # s0 takes over from the checkpoint at 15 at t 25
    run = Run().beat(1).steps(2, 40, 1, durable_step=15).beat(41, 40, state="fenced")
    run.steps(27, 60, 16, box="s0", agent=24.0, setup=24.0, child=26.0, durable_step=15)
    led = run.ledger(now=60.0)
    assert led.overlap_by_box() == {"b0": pytest.approx(41.0 - 24.0)}  # b0's time after s0's setup began
    assert led.wall == pytest.approx(60.0) and led.kept_steps == 15 + 34
    assert [(x.why, x.box, x.steps) for x in led.losses] == [("fenced", "b0", 25)]
    assert led.losses[0].overlap_s > 0


def test_down_time_is_charged_to_the_box_the_run_went_on_on():
    run = Run().beat(1).steps(2, 20, 1, durable_step=20).beat(21, 20, state="preempted", durable_step=20)
    run.steps(32, 40, 21, box="s0", agent=30.0, setup=30.0, child=31.0, durable_step=20)
    led = run.ledger(now=40.0)
    assert led.by_box()["s0"]["down"] == pytest.approx(9.0) and led.by_box()["b0"]["down"] == 0


def test_a_run_that_reports_no_step_is_taken_as_productive_while_its_trainer_runs():
    led = Run().beat(1).beat(10).beat(20).beat(21, state="done").ledger()
    assert not led.steps_known and parts(led) == {"restoring": 1.0, "productive": 20.0}


def test_an_older_agent_without_times_has_no_restoring_and_starts_at_its_first_beat():
    run = Run()
    for t in range(10, 20):
        run.beats.append(Beat(seq=t, time=float(t), box="b0", attempt=0, state="running", step=t - 9,
                              step_time=float(t)))
    led = ledger_of(fold(run.beats).contexts, 19.0)
    assert led.start == 10.0 and "restoring" not in parts(led)


def test_each_phase_counts_its_own_steps():
    run = Run().beat(1).steps(2, 10, 1, phase=0)
    run.steps(11, 20, 1, phase=1)  # the next phase of a curriculum starts its step count again
    led = run.ledger(now=20.0)
    assert led.recomputed_steps == 0 and led.kept_steps == 9 + 10


def test_a_resume_message_is_not_a_trained_step():
    run = Run().beat(1).steps(2, 20, 1, durable_step=20).beat(21, 20, state="preempted", durable_step=20)
    run.beat(24, 20, attempt=1, setup=22.0, child=23.0, durable_step=20)  # "resumed from step 20"
    run.steps(25, 30, 21, attempt=1, setup=22.0, child=23.0, durable_step=20)
    led = run.ledger(now=30.0)
    assert led.recomputed_steps == 0 and led.kept_steps == 26


def test_a_long_life_keeps_every_sample_since_its_checkpoint_and_thins_the_rest():
    f = Fold(max_samples=400)
    for t in range(1, 1001):
        f.add(Beat(seq=t, time=float(t), box="b0", attempt=0, state="running", step=t, step_time=float(t),
                   durable_step=900, child_at=0.5))
    c = f.contexts[0]
    assert len(c.samples) <= 400 and [s[1] for s in c.samples if s[1] > 900] == list(range(901, 1001))
    led = ledger_of(f.contexts, 1000.0)
    assert led.kept_steps == 1000 and sum(led.parts.values()) == pytest.approx(led.wall)


@pytest.mark.parametrize("doc", [None, [], {}, {"seq": 1}, {"seq": -1, "time": 1, "attempt": 0, "state": "x"},
                                 {"seq": 1, "time": float("nan"), "attempt": 0, "state": "x"},
                                 {"seq": True, "time": 1, "attempt": 0, "state": "x"},
                                 {"seq": 1, "time": 1e400, "attempt": 0, "state": "x"}])
def test_a_document_that_is_no_beat_is_none_never_an_error(doc):
    assert beat_from_doc(doc) is None


def test_odd_fields_of_a_beat_are_read_as_unknown():
    b = beat_from_doc({"seq": 5, "time": 10.0, "attempt": 0, "state": "Running", "box": "b",
                       "progress": {"step": "lots", "time": True}, "checkpoint": {"latest_durable": "a-path"},
                       "times": {"setup_at": 10 ** 400, "child_started_at": "soon"}, "alerts": [{"code": "stall"}],
                       "points": {"time": [1.0, "x"], "step": [None, 3]}, "phase": {"index": -1}})
    assert (b.step, b.step_time, b.durable_step, b.setup_at, b.child_at, b.phase) == (None,) * 6
    assert b.state == "running" and b.stalled and b.first_point is None


def test_a_ledger_carried_to_a_later_now_is_the_one_computed_then():
    live = Run().beat(1).steps(2, 50, 1)
    waiting = Run().beat(1).steps(2, 20, 1, durable_step=20).beat(21, 20, state="preempted", durable_step=20)
    done = Run().beat(1).steps(2, 20, 1).beat(21, 20, state="done")
    for run, later in ((live, 53.0), (waiting, 90.0), (done, 500.0)):
        then = ledger_of(fold(run.beats).contexts, 51.0 if run is live else 30.0)
        assert then.at(later).to_dict() == ledger_of(fold(run.beats).contexts, later).to_dict()
    assert ledger_of(fold(live.beats).contexts, 51.0).at(80.0) is None  # it fell silent meanwhile: compute again


def test_an_ended_life_keeps_few_samples_but_every_step():
    run = Run().beat(1).steps(2, 2000, 1, durable_step=1990).beat(2001, 2000, state="backoff", durable_step=1990)
    run.steps(2004, 2010, 1991, attempt=1, setup=2002.0, child=2003.0, durable_step=1990)
    f = fold(run.beats)
    assert len(f.contexts[0].samples) <= 128 and f.contexts[0].thinned > 1800
    led = ledger_of(f.contexts, 2010.0)
    assert led.kept_steps == 2000 and led.recomputed_steps == 7  # 1991-1997 trained twice
    assert led.parts["recomputed"] == pytest.approx(7.0)  # the stretch past the durable step is exact


def test_no_beats_is_an_empty_ledger():
    led = ledger_of([], 5.0)
    assert led.wall == 0 and led.segments == [] and led.goodput is None


def test_work_at_risk_counts_from_the_checkpoints_step_time_as_onboxctl_status_does():
    """The checkpoint of step 20 was reported at t 21 and committed at t 50 (a sync interval later): a loss at t 60
    costs the training since t 21, not since the commit; an older agent's beat without the step time keeps the
    commit time."""
    led = Run().beat(1).steps(2, 60, 1, durable_step=20, durable_at=50.0, durable_step_time=21.0).ledger(now=60.0)
    assert (led.at_risk_steps, led.at_risk_s) == (39, 39.0)
    old = Run().beat(1).steps(2, 60, 1, durable_step=20, durable_at=50.0).ledger(now=60.0)
    assert (old.at_risk_steps, old.at_risk_s) == (39, 10.0)
