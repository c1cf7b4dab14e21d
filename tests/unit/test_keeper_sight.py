"""Never recover a healthy run (issue 31, part 1), on scripted boxes and a FakeClock: a keeper that reaches too few of
its boxes and no tracker beyond its machine suspects itself (`keeper_blind`, then `keeper_sees_again`) and declares
nothing lost; a lost box that answers alive right before the take-over calls the recovery off
(`recovery_cancelled`); a box declared lost a moment ago is no spare; a run that ended failed_no_resource does not
show RECOVERING; the fast path (beats late and no answer at all within --suspect-timeout) and when it is armed; a
keeper started again after a crash mid-launch says why it waits, and launches at once where nothing of the earlier
launch can still land. Beside each refusal, the healthy or legit case that must still go through."""
from __future__ import annotations

from typing import Any, Dict, List

import pytest

from controller.boxes.inventory import Box
from controller.keeper.decide import Beats, Observation, Verdict, judge_box, sight
from controller.keeper.loop import Keeper
from controller.keeper.policy import LaunchRecord
from controller.keeper.records import KeepState, RecordStore
from controller.keeper.view import apply_keeper, summary
from controller.tracker.runview import RunRow, keeper_label
from onbox.clock import FakeClock
from tests.unit.test_keeper import FakeWorld, alive, dataclass_replace, down, policy

LATE = Beats(liveness="late", state="running")
SILENT_BOX = "no answer within 3 s (--suspect-timeout)"


def silent(box, run):
    return Observation(box, run, reached=False, silent=True, error=SILENT_BOX)


def record(store, run, boxes, **kw):
    rec = LaunchRecord(run=run, boxes=list(boxes), command=["python", "train.py"], policy=policy(**kw),
                       onbox_args=["--durable", "/d"], durable="/d", heartbeat_interval=5.0, timeout=20.0)
    store.save_launch(rec)
    return rec


@pytest.fixture
def store(tmp_path):
    return RecordStore(str(tmp_path))


def two_runs_and_a_spare(store, **kw):
    record(store, "r1", ["b1"], **kw)
    record(store, "r2", ["b2"], **kw)
    return {"b1": Box(name="b1", host="10.0.0.1", pool="a100"), "b2": Box(name="b2", host="10.0.0.2", pool="a100"),
            "s1": Box(name="s1", host="10.0.0.3", pool="a100")}


def kinds(events: List[Dict[str, Any]], run=None):
    return [e["kind"] for e in events if run is None or e.get("run") == run]


# -- the rule --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answered, asked, tracker_seen, blind", [
    (0, 12, False, True),  # the keeper's own network went: nothing answers
    (0, 2, False, True),
    (2, 12, False, True),  # a box or two on its own LAN answer while its uplink is down
    (3, 12, False, False),  # a quarter answers: boxes died, the keeper sees
    (1, 3, False, False),
    (16, 32, False, False),  # a reclaim wave took 16 runs' boxes: the 16 spares answer
    (0, 1, False, False),  # one box alone: its death and the keeper's blindness look the same: decided as before
    (0, 12, True, False),  # a tracker beyond this machine answered: the keeper's network works
])
def test_the_keeper_suspects_itself_when_too_few_boxes_answer_and_no_tracker_beyond_it(answered, asked,
                                                                                         tracker_seen, blind):
    assert (sight(answered, asked, tracker_seen) is not None) == blind


