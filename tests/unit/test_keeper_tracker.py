"""The keeper and a tracker it cannot read (issue 30, item 2): "I could not read the beats" is never "the beats
stopped". A box that fails ssh for --lost-after while its tracker is down, answers garbage, an error page, a
document nested too deep, or a run list the keeper cannot use for the run, is waited for (said once as a
`tracker_unreadable` event, and once more when the tracker reads again), never declared lost; with no tracker
configured ssh alone decides, as before.

The tracker here is a real HTTP server on loopback answering what each row says (tests/hosts/tracker_stub.py), read
by the keeper's real World.beats (controller/tracker/runview.py's fetch); only the ssh side is scripted (the box fails every
probe), on a FakeClock.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from controller.boxes.inventory import Box
from controller.keeper.decide import Beats, Observation, Verdict, judge, judge_box
from controller.keeper.loop import Keeper
from controller.keeper.policy import LaunchRecord, RecoveryPolicy
from controller.keeper.records import KeepState, RecordStore
from controller.keeper.world import World
from controller.launch.start import LaunchResult
from onbox.clock import FakeClock
from tests.hosts.tracker_stub import TrackerStub

LOST_AFTER = 15.0


def down(box="gpu1", run="gpt"):
    return Observation(box, run, reached=False, error="cannot reach box %s: Connection refused" % box)


def alive(box="gpu1", run="gpt"):
    return Observation(box, run, reached=True, known=True, state="running", agent_alive=True)


UNREADABLE = Beats(liveness="unreadable", problem="the tracker at http://t answered something unreadable")


# -- the decision table ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("obs, beats, since, now, verdict", [
    (down(), UNREADABLE, 0, 5, Verdict.SUSPECT),
    (down(), UNREADABLE, 0, LOST_AFTER, Verdict.WAIT),  # the beats could not be read: no proof the box stopped
    (down(), UNREADABLE, 0, 10 * LOST_AFTER, Verdict.WAIT),
    (alive(), UNREADABLE, 0, 10 * LOST_AFTER, Verdict.HEALTHY),
    # beside the refusal, what must still hold: beats that arrive keep it, late or absent beats (or no tracker at
    # all: ssh alone decides) make it lost
    (down(), Beats(liveness="ok"), 0, 10 * LOST_AFTER, Verdict.SUSPECT),
    (down(), Beats(liveness="late"), 0, LOST_AFTER, Verdict.LOST),
    (down(), Beats(liveness="absent"), 0, LOST_AFTER, Verdict.LOST),
    (down(), Beats(), 0, LOST_AFTER, Verdict.LOST),
])
def test_unreadable_beats_are_a_reason_to_wait_never_to_recover(obs, beats, since, now, verdict):
    j = judge_box(obs, beats, since, now, lost_after=LOST_AFTER)
    assert j.verdict == verdict, j.reason
    if verdict == Verdict.WAIT:
        assert "could not be read" in j.reason and "answered something unreadable" in j.reason


def test_a_group_with_one_node_lost_on_readable_beats_is_lost_whatever_another_nodes_tracker_says():
    j = judge([down("b0", "g"), down("b1", "g.node1")], [UNREADABLE, Beats(liveness="late")], 0, LOST_AFTER,
              LOST_AFTER)
    assert j.verdict == Verdict.LOST and "node 1" in j.reason
    j = judge([down("b0", "g"), down("b1", "g.node1")], [UNREADABLE, UNREADABLE], 0, LOST_AFTER, LOST_AFTER)
    assert j.verdict == Verdict.WAIT


# -- the real World.beats against a tracker that answers badly -----------------------------------------------------
INV = {"gpu1": Box(name="gpu1", host="10.0.0.1"), "spare-a": Box(name="spare-a", host="10.0.0.2", pool="a100")}


class BoxDown(World):
    """The real tracker reading (World.beats); a box that fails every ssh probe, an idle healthy spare, and every
    launch recorded (a launch here is the healthy run fenced)."""

    def __init__(self, tracker: str) -> None:
        super().__init__(ssh=None, inventory=None, tracker=tracker, token="tok")  # type: ignore[arg-type]
        self.launched: List[str] = []
        self.down = True

    def observe(self, box_name, run):
        if box_name == "gpu1":
            return down(box_name, run) if self.down else alive(box_name, run)
        if box_name in self.launched:
            return alive(box_name, run)
        return Observation(box_name, run, reached=True, known=False)  # an idle spare: it answers, without the run

    def box(self, name):
        return INV[name]

    def boxes(self):
        return dict(INV)

    def spare_problem(self, name, rec):
        return None

    def push(self, box, rec, code=True):
        pass

    def launch(self, rec, boxes, take_over):
        self.launched += [b.name for b in boxes]
        return [LaunchResult(box=b.name, name=rec.run, ok=True, state="running") for b in boxes]


def record(store: RecordStore) -> LaunchRecord:
    rec = LaunchRecord(run="gpt", boxes=["gpu1"], command=["python", "train.py"],
                       policy=RecoveryPolicy(pool="a100", lost_after=LOST_AFTER, backoff=10.0), durable="/d",
                       onbox_args=["--durable", "/d"], heartbeat_interval=5.0, timeout=20.0)
    store.save_launch(rec)
    return rec


def deep(n: int) -> bytes:
    return b'{"runs": [{"run": "gpt", "liveness": "ok", "latest": {"x": ' + b"[" * n + b"]" * n + b"}}]}"


UNREADABLE_ANSWERS = [
    ("garbage", 200, b"<html><body>502 Bad Gateway</body></html>", "answered something unreadable"),
    ("deep", 200, deep(3000), "nests more than 64 levels"),
    ("error-500", 500, b'{"detail": "database is locked"}', "answered HTTP 500"),
    ("token-refused", 401, b'{"detail": "bad token"}', "refused the token"),
    ("not-a-run-list", 200, {"runs": 5}, "run list"),
    ("error-marker", 200, {"error": "database is locked"}, "run list"),
    ("liveness-garbage", 200, {"runs": [{"run": "gpt", "liveness": "probably-fine"}]}, "liveness 'probably-fine'"),
    ("run-skipped", 200, {"runs": [{"run": "other", "liveness": "ok"}], "skipped_rows": 1},
     "could not read 1 of its runs"),
    ("entry-unreadable", 200, {"runs": [{"run": "gpt", "unreadable": True}]}, "liveness None"),
]


@pytest.fixture
def stub():
    s = TrackerStub().start()
    yield s
    s.stop()


def keep_events(store: RecordStore) -> List[Dict[str, Any]]:
    return store.load("gpt")[1].events


@pytest.mark.parametrize("status, body, says", [a[1:] for a in UNREADABLE_ANSWERS],
                         ids=[a[0] for a in UNREADABLE_ANSWERS])
def test_a_box_failing_ssh_while_its_tracker_cannot_be_read_is_waited_for_not_taken_over(tmp_path, stub, status,
                                                                                          body, says):
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    record(store)
    stub.answer(status, body)
    world = BoxDown(stub.url)
    said: List[Dict[str, Any]] = []
    k = Keeper(store, world, clock=clock, say=said.append)
    for _ in range(8):  # 8 passes 5 s apart: 35 s of failed probes, more than twice --lost-after
        k.tick()
        clock.advance(5.0)
    _, keep = store.load("gpt")
    assert world.launched == [] and keep.recoveries == 0 and keep.current is None
    assert keep.state == KeepState.SUSPECT and keep.suspect_since == 1000.0
    assert "could not be read" in (keep.message or "") and says in keep.message
    kinds = [e["kind"] for e in keep_events(store)]
    assert kinds.count("tracker_unreadable") == 1 and "declared_lost" not in kinds and "needs_a_person" not in kinds
    [ev] = [e for e in keep_events(store) if e["kind"] == "tracker_unreadable"]
    assert says in ev["text"] and "not declared lost" in ev["text"]

    # the tracker reads again, and says the run's beats are late: said once, and the box (failing ssh for 40 s by
    # now) is lost in that very pass: the suspicion was kept while the beats could not be read
    stub.runs({"run": "gpt", "box": "gpu1", "liveness": "late", "state": "running"})
    k.tick()
    _, keep = store.load("gpt")
    kinds = [e["kind"] for e in keep_events(store)]
    assert kinds.count("tracker_readable") == 1 and kinds.count("tracker_unreadable") == 1
    assert "declared_lost" in kinds and world.launched == ["spare-a"]
    assert keep.current.phases["detected"] == 1000.0


def test_a_tracker_that_is_down_is_waited_for_too(tmp_path):
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    record(store)
    world = BoxDown("http://127.0.0.1:9")  # nothing listens: connection refused
    k = Keeper(store, world, clock=clock)
    for _ in range(8):
        k.tick()
        clock.advance(5.0)
    _, keep = store.load("gpt")
    assert world.launched == [] and keep.state == KeepState.SUSPECT
    assert [e["kind"] for e in keep.events].count("tracker_unreadable") == 1
    assert "cannot read the tracker at http://127.0.0.1:9" in keep.message


def test_the_streak_is_said_once_across_keepers_run_from_cron(tmp_path, stub):
    """`keep --once` from cron is a new keeper each pass: the streak lives in recovery.json, not in memory."""
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    record(store)
    stub.answer(200, b"garbage")
    for _ in range(5):
        Keeper(store, BoxDown(stub.url), clock=clock).tick()
        clock.advance(5.0)
    assert [e["kind"] for e in keep_events(store)].count("tracker_unreadable") == 1
    stub.runs({"run": "gpt", "liveness": "ok"})
    Keeper(store, BoxDown(stub.url), clock=clock).tick()
    stub.answer(200, b"garbage")  # a second streak: said again
    Keeper(store, BoxDown(stub.url), clock=clock).tick()
    kinds = [e["kind"] for e in keep_events(store)]
    assert kinds.count("tracker_unreadable") == 2 and kinds.count("tracker_readable") == 1


def test_a_box_that_answers_is_healthy_and_the_unreadable_tracker_is_still_said_once(tmp_path, stub):
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    record(store)
    stub.answer(500, b"{}")
    world = BoxDown(stub.url)
    world.down = False
    k = Keeper(store, world, clock=clock)
    for _ in range(3):
        k.tick()
        clock.advance(5.0)
    _, keep = store.load("gpt")
    assert keep.state == KeepState.WATCHING and world.launched == []
    assert [e["kind"] for e in keep.events].count("tracker_unreadable") == 1


@pytest.mark.parametrize("entries, skipped", [
    ([{"run": "other", "liveness": "ok"}], 0),  # the tracker reads, and has never heard of the run
    ([{"run": "gpt", "liveness": "late", "latest": None}], 1),  # listed, its newest beat unreadable: liveness holds
    ([{"run": "gpt", "liveness": "late", "problem": "its newest beat could not be read", "latest": None}], 0),
])
def test_readable_beats_that_are_not_ok_still_let_a_box_be_lost(tmp_path, stub, entries, skipped):
    """Beside the refusal: a tracker that answers a usable run list decides as before (late or absent beats and
    --lost-after of failed ssh: lost, recovered on the spare)."""
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    record(store)
    stub.runs(*entries, skipped=skipped)
    world = BoxDown(stub.url)
    k = Keeper(store, world, clock=clock)
    for _ in range(4):
        k.tick()
        clock.advance(5.0)
    assert world.launched == ["spare-a"]
    assert "tracker_unreadable" not in [e["kind"] for e in keep_events(store)]


@pytest.mark.parametrize("latest", [{"progress": {"step": 7}}, json.loads(deep(100).decode())["runs"][0]["latest"]],
                         ids=["plain", "its-newest-beat-nests-100-deep"])
def test_beats_that_arrive_keep_a_box_that_fails_ssh(tmp_path, stub, latest):
    """Whether the reader shows the run without a beat it cannot take or refuses the whole answer, a run whose beats
    arrive is never lost."""
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    record(store)
    stub.runs({"run": "gpt", "liveness": "ok", "latest": latest})
    world = BoxDown(stub.url)
    k = Keeper(store, world, clock=clock)
    for _ in range(8):
        k.tick()
        clock.advance(5.0)
    assert world.launched == [] and store.load("gpt")[1].state == KeepState.SUSPECT


def test_no_tracker_configured_is_not_unreadable_ssh_alone_decides(tmp_path):
    clock = FakeClock(start_wall=1000.0)
    store = RecordStore(str(tmp_path))
    record(store)
    world = BoxDown("")
    world.tracker = None
    assert world.beats([store.load_launch("gpt")]) == {}
    k = Keeper(store, world, clock=clock)
    for _ in range(4):
        k.tick()
        clock.advance(5.0)
    assert world.launched == ["spare-a"]
    assert "tracker_unreadable" not in [e["kind"] for e in keep_events(store)]


def test_the_world_reads_each_run_of_a_tracker_as_it_is_listed(stub):
    stub.answer(200, json.dumps({"runs": [{"run": "gpt", "liveness": "late", "box": "gpu1"}], "skipped_rows": 0}
                                ).encode())
    rec = LaunchRecord(run="gpt", boxes=["gpu1", "gpu2"], command=["x"], policy=RecoveryPolicy(pool="a"),
                       nodes=True)
    beats = BoxDown(stub.url).beats([rec])
    assert beats["gpt"].liveness == "late" and beats["gpt.node1"].liveness == "absent"
    assert stub.requests == ["GET /api/v1/runs"]
