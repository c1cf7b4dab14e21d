"""Spares checked ahead (controller/keeper/spares.py): while a run's box is silent and its beats not yet late, the
spare its recovery would take is checked, nothing claimed or launched; the recovery that follows takes that answer
instead of checking again; a box that answers again leaves the spare untouched but for the check; an answer that
went stale is not used; a blind keeper prepares nothing; two runs in doubt prepare two spares."""
from __future__ import annotations

import threading
from typing import List

from controller.keeper.decide import Beats
from controller.keeper.loop import Keeper
from controller.keeper.records import KeepState, RecordStore
from controller.keeper.spares import PREPARED_FRESH
from onbox.clock import FakeClock
from tests.polling import wait_for
from tests.unit.test_keeper import FakeWorld, alive
from tests.unit.test_keeper_sight import LATE, silent
from tests.unit.test_keeper_wave import BOUND, wave

OK = Beats(liveness="ok", state="running")


def fleet(tmp_path, runs=2, spares=2, answers=None):
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    inv = wave(store, runs, spares)
    beats = {"r%d" % i: OK for i in range(runs)}
    script = {"b%d" % i: [alive("b%d" % i, "r%d" % i)] for i in range(runs)}
    script.update({"b0": [silent("b0", "r0")]} if answers is None else answers)
    world = FakeWorld(clock, script, inv, beats=beats)
    checked: List[str] = []
    lock = threading.Lock()

    def spare_problem(name, rec):
        with lock:
            checked.append("%s:%s" % (name, rec.run))
        return None

    world.spare_problem.side_effect = spare_problem
    keeper = Keeper(store, world, clock=clock, suspect_timeout=0.2)
    return clock, store, world, keeper, checked, beats


def test_a_silent_box_s_spare_is_checked_ahead_and_its_recovery_takes_that_answer(tmp_path):
    clock, store, world, k, checked, beats = fleet(tmp_path)
    try:
        k.tick(wait=0.2)  # b0 silent, its beats still fresh: in doubt, not lost
        wait_for(lambda: checked == ["s0:r0"], BOUND, "s0 checked ahead for r0")
        _, keep = store.load("r0")
        assert keep.state != KeepState.RECOVERING and keep.boxes == ["b0"]
        assert not world.launch.called and not world.push.called and not k.recoverer._claims  # nothing claimed
        clock.advance(5.0)
        beats["r0"] = LATE
        k.tick(wait=0.2)
        wait_for(lambda: world.launch.called, BOUND, "r0 relaunched on s0")
        assert [b.name for b in world.launch.call_args.args[1]] == ["s0"]
        assert checked == ["s0:r0"]  # the answer checked ahead was taken: not checked a second time
        assert store.load("r1")[1].boxes == ["b1"]
    finally:
        k.close()


def test_a_box_that_answers_again_leaves_the_prepared_spare_untouched(tmp_path):
    """The false positive beside it: b0 silent one pass, alive the next: no recovery, no launch, no push, no claim,
    the spare asked its questions only."""
    clock, store, world, k, checked, _beats = fleet(tmp_path, answers={"b0": [silent("b0", "r0"), alive("b0", "r0")]})
    try:
        k.tick(wait=0.2)
        wait_for(lambda: checked == ["s0:r0"], BOUND, "s0 checked ahead for r0")
        for _ in range(3):
            clock.advance(5.0)
            k.tick(wait=0.2)
        _, keep = store.load("r0")
        assert keep.state == KeepState.WATCHING and keep.boxes == ["b0"] and keep.recoveries == 0
        assert not world.launch.called and not world.push.called and not world.provision.called
        assert not k.recoverer._claims and checked == ["s0:r0"]  # asked once, while b0 was silent
    finally:
        k.close()


def test_a_stale_answer_is_not_used_the_spare_is_checked_again(tmp_path):
    clock, _store, world, k, checked, beats = fleet(tmp_path)
    try:
        k.tick(wait=0.2)
        wait_for(lambda: checked == ["s0:r0"], BOUND, "s0 checked ahead for r0")
        world.answers["b0"] = [alive("b0", "r0")]  # b0 answers for a while: nothing is prepared meanwhile
        clock.advance(5.0)
        k.tick(wait=0.2)
        clock.advance(PREPARED_FRESH + 1.0)
        world.answers["b0"] = [silent("b0", "r0")]
        beats["r0"] = LATE
        k.tick(wait=0.2)  # silent and late: lost at once (armed: watched for --lost-after)
        wait_for(lambda: world.launch.called, BOUND, "r0 relaunched on s0")
        assert checked[0] == "s0:r0" and checked.count("s0:r0") == 2  # the stale answer was not taken
    finally:
        k.close()


def test_a_blind_keeper_prepares_nothing(tmp_path):
    """Every box silent, no tracker beyond this machine: the keeper cannot see, so it neither recovers nor checks a
    spare ahead (the spares are asked as witnesses only: that is World.observe, not a spare's check)."""
    answers = {"b%d" % i: [silent("b%d" % i, "r%d" % i)] for i in range(4)}
    answers.update({"s%d" % i: [silent("s%d" % i, "")] for i in range(2)})
    clock, store, world, k, checked, _beats = fleet(tmp_path, runs=4, answers=answers)
    try:
        for _ in range(2):
            k.tick(wait=0.2)
            clock.advance(5.0)
        assert all(store.load("r%d" % i)[1].blind_since for i in range(4))
        assert checked == [] and not world.launch.called
    finally:
        k.close()