# -- blind: nothing is declared lost -----------------------------------------------------------------------------
def test_a_keeper_that_sees_none_of_its_boxes_recovers_nothing_and_says_it_once(store):
    """Every box (both runs' and the spare) fails for 5x --lost-after, the beats late (a tracker on the keeper's
    machine, which the boxes cannot reach either): nothing declared lost, no launch, no push, no provision; each run
    told once that the keeper is blind, and once that it sees again; after the heal both runs watched where they
    were."""
    clock = FakeClock(start_wall=1000.0)
    inv = two_runs_and_a_spare(store, lost_after=15.0, provision=["./new-box.sh"])
    cut = {"b1": [silent("b1", "r1")], "b2": [silent("b2", "r2")], "s1": [silent("s1", "r1")]}
    world = FakeWorld(clock, cut, inv, spares={"s1": None}, beats={"r1": LATE, "r2": LATE})
    said: List[Dict[str, Any]] = []
    k = Keeper(store, world, clock=clock, say=said.append)
    blind = []
    for _ in range(16):  # 75 s: 5x --lost-after
        blind.append(k.tick().blind)
        clock.advance(5.0)
    assert all(blind) and "0 of the 3 boxes it asked answered ssh" in blind[0]
    assert not world.launch.called and not world.push.called and not world.provision.called
    assert not world.spare_problem.called
    for run in ("r1", "r2"):
        _, keep = store.load(run)
        assert keep.state == KeepState.SUSPECT and keep.recoveries == 0 and keep.current is None
        assert kinds(keep.events) == ["keeper_blind", "suspect"], keep.events
        assert "not declared lost: the keeper cannot see" in keep.message
    # the heal: every box answers, each run trains on where it was
    world.answers.update({"b1": [alive("b1", "r1")], "b2": [alive("b2", "r2")], "s1": [silent("s1", "r1")]})
    world._beats = {"r1": Beats(liveness="ok"), "r2": Beats(liveness="ok")}
    k.tick()
    for run, box in (("r1", "b1"), ("r2", "b2")):
        _, keep = store.load(run)
        assert keep.state == KeepState.WATCHING and keep.boxes == [box] and keep.blind_since is None
        assert kinds(keep.events) == ["keeper_blind", "suspect", "keeper_sees_again", "suspect_cleared"]
    assert [e["kind"] for e in said].count("keeper_blind") == 2


def test_a_box_that_died_while_the_others_answer_is_still_recovered(store):
    """Beside the refusal: b1 is gone, b2 and the spare answer: the keeper sees, and r1 is recovered on the spare."""
    clock = FakeClock(start_wall=1000.0)
    inv = two_runs_and_a_spare(store, lost_after=15.0)
    world = FakeWorld(clock, {"b1": [silent("b1", "r1")], "b2": [alive("b2", "r2")]}, inv, spares={"s1": None},
                      beats={"r1": LATE, "r2": Beats(liveness="ok")})
    k = Keeper(store, world, clock=clock)
    for _ in range(5):
        assert k.tick().blind is None
        clock.advance(5.0)
    assert store.load("r1")[1].boxes == ["s1"] and store.load("r2")[1].boxes == ["b2"]
    assert world.launch.call_count == 1 and world.launch.call_args.kwargs["take_over"] is True


def test_a_tracker_beyond_the_keepers_machine_that_answers_lets_it_see(store):
    """Every box dark, but a tracker elsewhere answered (its network works): the keeper sees, and the box is lost
    --lost-after after that (what went late while it was blind is no evidence)."""
    clock = FakeClock(start_wall=1000.0)
    record(store, "r1", ["b1"], lost_after=15.0)
    inv = {"b1": Box(name="b1", host="h1", pool="a100"), "s1": Box(name="s1", host="h2", pool="a100"),
           "s2": Box(name="s2", host="h3", pool="a100")}
    world = FakeWorld(clock, {"b1": [silent("b1", "r1")], "s1": [silent("s1", "r1")], "s2": [silent("s2", "r1")]},
                      inv, spares={"s1": None}, beats={"r1": LATE})
    k = Keeper(store, world, clock=clock)
    k.tick()
    assert k.sight.blind is not None
    world.tracker_elsewhere_answered = True  # type: ignore[attr-defined]
    clock.advance(20.0)
    assert k.tick().blind is None and not world.launch.called
    clock.advance(15.0)
    k.tick()
    assert world.launch.called and store.load("r1")[1].boxes == ["s1"]


