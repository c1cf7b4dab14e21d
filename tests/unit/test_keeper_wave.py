"""A wave of lost boxes (issue 31, part 3), on scripted boxes: every box is asked at once, a box whose probe hangs
never delays another run's judgement, and the recoveries of several runs go on at once, each with its own record
and phases, a spare handed out to one of them only. Concurrency is shown by barriers the scripted boxes wait on
together (bounded: a keeper that asks one box at a time breaks them), never by timing."""
from __future__ import annotations

import threading
from typing import List

from controller.boxes.inventory import Box
from controller.keeper.decide import Beats
from controller.keeper.loop import Keeper
from controller.keeper.records import KeepState, RecordStore
from onbox.clock import FakeClock
from tests.polling import wait_for
from tests.unit.test_keeper import FakeWorld, alive, ended
from tests.unit.test_keeper_sight import LATE, record, silent

BOUND = 20.0  # seconds a barrier waits for its parties: a keeper that does one thing at a time never fills it


def wave(store: RecordStore, runs: int, spares: int):
    inv = {}
    for i in range(runs):
        record(store, "r%d" % i, ["b%d" % i], lost_after=0.0, tries=1)
        inv["b%d" % i] = Box(name="b%d" % i, host="10.0.0.%d" % (i + 1), pool="a100")
    for i in range(spares):
        inv["s%d" % i] = Box(name="s%d" % i, host="10.0.1.%d" % (i + 1), pool="a100")
    return inv


