"""The goodput ledger over timelines recorded from real runs (tests/integration/test_goodput_scenarios.py captured
them: tests/fixtures/goodput/): a preemption mid-interval, a crash loop, a recovery onto a spare, a fenced box, a
Slurm requeue. On each: the parts sum to the wall time, the segments tile it, and the steps kept and trained again
are what the trainer's own trace says (no step of the lineage counted twice); the losses are the lives that ended
short, in order, each with why."""
from __future__ import annotations

import dataclasses

import pytest

from controller.goodput.fold import Fold, fold
from controller.goodput.ledger import CATEGORIES, ledger_of
from tests.goodput_timeline import check_ledger, fixtures, load_fixture

SCENARIOS = ["crash_loop", "fenced_box", "preempted_mid_interval", "recovery_onto_a_spare", "slurm_requeue"]


def test_every_scenario_has_a_recorded_timeline():
    assert set(SCENARIOS) <= set(fixtures())


@pytest.fixture(params=SCENARIOS)
def scenario(request):
    return load_fixture(request.param)


def test_the_parts_sum_to_the_wall_time_and_tile_it(scenario):
    led = ledger_of(fold(scenario["beats"]).contexts, scenario["now"])
    assert sum(led.parts.values()) == pytest.approx(led.wall, abs=1e-9)
    check_ledger(led.to_dict(segments=True))
    for a, b in zip(led.segments, led.segments[1:]):
        assert (a.end == pytest.approx(b.start, abs=1e-9) and (a.category, a.box) != (b.category, b.box)) or \
            a.end != b.start


def test_each_step_is_kept_once_and_the_rest_counted_as_recomputed(scenario):
    led = ledger_of(fold(scenario["beats"]).contexts, scenario["now"])
    truth = scenario["truth"]
    assert led.kept_steps == truth["kept_steps"]
    assert led.recomputed_steps == truth["recomputed_steps"]
    assert sum(x.steps for x in led.losses) == truth["recomputed_steps"]


def test_the_losses_restarts_and_preemptions_are_the_scenarios(scenario):
    led = ledger_of(fold(scenario["beats"]).contexts, scenario["now"])
    expect = scenario["expect"]
    assert [x.why for x in led.losses] == expect["losses"]
    assert (led.restarts, led.preemptions) == (expect["restarts"], expect["preemptions"])
    if "boxes" in expect:
        assert sorted(led.by_box()) == expect["boxes"]
    assert sorted(led.overlap_by_box()) == expect.get("overlap", [])


def test_a_recomputed_interval_is_never_productive_and_lost_work_costs_time(scenario):
    led = ledger_of(fold(scenario["beats"]).contexts, scenario["now"])
    if scenario["truth"]["recomputed_steps"]:
        assert led.parts["recomputed"] > 0
    # the lives that lost steps are charged the recomputed time, on their own box
    for loss in led.losses:
        if loss.steps:
            assert loss.seconds + loss.overlap_s > 0
    assert sum(x.seconds for x in led.losses) <= led.parts["recomputed"] + 1e-3 * len(led.losses)  # ms rounding


def test_folding_beat_by_beat_gives_the_ledger_of_the_whole(scenario):
    # the tracker folds beats as they arrive: the same contexts as a fold of the whole timeline
    f = Fold()
    for b in sorted(scenario["beats"], key=lambda x: x.seq):
        assert f.add(b)
    assert ledger_of(f.contexts, scenario["now"]).to_dict() == ledger_of(fold(scenario["beats"]).contexts,
                                                                         scenario["now"]).to_dict()


def test_a_beat_arriving_out_of_order_is_refused_so_the_run_is_folded_again(scenario):
    beats = sorted(scenario["beats"], key=lambda x: x.seq)
    f = Fold()
    for b in beats[1:]:
        f.add(b)
    assert f.add(beats[0]) is False  # older than the newest: the tracker folds the run again from its first beat
    assert f.add(beats[-1]) is True  # a resend of the newest is fine


def test_a_window_cuts_the_segments_and_keeps_the_sum(scenario):
    led = ledger_of(fold(scenario["beats"]).contexts, scenario["now"])
    mid = led.start + led.wall / 2
    first, second = led.window(until=mid), led.window(since=mid)
    for part in CATEGORIES:
        assert first.parts[part] + second.parts[part] == pytest.approx(led.parts[part], abs=1e-6)
    assert first.wall + second.wall == pytest.approx(led.wall)
    assert sum(first.parts.values()) == pytest.approx(first.wall, abs=1e-9)


def test_thinned_beats_lose_their_details_but_the_sum_holds(scenario):
    # a beat older than a week keeps only its columns (state, step, box): no step time, no stall, no times
    thin = [dataclasses.replace(b, step_time=None, first_point=None, stalled=False, agent_at=None, setup_at=None,
                                child_at=None, durable_step=None, durable_at=None, local_step=None)
            if i % 10 else b for i, b in enumerate(sorted(scenario["beats"], key=lambda x: x.seq))]
    led = ledger_of(fold(thin).contexts, scenario["now"])
    assert sum(led.parts.values()) == pytest.approx(led.wall, abs=1e-9)
    check_ledger(led.to_dict(segments=True))