def test_after_the_keeper_sees_again_a_box_still_dark_gets_a_fresh_lost_after(store):
    """The beats went late while the keeper could not look: no evidence. A box still dark once it sees again is
    lost only after --lost-after from then (and the fast path waits as long)."""
    clock = FakeClock(start_wall=1000.0)
    inv = two_runs_and_a_spare(store, lost_after=15.0)
    world = FakeWorld(clock, {"b1": [silent("b1", "r1")], "b2": [silent("b2", "r2")], "s1": [silent("s1", "r1")]},
                      inv, spares={"s1": None}, beats={"r1": LATE, "r2": LATE})
    k = Keeper(store, world, clock=clock)
    for _ in range(6):
        k.tick()
        clock.advance(5.0)
    world.answers.update({"b2": [alive("b2", "r2")], "s1": [Observation("s1", "r1", reached=True, known=False)]})
    states = []
    for _ in range(5):  # the pass it sees again (t=1030), then every 5 s
        k.tick()
        states.append(store.load("r1")[1].state.value)
        clock.advance(5.0)
    assert states == ["suspect", "suspect", "suspect", "watching", "watching"], states  # lost at 15 s after
    _, keep = store.load("r1")
    assert keep.boxes == ["s1"] and keep.current.phases["detected"] == 1030.0