class Hangs(FakeWorld):
    """b0's probe hangs until `release` is set (bounded)."""

    def __init__(self, release: threading.Event, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = release

    def observe(self, box, run):
        if box == "b0":
            self.release.wait(BOUND)
        return super().observe(box, run)


def test_every_box_is_asked_at_once(tmp_path):
    store = RecordStore(str(tmp_path))
    inv = wave(store, 6, 0)
    together = threading.Barrier(6, timeout=BOUND)

    class Together(FakeWorld):
        def observe(self, box, run):
            if box.startswith("b"):
                together.wait()  # every run's box is being asked at the same time
            return super().observe(box, run)

    world = Together(FakeClock(), {"b%d" % i: [alive("b%d" % i, "r%d" % i)] for i in range(6)}, inv)
    Keeper(store, world, clock=FakeClock()).tick()
    assert sorted(world.observed) == ["b%d" % i for i in range(6)]
    assert all(store.load("r%d" % i)[1].last_ok for i in range(6))


def test_a_box_whose_probe_hangs_never_delays_another_runs_judgement(tmp_path):
    """b0's probe hangs; b1's run was preempted. The pass waits for the probes a bounded time, judges r1 (relaunched
    on its box) while b0's probe is still out, and takes b0's answer in a later pass, stamped with when it was
    asked."""
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    inv = wave(store, 2, 0)
    release = threading.Event()

    world = Hangs(release, clock, {"b0": [alive("b0", "r0")], "b1": [ended("preempted", "b1", "r1")]}, inv)
    k = Keeper(store, world, clock=clock, suspect_timeout=0.2)
    try:
        k.tick(wait=0.2)  # the probes waited for 0.2 s, the recoveries not at all: they go on in their threads
        wait_for(lambda: world.launch.called, BOUND, "r1's relaunch while b0's probe hangs")
        assert [b.name for b in world.launch.call_args.args[1]] == ["b1"]  # r1 judged and relaunched meanwhile
        assert store.load("r0")[1].last_ok is None  # r0: still being asked
        assert k.probes.out("b0", "r0")
        clock.advance(5.0)
        k.tick(wait=0.2)  # b0 is in no doubt (its beats unknown, never failed): it is waited for, not silent
        assert store.load("r0")[1].state == KeepState.WATCHING
    finally:
        release.set()
    k.probes.wait([("b0", "r0")], BOUND)
    clock.advance(5.0)
    k.tick()
    _, keep = store.load("r0")
    assert keep.state == KeepState.WATCHING and keep.last_ok == 1010.0


def test_recoveries_go_on_at_once_and_a_spare_is_handed_out_to_one_run_only(tmp_path):
    """Four runs lost at once, three spares (and one more run than spares): the four recoveries check spares at the
    same time, each spare is checked by one of them and taken by one run; the fourth run finds none."""
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    inv = wave(store, 4, 3)
    checking = threading.Barrier(3, timeout=BOUND)
    checked: List[str] = []
    lock = threading.Lock()

    def spare_problem(name, rec):
        with lock:
            checked.append(name)
        checking.wait()  # three recoveries check their spare at the same time
        return None

    world = FakeWorld(clock, {"b%d" % i: [silent("b%d" % i, "r%d" % i)] for i in range(4)}, inv,
                      beats={"r%d" % i: LATE for i in range(4)})
    world.spare_problem.side_effect = spare_problem
    Keeper(store, world, clock=clock).tick()
    assert sorted(checked) == ["s0", "s1", "s2"]  # each spare checked once: claimed before it is checked
    homes = [store.load("r%d" % i)[1] for i in range(4)]
    placed = sorted(k.boxes[0] for k in homes if k.state == KeepState.WATCHING)
    assert placed == ["s0", "s1", "s2"] and world.launch.call_count == 3
    [left] = [k for k in homes if k.state != KeepState.WATCHING]
    assert left.state == KeepState.FAILED_NO_RESOURCE and left.boxes[0].startswith("b")
    for k in homes:  # each its own record and phases
        last = k.current
        assert last is not None and last.phases["detected"] == 1000.0 and last.from_boxes == [k.run.replace("r", "b")]


def test_a_healthy_fleet_beside_one_lost_box_recovers_it_alone(tmp_path):
    """Beside the wave: one box of five gone, the others training: one recovery, the others untouched."""
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    inv = wave(store, 5, 2)
    answers = {"b%d" % i: [alive("b%d" % i, "r%d" % i)] for i in range(1, 5)}
    answers["b0"] = [silent("b0", "r0")]
    beats = {"r%d" % i: Beats(liveness="ok") for i in range(1, 5)}
    beats["r0"] = LATE
    world = FakeWorld(clock, answers, inv, spares={"s0": None, "s1": None}, beats=beats)
    Keeper(store, world, clock=clock).tick()
    assert world.launch.call_count == 1 and store.load("r0")[1].boxes == ["s0"]
    assert [store.load("r%d" % i)[1].boxes for i in range(1, 5)] == [["b1"], ["b2"], ["b3"], ["b4"]]


def test_a_box_in_doubt_whose_probe_is_already_silent_is_not_waited_for_again(tmp_path):
    """b0's probe hangs from one pass into the next; by then its run's beats are late: the probe has been out longer
    than --suspect-timeout, so it reads as silent at once and the pass waits only for the probes that can still
    answer in time (b1's), never again for b0's (with a wave of such boxes, that wait delayed every judgement)."""
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    inv = wave(store, 2, 2)
    release = threading.Event()

    beats = {"r0": Beats(liveness="ok"), "r1": Beats(liveness="ok")}
    world = Hangs(release, clock, {"b0": [alive("b0", "r0")], "b1": [alive("b1", "r1")]}, inv, beats=beats)
    k = Keeper(store, world, clock=clock, suspect_timeout=0.2)
    waited: List[List[tuple]] = []
    wait = k.probes.wait
    k.probes.wait = lambda keys, budget: (waited.append(list(keys)), wait(keys, budget))[1]  # type: ignore
    try:
        k.tick(wait=0.2)  # b0 in no doubt yet: its probe is waited for (0.2 s), and stays out
        assert ("b0", "r0") in waited[0] and k.probes.out("b0", "r0")
        clock.advance(5.0)
        beats["r0"] = LATE
        k.tick(wait=0.2)
        assert ("b0", "r0") not in waited[1] and ("b1", "r1") in waited[1]
        wait_for(lambda: world.launch.called, BOUND, "r0 judged lost at once and relaunched on a spare")
        assert store.load("r1")[1].boxes == ["b1"] and store.load("r1")[1].state == KeepState.WATCHING
    finally:
        release.set()


def test_a_run_declared_lost_is_recovered_while_another_run_is_held_for_its_beats(tmp_path):
    """r0 is lost (beats late, no answer); r1's box is silent too and its beats turn late within --suspect-timeout,
    so the pass holds r1's judgement until then: r0's recovery has begun while r1 is held, not after."""
    started = threading.Event()
    during: List[bool] = []

    class Held(FakeClock):
        def sleep(self, seconds):  # only a held judgement sleeps inside a pass
            during.append(started.wait(BOUND))
            super().sleep(seconds)

    clock = Held(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    inv = wave(store, 2, 2)
    beats = {"r0": LATE, "r1": Beats(liveness="ok", age=9.0, interval=5.0)}  # r1 late 1 s after it is read
    world = FakeWorld(clock, {"b0": [silent("b0", "r0")], "b1": [silent("b1", "r1")]}, inv, beats=beats)
    world.spare_problem.side_effect = lambda name, rec: started.set() if rec.run == "r0" else None
    k = Keeper(store, world, clock=clock, suspect_timeout=3.0)
    k.tick(wait=3.0)
    assert during == [True]  # r0's spare was being checked while r1 was held
    wait_for(lambda: world.launch.call_count == 2, BOUND, "both runs relaunched")
    assert sorted(store.load(r)[1].boxes[0] for r in ("r0", "r1")) == ["s0", "s1"]