def test_two_runs_in_doubt_prepare_two_spares_and_each_recovery_takes_its_own(tmp_path):
    answers = {"b0": [silent("b0", "r0")], "b1": [silent("b1", "r1")]}
    clock, store, world, k, checked, beats = fleet(tmp_path, runs=4, answers=answers)
    try:
        k.tick(wait=0.2)
        wait_for(lambda: len(checked) == 2, BOUND, "two spares checked ahead")
        assert sorted(checked) == ["s0:r0", "s1:r1"]
        clock.advance(5.0)
        beats["r0"] = beats["r1"] = LATE
        k.tick(wait=0.2)
        wait_for(lambda: world.launch.call_count == 2, BOUND, "both runs relaunched")
        assert sorted(checked) == ["s0:r0", "s1:r1"]  # each took the answer made for it
        assert {store.load("r0")[1].boxes[0], store.load("r1")[1].boxes[0]} == {"s0", "s1"}
    finally:
        k.close()


def test_a_probe_out_past_the_suspect_timeout_while_the_beats_are_fresh_prepares_too(tmp_path):
    """A wave's boxes whose beats turn late last: their probe hangs while their beats are still fresh (the run is in
    no doubt yet, its probe not taken); the spare is checked ahead all the same, and nothing is claimed."""
    release = threading.Event()
    clock, store, world, k, checked, _beats = fleet(tmp_path, answers={"b0": [alive("b0", "r0")]})
    observe = world.observe

    def hangs(box, run):
        if box == "b0":
            release.wait(BOUND)
        return observe(box, run)

    world.observe = hangs
    k.probes._observe = hangs
    try:
        k.tick(wait=0.2)  # b0's probe waited for 0.2 s: out, in no doubt
        assert checked == [] and k.probes.out("b0", "r0")
        clock.advance(1.0)
        k.tick(wait=0.2)  # out for longer than --suspect-timeout now
        wait_for(lambda: checked == ["s0:r0"], BOUND, "s0 checked ahead for r0")
        assert store.load("r0")[1].state == KeepState.WATCHING and not world.launch.called
        assert not k.recoverer._claims
    finally:
        release.set()
        k.close()


def test_idle_spares_of_a_watched_pool_are_warmed_once_and_said(tmp_path):
    """Each idle spare of a watched run's pool is warmed once per keeper (World.warm pushes onbox.pyz only where there
    is none): never a watched run's own box, never a box of another pool; a warming that pushed is said."""
    from controller.boxes.inventory import Box

    clock, _store, world, k, checked, _beats = fleet(tmp_path, runs=2, spares=2, answers={})
    world.inventory["o0"] = Box(name="o0", host="10.0.2.1", pool="h100")
    world.warm.side_effect = lambda name, rec: name == "s1"  # s0 had onbox.pyz already
    said: List[dict] = []
    k.say = said.append
    try:
        for _ in range(3):
            k.tick(wait=0.2)
            clock.advance(5.0)
        wait_for(lambda: world.warm.call_count == 2 and all(f.done() for _, f in k._warming), BOUND,
                 "both spares warmed")
        k.tick(wait=0.2)
        assert sorted(c.args[0] for c in world.warm.call_args_list) == ["s0", "s1"]  # once each, spares only
        assert [e["text"] for e in said if e["kind"] == "spare_warmed"] == [
            "pushed onbox.pyz to idle spare s1 (it had none): a recovery there will not wait for it"]
        assert not world.launch.called and not checked
    finally:
        k.close()


def test_keep_once_and_a_blind_keeper_warm_nothing(tmp_path):
    _clock, _store, world, k, _checked, _beats = fleet(tmp_path, runs=2, spares=2, answers={})
    k.tick()  # `keep --once`: nothing may go on after the pass
    answers = {"b%d" % i: [silent("b%d" % i, "r%d" % i)] for i in range(4)}
    answers.update({"s%d" % i: [silent("s%d" % i, "")] for i in range(2)})
    clock2, store2, world2, blind, _, _ = fleet(tmp_path / "blind", runs=4, answers=answers)
    try:
        for _ in range(2):
            blind.tick(wait=0.2)
            clock2.advance(5.0)
        assert all(store2.load("r%d" % i)[1].blind_since for i in range(4))
        assert not world.warm.called and not world2.warm.called
    finally:
        k.close()
        blind.close()


def test_spares_whose_warming_hangs_never_delay_a_check_ahead(tmp_path):
    """Every warming hangs (dead spares at the keeper's start, each waiting out its ssh timeouts); a pass later a
    box goes silent: its spare is still checked ahead at once, the warmings being in a pool of their own."""
    release = threading.Event()
    clock, store, world, k, checked, beats = fleet(tmp_path, runs=2, spares=20, answers={})
    world.warm.side_effect = lambda name, rec: release.wait(BOUND)
    try:
        k.tick(wait=0.2)  # every box answers: the 20 spares' warmings start, and hang
        wait_for(lambda: world.warm.call_count >= 1, BOUND, "the warmings under way")
        world.answers["b0"] = [silent("b0", "r0")]
        clock.advance(5.0)
        k.tick(wait=0.2)
        wait_for(lambda: checked == ["s0:r0"], BOUND / 2, "s0 checked ahead while every warming hangs")
    finally:
        release.set()
        k.close()