# -- the lost box asked once more --------------------------------------------------------------------------------
class Rechecked(FakeWorld):
    """b1 is silent at the judgement, and answers alive when asked once more (right before the take-over)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked = 0
        self.comes_back = True

    def observe(self, box, run):
        if box == "b1":
            self.asked += 1
            if self.asked > 1 and self.comes_back:
                return alive("b1", run)
        return super().observe(box, run)


def test_a_lost_box_that_answers_alive_right_before_the_take_over_calls_the_recovery_off(store):
    clock = FakeClock(start_wall=1000.0)
    inv = two_runs_and_a_spare(store, lost_after=0.0)
    world = Rechecked(clock, {"b1": [silent("b1", "r1")], "b2": [alive("b2", "r2")]}, inv, spares={"s1": None},
                      beats={"r1": LATE})
    k = Keeper(store, world, clock=clock)
    k.tick()
    assert not world.launch.called  # nothing taken over: b1's agent lives
    _, keep = store.load("r1")
    assert keep.state == KeepState.WATCHING and keep.boxes == ["b1"] and keep.recoveries == 0
    assert kinds(keep.events)[-1] == "recovery_cancelled", keep.events
    assert "b1 answers again and its agent of r1 is alive" in keep.events[-1]["text"]
    assert keep.current is None and keep.history[-1].cancelled and "relaunched" not in keep.history[-1].phases
    # the spare it had prepared is free again, and no cooldown holds b1 (its recovery was called off)
    world.answers["b2"] = [silent("b2", "r2")]
    world._beats = {"r2": LATE}
    clock.advance(5.0)
    k.tick()
    assert store.load("r2")[1].boxes == ["s1"]


def test_a_lost_box_that_stays_silent_when_asked_again_is_taken_over(store):
    clock = FakeClock(start_wall=1000.0)
    inv = two_runs_and_a_spare(store, lost_after=0.0)
    world = Rechecked(clock, {"b1": [silent("b1", "r1")], "b2": [alive("b2", "r2")]}, inv, spares={"s1": None},
                      beats={"r1": LATE})
    world.comes_back = False
    Keeper(store, world, clock=clock).tick()
    assert world.asked >= 2 and world.launch.call_count == 1
    assert store.load("r1")[1].boxes == ["s1"]


# -- a box freed a moment ago is no spare -------------------------------------------------------------------------
def test_a_box_a_run_was_taken_off_a_moment_ago_is_not_a_spare_for_another(store):
    """r1 was taken off `a-old` (declared lost); `a-old` comes back idle (its agent fenced). r2 is lost next: it
    must not be shuffled onto `a-old` (first by name), but onto the real spare."""
    clock = FakeClock(start_wall=1000.0)
    record(store, "r1", ["a-old"], lost_after=0.0)
    record(store, "r2", ["b2"], lost_after=0.0)
    inv = {"a-old": Box(name="a-old", host="h0", pool="a100"), "b2": Box(name="b2", host="h2", pool="a100"),
           "s1": Box(name="s1", host="h3", pool="a100"), "s2": Box(name="s2", host="h4", pool="a100")}
    world = FakeWorld(clock, {"a-old": [silent("a-old", "r1")], "b2": [alive("b2", "r2")]}, inv,
                      spares={"a-old": None, "s1": None, "s2": None}, beats={"r1": LATE})
    k = Keeper(store, world, clock=clock)
    k.tick()
    assert store.load("r1")[1].boxes == ["s1"]
    world.answers["a-old"] = [Observation("a-old", "r1", reached=True, known=True, state="fenced", fenced=True)]
    world.answers["b2"] = [silent("b2", "r2")]
    world._beats = {"r2": LATE}
    clock.advance(30.0)
    k.tick()
    assert store.load("r2")[1].boxes == ["s2"]
    assert "a-old" not in [c.args[0] for c in world.spare_problem.call_args_list]


# -- failed_no_resource is not RECOVERING -----------------------------------------------------------------------
def test_a_run_that_ended_failed_no_resource_does_not_show_recovering(store):
    clock = FakeClock(start_wall=1000.0)
    record(store, "r1", ["b1"], lost_after=0.0, tries=1)
    world = FakeWorld(clock, {"b1": [down("b1", "r1")]}, {"b1": Box(name="b1", host="h")})
    k = Keeper(store, world, clock=clock)
    report = k.tick()
    rec, keep = store.load("r1")
    assert keep.state == KeepState.FAILED_NO_RESOURCE and keep.current is not None
    doc = summary(rec, keep)
    assert doc["state"] == "failed_no_resource" and doc["phase"] is None, doc
    assert report.runs[0]["state"] == "failed_no_resource"
    rows, _, _ = apply_keeper([RunRow(box="b1", run="r1", state="running", source="ssh")], store)
    assert rows[0].keeper["state"] == "failed_no_resource" and keeper_label(rows[0]) == "failed_no_resource 0x"
    # beside it: a recovery under way still shows RECOVERING
    record(store, "r2", ["b2"], lost_after=0.0)
    w2 = FakeWorld(clock, {"b2": [down("b2", "r2")]}, {"b2": Box(name="b2", host="h"),
                                                      "s": Box(name="s", host="h2", pool="a100")},
                   spares={"s": None})
    Keeper(store, w2, clock=clock, runs=["r2"]).tick()
    rec2, keep2 = store.load("r2")
    assert summary(rec2, keep2)["state"] == "recovering" and summary(rec2, keep2)["phase"] == "first_new_step"


# -- the fast path ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("obs, beats, fast, verdict", [
    (silent("b", "r"), LATE, True, Verdict.LOST),  # late beats, no answer at all: nothing is left of it
    (silent("b", "r"), LATE, False, Verdict.SUSPECT),  # not armed: --lost-after as before
    (down("b", "r"), LATE, True, Verdict.SUSPECT),  # refused: its machine answered (sshd down): --lost-after
    (silent("b", "r"), Beats(liveness="ok"), True, Verdict.SUSPECT),  # its beats arrive
    (silent("b", "r"), Beats(), True, Verdict.SUSPECT),  # no tracker: ssh alone, --lost-after
    (silent("b", "r"), Beats(liveness="unreadable"), True, Verdict.SUSPECT),
    (alive("b", "r"), LATE, True, Verdict.HEALTHY),
])
def test_the_fast_path_needs_late_beats_no_answer_at_all_and_to_be_armed(obs, beats, fast, verdict):
    assert judge_box(obs, beats, 1000.0, 1001.0, lost_after=15.0, fast=fast).verdict == verdict


def test_an_ok_beat_turns_late_at_the_judgement_by_the_trackers_rule():
    b = Beats(liveness="ok", age=8.0, interval=5.0, read_at=100.0)
    assert not b.late(101.9) and b.late(102.1) and b.late_at() == 102.0
    assert not Beats(liveness="ok").late(1e9)  # no age known: the tracker's word only


def test_the_fast_path_is_armed_once_the_keeper_has_looked_for_lost_after(store):
    """A keeper just started (or just able to read the tracker again) does not trust beats that went late while it
    was not looking: silent + late is lost only once it has watched for --lost-after."""
    clock = FakeClock(start_wall=1000.0)
    inv = two_runs_and_a_spare(store, lost_after=15.0)
    world = FakeWorld(clock, {"b1": [silent("b1", "r1")], "b2": [alive("b2", "r2")]}, inv, spares={"s1": None},
                      beats={"r1": LATE, "r2": Beats(liveness="ok")})
    k = Keeper(store, world, clock=clock)
    k.tick()  # t=0: armed only from t=15
    assert store.load("r1")[1].state == KeepState.SUSPECT
    clock.advance(14.0)
    k.tick()
    assert store.load("r1")[1].state == KeepState.SUSPECT and not world.launch.called
    clock.advance(1.0)
    k.tick()
    assert store.load("r1")[1].boxes == ["s1"]
    assert "did not answer" in store.load("r1")[1].current.reason


# -- a keeper started again mid-launch ----------------------------------------------------------------------------
class InFlight(FakeWorld):
    on_way: Any = None

    def launch_in_flight(self, rec, boxes):
        return self.on_way


@pytest.mark.parametrize("on_way, launches", [(False, 1), (True, 0), (None, 0)])
def test_a_keeper_started_again_mid_launch_says_why_it_waits_and_launches_when_nothing_can_land(store, on_way,
                                                                                                launches):
    clock = FakeClock(start_wall=1000.0)
    rec = record(store, "r1", ["b1"], lost_after=0.0)
    inv = {"b1": Box(name="b1", host="h"), "s1": Box(name="s1", host="h2", pool="a100")}
    world = InFlight(clock, {"b1": [down("b1", "r1")]}, inv, spares={"s1": None})

    class Killed(BaseException):
        pass

    world.launch.side_effect = Killed()
    with pytest.raises(Killed):
        Keeper(store, world, clock=clock).tick()
    assert store.load("r1")[1].current.launch_started_at == 1000.0
    world.launch.side_effect = world._launch_ok
    world.launch.reset_mock()
    world.on_way = on_way
    clock.advance(3.0)
    k2 = Keeper(store, world, clock=clock)
    k2.tick()
    k2.tick()
    assert world.launch.call_count == launches
    _, keep = store.load("r1")
    said = [e["text"] for e in keep.events if e["kind"] == "launch_in_flight"]
    assert len(said) == 1, said  # said once, not every pass
    if on_way is False:
        assert "did not land" in said[0] and "launching again now" in said[0]
        assert keep.boxes == ["s1"]
    else:
        assert "may still be on its way" in said[0] and "waiting for it up to %.0f s more" % (
            rec.timeout + 30.0 - 3.0) in said[0]
        clock.advance(rec.timeout + 30.0)
        k2.tick()
        assert world.launch.call_count == 1  # the bound passed: launched once


def test_a_launch_refused_because_the_run_is_alive_there_reads_as_landed(store):
    """A second `onbox run` under a live name is refused (exit 2); when the box then says the run is alive there,
    the earlier launch landed: relaunched, not a launch failure."""
    from controller.launch.start import LaunchResult

    clock = FakeClock(start_wall=1000.0)
    record(store, "r1", ["b1"], lost_after=0.0, tries=1)
    inv = {"b1": Box(name="b1", host="h"), "s1": Box(name="s1", host="h2", pool="a100")}
    world = FakeWorld(clock, {"b1": [down("b1", "r1")]}, inv, spares={"s1": None})

    def refused(rec, boxes, take_over):
        world.answers["s1"] = [dataclass_replace(alive("s1", "r1"), step=None)]
        return [LaunchResult(box="s1", name="r1", ok=False, exit_code=2,
                             error="run r1 is held by another agent (pid 42)")]

    world.launch.side_effect = refused
    Keeper(store, world, clock=clock).tick()
    _, keep = store.load("r1")
    assert keep.state == KeepState.WATCHING and keep.boxes == ["s1"] and "relaunched" in keep.current.phases


# -- what run --recover records -----------------------------------------------------------------------------------
def test_include_secret_is_recorded_by_path_with_its_code_dir_and_refused_without_one(tmp_path):
    from controller.keeper.enrol import check_recovery, enrol
    from onbox.errors import UsageError

    code = tmp_path / "code"
    code.mkdir()
    (code / ".env").write_text("TOKEN=s3cret-never-recorded\n")  # a value no temp path holds
    inv = {"s1": Box(name="s1", host="h", pool="a100")}
    with pytest.raises(UsageError, match="--include-secret goes with --recover"):
        check_recovery(None, {"include_secret": (".env",)}, ["python"], "/d", inv)
    with pytest.raises(UsageError, match="--include-secret goes with --code"):
        check_recovery("pool:a100", {"include_secret": (".env",)}, ["python"], "/d", inv)
    with pytest.raises(UsageError, match="names no"):
        check_recovery("pool:a100", {"code": str(code), "include_secret": ("nope.env",)}, ["python"], "/d", inv)
    assert check_recovery(None, {"include_secret": ()}, ["python"], None, inv) is None  # not given: nothing asked
    opts = {"code": str(code), "include_secret": (".env",), "durable": "/d"}
    p = check_recovery("pool:a100", opts, ["python"], "/d", inv)
    store = RecordStore(str(tmp_path / "cfg"))
    rec = enrol(store, p, "kp", ["b1"], ["python"], False, [], {}, None, opts, None, False, 60.0)
    assert rec.include_secrets == [".env"] and store.load_launch("kp").include_secrets == [".env"]
    with open(store.launch_path("kp")) as f:
        assert "s3cret-never-recorded" not in f.read()


def test_a_box_whose_host_refuses_ssh_counts_as_seen(store):
    """A refused connection is the box's host answering: the keeper's network reaches it. A run whose box and only
    spare both refuse ssh is judged as before (lost, then no box), never waited out as blindness."""
    clock = FakeClock(start_wall=1000.0)
    record(store, "r1", ["b1"], lost_after=0.0, tries=1)
    inv = {"b1": Box(name="b1", host="h1"), "s1": Box(name="s1", host="h2", pool="a100")}
    refused = {b: [dataclass_replace(down(b, "r1"), heard=True)] for b in ("b1", "s1")}
    world = FakeWorld(clock, refused, inv, spares={"s1": "cannot reach box s1: Connection refused"})
    report = Keeper(store, world, clock=clock).tick()
    assert report.blind is None and report.sight == (1, 1)  # b1 answered: nothing dark, no witness asked
    assert store.load("r1")[1].state == KeepState.FAILED_NO_RESOURCE


def test_a_witness_answer_left_from_an_earlier_pass_is_not_sight_now():
    """A witness slower than its timeout in one pass answers (alive) after it; the network goes; the next doubtful
    pass must not count that answer, asked before the cut, as seeing: it asks the witness again (dark now)."""
    import threading

    from controller.keeper.probes import Probes
    from controller.keeper.sight import Witnesses

    clock = FakeClock(start_wall=1000.0)
    release = threading.Event()
    network = {"up": True}

    def observe(box, run):
        if network["up"]:
            release.wait(10)
            return Observation(box, run, reached=True, known=True)
        return Observation(box, run, reached=False, silent=True, error="no route")

    probes = Probes(observe, clock)
    rec = LaunchRecord(run="kp", boxes=["b1"], command=["x"], policy=policy())
    boxes = {"b1": Box(name="b1", host="h1", pool="a100"), "s1": Box(name="s1", host="h2", pool="a100")}
    try:
        first = Witnesses(probes, lambda: boxes, [rec], {"b1"}, 0.05, 0.05, since=clock.time()).ask(set())
        assert [o.silent for o in first] == [True]  # slower than its timeout: dark in that pass, still out
        release.set()
        probes.wait([("s1", "kp")], 10)  # ... and it answered alive after it
        network["up"] = False
        clock.advance(5.0)
        now = Witnesses(probes, lambda: boxes, [rec], {"b1"}, 0.05, 0.05, since=clock.time()).ask(set())
        assert [(o.box, o.reached or o.heard) for o in now] == [("s1", False)]
    finally:
        release.set()
        probes.close()
