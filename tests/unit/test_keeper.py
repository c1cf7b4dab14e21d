"""The keeper driven by scripted observations (the elastic agent's style: `side_effect` lists of what each box
answers) and a FakeClock: the decision table, --lost-after to the second, the recovery's phases in order, the
backoff of failed tries, failed_no_resource, groups, and a keeper "killed" at every step and started again that
finishes the same recovery with one launch. No ssh, no sleep: the world is a FakeWorld, the records real files."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional
from unittest import mock

import pytest

from controller.boxes.inventory import Box
from controller.keeper.decide import Beats, Observation, Verdict, first_new_step, judge, judge_box
from controller.keeper.lock import KeeperLock
from controller.keeper.loop import Keeper
from controller.keeper.policy import LaunchRecord, RecoveryPolicy
from controller.keeper.provision import ProvisionFailed
from controller.keeper.records import PHASES, KeepState, RecordStore
from controller.launch.start import LaunchResult
from onbox.clock import FakeClock
from onbox.errors import UsageError


# -- what a box can answer ---------------------------------------------------------------------------------------
def alive(box="gpu1", run="gpt", step=100, t=50.0, started=10.0, durable=80):
    return Observation(box, run, reached=True, known=True, state="running", agent_alive=True, step=step,
                       step_time=t, attempt_started=started, durable_step=durable, durable_at=40.0)


def ended(state, box="gpu1", run="gpt", fenced=False):
    return Observation(box, run, reached=True, known=True, state=state, agent_alive=False, fenced=fenced,
                       step=90, step_time=30.0, attempt_started=10.0, durable_step=80)


def down(box="gpu1", run="gpt"):
    return Observation(box, run, reached=False, error="cannot reach box %s: Connection refused" % box)


def unknown(box, run="gpt"):
    return Observation(box, run, reached=True, known=False)


NONE = Beats()  # no tracker
OK = Beats(liveness="ok", state="running")
LATE = Beats(liveness="late", state="running")


# -- the decision table --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("obs, beats, since, now, verdict", [
    (alive(), NONE, None, 0, Verdict.HEALTHY),
    (alive(), LATE, 0, 999, Verdict.HEALTHY),  # a box that answers is never lost, whatever the beats
    (ended("done"), NONE, None, 0, Verdict.ENDED),
    (ended("stopped"), NONE, None, 0, Verdict.ENDED),
    (ended("failed"), NONE, None, 0, Verdict.ENDED),
    (ended("failed", fenced=True), NONE, None, 0, Verdict.ENDED),
    (ended("fenced"), NONE, None, 0, Verdict.ENDED),
    (ended("preempted"), NONE, None, 0, Verdict.RELAUNCH_HERE),
    (ended("running"), NONE, None, 0, Verdict.RELAUNCH_HERE),  # agent SIGKILLed: relaunch re-adopts the child
    (unknown("gpu1"), NONE, None, 0, Verdict.RELAUNCH_HERE),
    (Observation("gpu1", "gpt", reached=True, known=True, problem="state.json is corrupt"), NONE, None, 0,
     Verdict.WAIT),
    (down(), OK, 0, 999, Verdict.SUSPECT),  # ssh fails but beats arrive: not lost
    (down(), LATE, None, 0, Verdict.SUSPECT),
    (down(), LATE, 0, 14.9, Verdict.SUSPECT),
    (down(), LATE, 0, 15.0, Verdict.LOST),
    (down(), NONE, 0, 15.0, Verdict.LOST),  # no tracker: ssh alone decides
    (down(), Beats(liveness="ended", state="preempted"), 0, 15.0, Verdict.LOST),  # preempted, then the box went
])
def test_the_decision_table(obs, beats, since, now, verdict):
    assert judge_box(obs, beats, since, now, lost_after=15.0).verdict == verdict


def test_a_group_is_judged_as_one():
    b = [NONE, NONE]
    assert judge([alive("b0", "g"), down("b1", "g.node1")], b, 0, 20, 15).verdict == Verdict.LOST
    assert judge([alive("b0", "g"), down("b1", "g.node1")], b, 0, 5, 15).verdict == Verdict.SUSPECT
    # node 1 preempted, node 0 still stopping: the nodes stop together, nothing to do yet
    assert judge([alive("b0", "g"), ended("preempted", "b1", "g.node1")], b, None, 0, 15).verdict == Verdict.HEALTHY
    both = judge([ended("preempted", "b0", "g"), ended("preempted", "b1", "g.node1")], b, None, 0, 15)
    assert both.verdict == Verdict.RELAUNCH_HERE
    assert judge([ended("done", "b0", "g"), ended("failed", "b1", "g.node1")], b, None, 0, 15).verdict == Verdict.ENDED


def test_the_first_new_step_is_one_of_the_newest_attempt():
    assert first_new_step(alive(step=7, t=50.0, started=10.0)) == 7
    assert first_new_step(alive(step=7, t=5.0, started=10.0)) is None  # the old attempt's progress.json
    assert first_new_step(down()) is None


# -- a scripted world ----------------------------------------------------------------------------------------------
class FakeWorld:
    """What each box answers, as a script per box (the last answer repeats); spares' health, provision results and
    launch results as side_effect lists; every push and launch recorded."""

    tracker = None

    def __init__(self, clock: FakeClock, answers: Dict[str, List[Any]], boxes: Dict[str, Box],
                 spares: Optional[Dict[str, Optional[str]]] = None, provision: Optional[List[Any]] = None,
                 launches: Optional[List[Any]] = None, beats: Optional[Dict[str, Beats]] = None) -> None:
        self.clock = clock
        self.answers = {k: list(v) for k, v in answers.items()}
        self.inventory = dict(boxes)
        self.spare_problem = mock.Mock(side_effect=lambda name, rec: (spares or {}).get(name))
        self.provision = mock.Mock(side_effect=provision or [])
        self.launch = mock.Mock(side_effect=launches or self._launch_ok)
        self.push = mock.Mock()
        self.warm = mock.Mock(return_value=False)  # an idle spare warmed (World.warm): it had onbox.pyz already
        self._beats = beats or {}
        self.observed: List[str] = []

    def _launch_ok(self, rec, boxes, take_over):
        for b in boxes:  # the launched run answers alive from now on
            self.answers[b.name] = [alive(b.name, rec.run, step=None, t=None)]
        return [LaunchResult(box=b.name, name=rec.run, ok=True, state="running") for b in boxes]

    def observe(self, box, run):
        self.observed.append(box)
        script = self.answers.get(box) or [unknown(box, run)]  # an idle box: it answers, and has no such run
        answer = script.pop(0) if len(script) > 1 else script[0]
        return dataclass_replace(answer, box=box, run=run)

    def beats(self, runs):
        return self._beats

    def box(self, name):
        return self.inventory.get(name) or Box(name=name, host=name, in_inventory=False)

    def boxes(self):
        return dict(self.inventory)

    def add_box(self, box):
        self.inventory[box.name] = box


def dataclass_replace(obs, **kw):
    import dataclasses

    return dataclasses.replace(obs, **kw)


def policy(**kw):
    d = dict(pool="a100", lost_after=15.0, backoff=10.0, backoff_max=100.0, tries=3)
    d.update(kw)
    return RecoveryPolicy(**d)


def record(store, run="gpt", boxes=("gpu1",), nodes=False, **kw):
    rec = LaunchRecord(run=run, boxes=list(boxes), command=["python", "train.py"], policy=policy(**kw), nodes=nodes,
                       onbox_args=["--durable", "/d"], durable="/d", heartbeat_interval=5.0, timeout=20.0)
    store.save_launch(rec)
    return rec


INV = {"gpu1": Box(name="gpu1", host="10.0.0.1"), "spare-a": Box(name="spare-a", host="10.0.0.2", pool="a100"),
       "spare-b": Box(name="spare-b", host="10.0.0.3", pool="a100"), "other": Box(name="other", host="h", pool="h100")}


@pytest.fixture
def store(tmp_path):
    return RecordStore(str(tmp_path))


def keeper(store, world, clock):
    events: List[Dict[str, Any]] = []
    k = Keeper(store, world, clock=clock, say=events.append)
    k.events = events  # type: ignore[attr-defined]
    return k


def kinds(k):
    return [e["kind"] for e in k.events]


# -- watching ------------------------------------------------------------------------------------------------------
def test_lost_after_is_counted_from_the_first_failed_probe_and_a_box_that_answers_clears_it(store):
    clock = FakeClock(start_wall=1000.0)
    record(store)
    world = FakeWorld(clock, {"gpu1": [alive(), down(), down(), alive(), down(), down(), down(), down()]}, INV,
                      spares={"spare-a": None})
    k = keeper(store, world, clock)
    states = []
    for _ in range(8):
        k.tick()
        states.append(store.load("gpt")[1].state.value)
        clock.advance(5.0)
    # probes at t=0 ok, 5 down (suspect since 5), 10 down (5 s), 15 ok (cleared), 20 down (since 20), 25, 30,
    # 35: 15 s of failed probes -> lost, recovered on the spare in the same pass
    assert states == ["watching", "suspect", "suspect", "watching", "suspect", "suspect", "suspect", "watching"]
    _, keep = store.load("gpt")
    assert keep.boxes == ["spare-a"] and keep.recoveries == 1
    cur = keep.current
    assert cur.phases["detected"] == 1020.0 and cur.phases["declared_lost"] == 1035.0
    assert [p for p in PHASES if p in cur.phases] == ["detected", "declared_lost", "box_chosen", "pushed",
                                                      "relaunched"]
    assert world.launch.call_args.kwargs["take_over"] is True
    assert kinds(k)[:4] == ["suspect", "suspect_cleared", "suspect", "detected"]


@pytest.mark.parametrize("hang, passes, declared", [(20.0, 1, 1020.0), (8.0, 2, 1018.0)])
def test_a_probe_that_hangs_counts_from_when_it_was_sent(store, hang, passes, declared):
    """A dead box's probe waits out its timeout: the box was failing from the moment it was asked. A first probe
    that hangs for --lost-after (15 s) declares it lost in that pass; a shorter one makes it suspect from the
    probe's start, and the pass after 15 s of that declares it lost; either way detected at the first probe's
    start."""
    clock = FakeClock(start_wall=1000.0)
    record(store, lost_after=15.0)

    class Hanging(FakeWorld):
        def observe(self, box, run):
            if box == "gpu1":
                clock.advance(hang)  # the probe's timeout, then it fails
            return super().observe(box, run)

    world = Hanging(clock, {"gpu1": [down()]}, INV, spares={"spare-a": None})
    k = keeper(store, world, clock)
    states = []
    for _ in range(passes):
        k.tick()
        states.append(store.load("gpt")[1].state.value)
        clock.advance(2.0)
    assert states == ["suspect"] * (passes - 1) + ["watching"], states  # recovered on the spare in the last pass
    _, keep = store.load("gpt")
    assert keep.boxes == ["spare-a"] and keep.recoveries == 1
    assert keep.current.phases["detected"] == 1000.0 and keep.current.phases["declared_lost"] == declared


def test_the_beats_are_read_again_after_a_probe_that_failed(store):
    """The beats read before a probe that waited out its 20 s timeout are 20 s old: they said "ok" when the box was
    alive; read again after the failed probe they are late, and the box is lost in that pass."""
    clock = FakeClock(start_wall=1000.0)
    record(store, lost_after=15.0)
    answers = [{"gpt": OK}, {"gpt": LATE}]

    class Hanging(FakeWorld):
        def observe(self, box, run):
            if box == "gpu1":
                clock.advance(20.0)
            return super().observe(box, run)

        def beats(self, runs):
            return answers.pop(0) if len(answers) > 1 else answers[0]

    world = Hanging(clock, {"gpu1": [down()]}, INV, spares={"spare-a": None})
    k = keeper(store, world, clock)
    k.tick()
    _, keep = store.load("gpt")
    assert keep.boxes == ["spare-a"] and keep.recoveries == 1 and "beats are late" in keep.current.reason


def test_a_box_whose_beats_arrive_is_never_declared_lost(store):
    clock = FakeClock()
    record(store)
    world = FakeWorld(clock, {"gpu1": [down()]}, INV, beats={"gpt": OK})
    k = keeper(store, world, clock)
    for _ in range(20):
        k.tick()
        clock.advance(10.0)
    assert store.load("gpt")[1].state == KeepState.SUSPECT and not world.launch.called


def test_preempted_with_the_box_up_is_relaunched_there_and_no_spare_is_looked_at(store):
    clock = FakeClock()
    record(store)
    world = FakeWorld(clock, {"gpu1": [alive(), ended("preempted")]}, INV)
    k = keeper(store, world, clock)
    k.tick()
    clock.advance(5)
    k.tick()
    assert world.launch.call_count == 1
    args = world.launch.call_args
    assert [b.name for b in args.args[1]] == ["gpu1"] and args.kwargs["take_over"] is False
    assert not world.spare_problem.called and not world.push.called  # the box has the run and its pyz
    _, keep = store.load("gpt")
    assert keep.state == KeepState.WATCHING and keep.boxes == ["gpu1"] and keep.recoveries == 1
    assert "declared_lost" not in keep.current.phases
    # the relaunched run trains: its first new step closes the recovery
    world.answers["gpu1"] = [alive(step=81, t=99.0, started=90.0)]
    clock.advance(5)
    k.tick()
    _, keep = store.load("gpt")
    assert keep.current is None and keep.history[-1].first_step == 81 and "first_new_step" in keep.history[-1].phases
    assert kinds(k) == ["detected", "box_chosen", "pushed", "relaunched", "first_new_step"]


def test_a_preempted_box_that_goes_away_before_its_relaunch_is_recovered_elsewhere_once_lost(store):
    clock = FakeClock()
    record(store)  # lost after 15 s
    world = FakeWorld(clock, {"gpu1": [ended("preempted"), down()]}, INV, spares={"spare-a": None})
    k = keeper(store, world, clock)
    for _ in range(6):
        k.tick()
        clock.advance(5)
    assert world.launch.call_count == 1 and [b.name for b in world.launch.call_args.args[1]] == ["spare-a"]
    _, keep = store.load("gpt")
    assert keep.boxes == ["spare-a"] and keep.recoveries == 1 and keep.history[0].kind == "same_box"
    assert "box_failed" in kinds(k) and "relaunched" not in keep.history[0].phases


def test_a_run_that_ended_is_left_alone(store):
    clock = FakeClock()
    record(store)
    world = FakeWorld(clock, {"gpu1": [ended("done")]}, INV)
    k = keeper(store, world, clock)
    k.tick()
    k.tick()
    assert store.load("gpt")[1].state == KeepState.ENDED and world.observed == ["gpu1"]  # not asked again


# -- choosing a box ------------------------------------------------------------------------------------------------
def test_the_first_healthy_idle_spare_of_the_pool_by_name_and_the_skipped_ones_said(store):
    clock = FakeClock()
    record(store, lost_after=0.0)
    inv = dict(INV, **{"spare-0": Box(name="spare-0", host="h0", pool="a100")})
    world = FakeWorld(clock, {"gpu1": [down()]}, inv,
                      spares={"spare-0": "fails `onbox audit`: /ckpt is not writable", "spare-a": None})
    k = keeper(store, world, clock)
    k.tick()
    _, keep = store.load("gpt")
    assert keep.boxes == ["spare-a"]
    assert [c.args[0] for c in world.spare_problem.call_args_list] == ["spare-0", "spare-a"]  # "other": pool h100
    skipped = [e for e in k.events if e["kind"] == "spare_skipped"]
    assert skipped and "fails `onbox audit`" in skipped[0]["text"]
    assert world.push.call_args.args[0].name == "spare-a"


def test_no_spare_and_a_failing_provision_backs_off_then_ends_failed_no_resource(store):
    clock = FakeClock(start_wall=0.0)
    record(store, lost_after=0.0, provision=["./new-box.sh"], tries=3, backoff=10.0)
    fails = [ProvisionFailed("the provision command ./new-box.sh exited 1: out of capacity"),
             ProvisionFailed("the provision command ./new-box.sh printed 'hello' as its last line"),
             ProvisionFailed("the provision command ./new-box.sh did not print a box within 600 s")]
    world = FakeWorld(clock, {"gpu1": [down()]}, {"gpu1": INV["gpu1"]}, provision=fails)
    k = keeper(store, world, clock)
    k.tick()  # t=0: lost, try 1 fails -> next try at 10
    assert store.load("gpt")[1].current.next_try_at == 10.0
    clock.advance(9)
    k.tick()  # t=9: waiting, nothing run
    assert world.provision.call_count == 1
    clock.advance(1)
    k.tick()  # t=10: try 2 fails -> next at 10 + 20
    assert store.load("gpt")[1].current.next_try_at == 30.0
    clock.advance(20)
    k.tick()  # t=30: try 3 fails -> failed_no_resource
    _, keep = store.load("gpt")
    assert keep.state == KeepState.FAILED_NO_RESOURCE and world.provision.call_count == 3
    assert "no healthy spare in pool a100 and no box from the provision command after 3 tries" in keep.message
    assert not world.launch.called and not world.push.called
    clock.advance(1000)
    k.tick()  # final: nothing more is tried
    assert world.provision.call_count == 3 and not world.launch.called
    assert world.provision.call_args.args[1] == "gpt-r1-n0"  # the same key for every try of this recovery


def test_a_provisioned_box_joins_the_pool_and_takes_the_run(store):
    clock = FakeClock()
    record(store, lost_after=0.0, provision=["./new-box.sh"])
    fresh = Box(name="gpt-r1", host="203.0.113.9", user="root", pool="a100")
    world = FakeWorld(clock, {"gpu1": [down()]}, {"gpu1": INV["gpu1"]}, provision=[fresh])
    k = keeper(store, world, clock)
    k.tick()
    _, keep = store.load("gpt")
    assert keep.boxes == ["gpt-r1"] and world.inventory["gpt-r1"].pool == "a100"
    assert keep.current.provisioned == ["gpt-r1"] and "provisioned" in kinds(k)


def test_a_recovery_s_events_carry_where_it_went_and_the_step_it_resumed_from(store):
    """What the dashboard marks a recovery with, as fields (never parsed out of the text)."""
    clock = FakeClock(start_wall=1000.0)
    record(store, lost_after=0.0)
    world = FakeWorld(clock, {"gpu1": [down()]}, INV, spares={"spare-a": None})
    k = keeper(store, world, clock)
    k.tick()  # t=1000: lost, recovered on spare-a
    resumed = dataclass_replace(alive("spare-a", step=1351, t=1010.0, started=1005.0), resumed_step=1350)
    world.answers["spare-a"] = [resumed]
    clock.advance(12.5)
    k.tick()  # t=1012.5: its first new step
    by_kind = {e["kind"]: e for e in k.events}
    assert [e["kind"] for e in k.events] == ["detected", "declared_lost", "box_chosen", "pushed", "relaunched",
                                             "first_new_step"]
    assert {e["recovery"] for e in k.events} == {1}
    assert by_kind["declared_lost"]["boxes"] == ["gpu1"]  # where it lived when it was lost
    assert by_kind["box_chosen"]["to_boxes"] == ["spare-a"] and by_kind["box_chosen"]["provisioned"] == []
    assert by_kind["relaunched"]["to_boxes"] == ["spare-a"]
    first = by_kind["first_new_step"]
    assert (first["to_boxes"], first["first_step"], first["resume_step"], first["took_s"]) == (
        ["spare-a"], 1351, 1350, 12.5)
    assert "step 1351 (resumed after durable step 1350), 12.5 s after it was detected" in first["text"]
    # the same fields in recovery.json's events (what the keeper sends the tracker)
    _, keep = store.load("gpt")
    assert keep.events[-1]["resume_step"] == 1350 and keep.events[-1]["took_s"] == 12.5


def test_a_provisioned_box_is_named_so_on_box_chosen_and_a_same_box_relaunch_names_its_box(store):
    clock = FakeClock()
    record(store, lost_after=0.0, provision=["./new-box.sh"])
    fresh = Box(name="gpt-r1", host="203.0.113.9", user="root", pool="a100")
    world = FakeWorld(clock, {"gpu1": [down()]}, {"gpu1": INV["gpu1"]}, provision=[fresh])
    k = keeper(store, world, clock)
    k.tick()
    [chosen] = [e for e in k.events if e["kind"] == "box_chosen"]
    assert chosen["to_boxes"] == ["gpt-r1"] and chosen["provisioned"] == ["gpt-r1"]

    store2 = RecordStore(os.path.join(store.root, "..", "other"))
    record(store2)
    world2 = FakeWorld(clock, {"gpu1": [ended("preempted")]}, INV)
    k2 = keeper(store2, world2, clock)
    k2.tick()
    [chosen] = [e for e in k2.events if e["kind"] == "box_chosen"]
    assert chosen["to_boxes"] == chosen["boxes"] == ["gpu1"] and chosen["provisioned"] == []


# -- crash safety --------------------------------------------------------------------------------------------------
class Killed(BaseException):
    """SIGKILL at that very point: nothing after it runs, no finally writes a record."""


@pytest.mark.parametrize("where", ["push", "launch_before", "launch_after"])
def test_a_keeper_killed_mid_recovery_finishes_it_with_one_launch(store, where):
    clock = FakeClock()
    record(store, lost_after=0.0)
    world = FakeWorld(clock, {"gpu1": [down()]}, INV, spares={"spare-a": None})
    landed = []

    def launch(rec, boxes, take_over):
        if where == "launch_after":  # the launch lands on the box, then the keeper dies before recording it
            FakeWorld._launch_ok(world, rec, boxes, take_over)
            landed.append(boxes[0].name)
        raise Killed()

    if where == "push":
        world.push.side_effect = Killed()
    else:
        world.launch.side_effect = launch
    with pytest.raises(Killed):
        keeper(store, world, clock).tick()
    _, keep = store.load("gpt")
    assert keep.state == KeepState.RECOVERING and keep.current.to_boxes == ["spare-a"]  # the choice was written
    # a new keeper process: the same recovery, the same box
    world.push.side_effect = None
    world.launch.side_effect = world._launch_ok
    world.launch.reset_mock()
    clock.advance(5)
    k2 = keeper(store, world, clock)
    k2.tick()
    _, keep = store.load("gpt")
    if where == "launch_after":
        assert not world.launch.called and keep.state == KeepState.WATCHING  # found it running: not launched again
        assert "not launched again" in k2.events[0]["text"]
    elif where == "launch_before":
        assert not world.launch.called  # the earlier launch may be in flight: waited for, not repeated
        clock.advance(20.0 + 30.0)
        k2.tick()
        assert world.launch.call_count == 1
    else:
        assert world.launch.call_count == 1
    _, keep = store.load("gpt")
    assert keep.boxes == ["spare-a"] and keep.recoveries == 1 and keep.current.id == 1 and not keep.history


def test_a_failed_launch_is_retried_with_backoff_then_failed_launch(store):
    clock = FakeClock(start_wall=0.0)
    record(store, lost_after=0.0, tries=2)
    bad = [LaunchResult(box="spare-a", name="gpt", ok=False, error="a live lease is held by gpu1", exit_code=2,
                        hint="the run runs elsewhere")]
    world = FakeWorld(clock, {"gpu1": [down()]}, INV, spares={"spare-a": None}, launches=[bad, bad])
    k = keeper(store, world, clock)
    k.tick()
    clock.advance(10)
    k.tick()
    _, keep = store.load("gpt")
    assert keep.state == KeepState.FAILED_LAUNCH and world.launch.call_count == 2
    assert "a live lease is held by gpu1" in keep.message


def test_max_recoveries_stops_the_keeper_from_trying_more(store):
    clock = FakeClock()
    record(store, max_recoveries=1)
    world = FakeWorld(clock, {"gpu1": [ended("preempted")]}, INV)
    k = keeper(store, world, clock)
    k.tick()  # recovery 1: relaunched (the fake launch makes it alive)
    world.answers["gpu1"] = [ended("preempted")]
    clock.advance(5)
    k.tick()
    _, keep = store.load("gpt")
    assert keep.state == KeepState.FAILED_MAX_RECOVERIES and world.launch.call_count == 1


# -- groups --------------------------------------------------------------------------------------------------------
def test_a_group_recovers_whole_on_fresh_boxes_node_0_first(store):
    clock = FakeClock()
    record(store, run="big", boxes=("n0", "n1"), nodes=True, lost_after=0.0, provision=["./new-box.sh"])
    inv = {"n0": Box(name="n0", host="a"), "n1": Box(name="n1", host="b"),
           "spare-a": Box(name="spare-a", host="c", pool="a100")}
    fresh = Box(name="big-r1-n1", host="d", pool="a100")
    world = FakeWorld(clock, {"n0": [alive("n0", "big")], "n1": [down("n1", "big.node1")]}, inv,
                      spares={"spare-a": None}, provision=[fresh])
    k = keeper(store, world, clock)
    k.tick()
    assert world.launch.call_count == 1
    assert [b.name for b in world.launch.call_args.args[1]] == ["spare-a", "big-r1-n1"]  # node 0 on the spare
    assert world.provision.call_args.args[1:] == ("big-r1-n1", 1)
    _, keep = store.load("big")
    assert keep.boxes == ["spare-a", "big-r1-n1"] and keep.current.take_over


def test_a_group_that_cannot_get_every_node_launches_nothing(store):
    clock = FakeClock()
    record(store, run="big", boxes=("n0", "n1"), nodes=True, lost_after=0.0, tries=1)
    inv = {"n0": Box(name="n0", host="a"), "n1": Box(name="n1", host="b"),
           "spare-a": Box(name="spare-a", host="c", pool="a100")}
    world = FakeWorld(clock, {"n0": [down("n0", "big")], "n1": [down("n1", "big.node1")]}, inv,
                      spares={"spare-a": None})
    k = keeper(store, world, clock)
    k.tick()
    assert store.load("big")[1].state == KeepState.FAILED_NO_RESOURCE and not world.launch.called


# -- records -------------------------------------------------------------------------------------------------------
def test_a_corrupt_recovery_record_is_said_once_left_alone_and_never_rewritten(store, tmp_path):
    clock = FakeClock()
    record(store)
    path = store.keep_path("gpt")
    with open(path, "w") as f:
        f.write('{"schema": "onboxctl.recovery/1", "state": "sleeping"}')
    world = FakeWorld(clock, {"gpu1": [ended("preempted")]}, INV)
    k = keeper(store, world, clock)
    r1 = k.tick()
    k.tick()
    assert "state 'sleeping' is not one of" in r1.problems[0]["text"] and "mv " in r1.problems[0]["hint"]
    assert kinds(k) == ["record_problem"] and not world.launch.called and not world.observed
    with open(path) as f:
        assert json.load(f)["state"] == "sleeping"


def test_records_round_trip_and_refuse_hand_edits(store):
    rec = record(store, provision=["/bin/new-box", "--gpu", "a100"], max_at_risk=1800.0)
    assert store.load_launch("gpt") == rec
    with open(store.launch_path("gpt")) as f:
        doc = json.load(f)
    doc["policy"]["max_recoveries"] = "many"
    with open(store.launch_path("gpt"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(UsageError, match="max_recoveries is 'many'"):
        store.load_launch("gpt")
    assert os.stat(store.run_dir("gpt")).st_mode & 0o777 == 0o700


def test_one_keeper_per_config_dir(tmp_path):
    runs = str(tmp_path / "runs")
    KeeperLock(runs).acquire(create=False).release()  # nothing recorded: nothing to lock, nothing made
    assert not os.path.exists(runs)
    first = KeeperLock(runs).acquire()
    with pytest.raises(UsageError, match="another `onboxctl keep` is watching the runs in"):
        KeeperLock(runs).acquire()
    first.release()
    KeeperLock(runs).acquire().release()
    assert os.listdir(runs) == []  # no lock file left behind


def test_events_go_to_the_tracker_once_and_a_refusal_is_said_once_and_retried(store):
    clock = FakeClock()
    record(store)
    world = FakeWorld(clock, {"gpu1": [ended("preempted")]}, INV)
    world.tracker = "http://127.0.0.1:8787"
    world.publish = mock.Mock(side_effect=["cannot reach the tracker: refused", "cannot reach the tracker: refused",
                                           None, None])
    k = keeper(store, world, clock)
    k.tick()  # relaunched on the same box (detected, box_chosen, pushed, relaunched), the tracker down
    k.tick()  # down again: not said twice
    assert [e["kind"] for e in k.events].count("tracker_problem") == 1
    sent = [e["n"] for e in world.publish.call_args.args[1]]
    assert sent == [1, 2, 3, 4]
    k.tick()  # up: the backlog goes, and is not sent again
    assert store.load("gpt")[1].published == 4
    world.answers["gpu1"] = [alive(step=3, t=99.0, started=90.0)]
    k.tick()
    assert [e["kind"] for e in world.publish.call_args.args[1]] == ["first_new_step"]
