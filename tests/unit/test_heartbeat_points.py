"""The trainer's points in each beat (onbox/heartbeat/points.py): every record since the previous beat, bounded and
thinned evenly (each kind of record on its own), checked by the schema; the tracker sink cuts a backlog into
requests that fit."""
from __future__ import annotations

import json

import jsonschema
import pytest

from onbox.clock import FakeClock
from onbox.heartbeat.points import MAX_POINTS, beat_points, evenly, shares, thin
from onbox.heartbeat.schema import MAX_BEAT_POINTS, load_schema, validate
from onbox.heartbeat.sinks import TrackerSink
from onbox.telemetry.progress import PointLog
from tests.fakes.supervisor import loop_step
from tests.unit.test_heartbeat_hook import STATE, beats, make


def records(n, start=1, t0=1_700_000_000_000, every=60):
    """PointLog's records of a trainer printing step, loss and lr every `every` ms."""
    return [[t0 + (s - start) * every, s, {"loss": round(4.0 / (1 + s / 100.0), 6), "lr": 3e-4}]
            for s in range(start, start + n)]


@pytest.mark.parametrize("n,k", [(10, 10), (10, 20), (1300, 500), (501, 500), (7, 3), (1000, 2)])
def test_evenly_keeps_the_first_and_the_last_and_spreads_the_rest(n, k):
    idx = evenly(n, k)
    assert len(idx) == min(n, k) and idx == sorted(set(idx))
    assert idx[0] == 0 and idx[-1] == n - 1
    gaps = {b - a for a, b in zip(idx, idx[1:])}
    assert max(gaps) - min(gaps) <= 1  # even: the gaps differ by one at most


def test_evenly_at_the_edges():
    assert evenly(5, 0) == [] and evenly(5, 1) == [4] and evenly(0, 3) == []


def test_shares_keep_small_groups_whole_and_split_the_rest():
    assert shares([3, 1000, 10], 500) == [3, 487, 10]
    assert shares([400, 400], 500) == [250, 250]
    assert shares([2, 3], 500) == [2, 3]
    assert sum(shares([1000, 999, 5, 1], 500)) == 500


def test_under_the_bound_every_record_goes_as_columns():
    pts = records(3)
    pts.append([pts[-1][0] + 10, 3, {"eval_loss": 2.5}])  # an eval line: the step is the newest known
    pts.append([pts[-1][0] + 10, None, {"loss": "NaN"}])  # before any step; a loss that is not finite
    got = beat_points(pts, dropped=0)
    assert got == {"time": [1700000000.0, 1700000000.06, 1700000000.12, 1700000000.13, 1700000000.14],
                   "step": [1, 2, 3, 3, None],
                   "loss": [3.960396, 3.921569, 3.883495, None, "NaN"],
                   "eval_loss": [None, None, None, 2.5, None],
                   "lr": [3e-4, 3e-4, 3e-4, None, None],
                   "thinned": 0, "dropped": 0}
    assert beat_points([], 4) == {"time": [], "step": [], "thinned": 0, "dropped": 4}


def test_over_the_bound_the_train_records_are_thinned_evenly_and_every_eval_record_kept():
    """1,300 steps since the previous beat and an eval every 300: 500 records go; the five evals all of them, the
    train records evenly spread from the first step to the last."""
    pts = []
    for p in records(1300):
        pts.append(p)
        if p[1] % 300 == 0 or p[1] == 1300:
            pts.append([p[0] + 1, p[1], {"eval_loss": 3.0 - p[1] / 1000.0}])
    got = beat_points(pts)
    assert len(got["time"]) == MAX_POINTS and got["thinned"] == len(pts) - MAX_POINTS == 805
    evals = [s for s, e in zip(got["step"], got["eval_loss"]) if e is not None]
    assert evals == [300, 600, 900, 1200, 1300]
    train = [s for s, loss in zip(got["step"], got["loss"]) if loss is not None]
    assert len(train) == MAX_POINTS - 5 and train[0] == 1 and train[-1] == 1300
    gaps = {b - a for a, b in zip(train, train[1:])}
    assert gaps <= {2, 3}  # 1,300 steps over 495 points: every 2nd or 3rd
    assert got["time"] == sorted(got["time"])  # still in the order parsed
    assert thin(pts, 10_000) == list(range(len(pts)))


def test_a_hook_sends_the_records_since_the_previous_beat_and_says_what_it_thinned(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_BOX", "box-a")
    clock = FakeClock()
    hook, _run_dir, out = make(tmp_path, clock)
    hook.tick(STATE)  # start: nothing parsed yet
    for s in range(1, 101):
        clock.advance(0.01)
        loop_step(hook, "step=%d loss=%.4f lr=0.0003" % (s, 4.0 / s))
    clock.advance(30)
    hook.tick(STATE)  # interval: the 100 steps
    for s in range(101, 1401):
        loop_step(hook, "step=%d loss=%.4f" % (s, 4.0 / s))
    clock.advance(30)
    hook.tick(STATE)  # 1,300 steps: thinned to 500
    hook.close(STATE)
    got = beats(out)
    assert [b["reason"] for b in got] == ["start", "interval", "interval", "final"]
    assert got[0]["points"] == {"time": [], "step": [], "thinned": 0, "dropped": 0}
    assert got[1]["points"]["step"] == list(range(1, 101)) and got[1]["points"]["thinned"] == 0
    assert got[1]["points"]["loss"] == [round(4.0 / s, 4) for s in range(1, 101)]
    assert got[1]["points"]["time"][0] == 1_700_000_000.01
    third = got[2]["points"]
    assert len(third["step"]) == 500 and third["thinned"] == 800 and third["step"][0] == 101
    assert third["step"][-1] == 1400 and "lr" not in third
    assert got[3]["points"]["step"] == []
    for b in got:
        assert validate(b) == []
        jsonschema.validate(b, load_schema())


def test_the_records_the_agent_lost_between_two_beats_are_counted():
    log = PointLog(limit=20)
    for p in records(30):
        log.add({"loss": p[2]["loss"]}, p[1], p[0] / 1000.0)
    pts, dropped = log.take()
    got = beat_points(pts, dropped)
    assert got["dropped"] == 10 and got["step"] == list(range(11, 31))


def golden_beat(**points):
    with open(__file__.replace("unit/test_heartbeat_points.py", "golden/heartbeat/heartbeat.json")) as f:
        doc = json.load(f)
    doc["points"] = points
    return doc


@pytest.mark.parametrize("points,problem", [
    ({"time": [1.0, 2.0], "step": [1]}, "points.step must be a list as long as points.time (2)"),
    ({"time": [1.0], "step": [1], "loss": [1.0, 2.0]}, "points.loss must be a list as long as points.time (1)"),
    ({"time": [1.0]}, "points.step: required"),
    ({"step": [1]}, "points.time must be a list"),
    ({"time": [1.0] * (MAX_BEAT_POINTS + 1), "step": [1] * (MAX_BEAT_POINTS + 1)}, "points: at most 10000 records"),
    ({"time": [1.0], "step": [-1]}, "points.step[0]: must be >= 0"),
    ({"time": [1.0], "step": [1], "loss": ["lots"]}, "points.loss[0]: must be exactly one of"),
    ({"time": ["soon"], "step": [1]}, "points.time[0]: must be number, not string"),
])
def test_a_bad_points_section_is_refused_with_its_place(points, problem):
    errs = validate(golden_beat(**points))
    assert errs and any(e.startswith(problem) for e in errs), errs


def test_a_beat_without_points_or_with_null_is_valid():
    doc = golden_beat()
    assert validate(dict(doc, points=None)) == []
    del doc["points"]
    assert validate(doc) == []  # an older agent


class Posts:
    """The tracker sink's HTTP session, recording each request's beats."""

    def __init__(self):
        self.bodies = []

    def post(self, url, data, headers, timeout):
        self.bodies.append(json.loads(data))

        class Answer:
            status_code = 200
            text = "{}"
        return Answer()

    def close(self):
        pass


def test_the_tracker_sink_cuts_a_backlog_into_requests_that_fit():
    sink = TrackerSink("http://127.0.0.1:9", environ={"ONBOX_TRACKER_TOKEN": "t"}, max_request_bytes=48 * 1024)
    sink._http = posts = Posts()
    backlog = [golden_beat(**beat_points(records(500, start=1 + 500 * k))) for k in range(6)]
    for k, b in enumerate(backlog):
        b["seq"] = k
    size = len(json.dumps(backlog[0], separators=(",", ":")))
    assert 16 * 1024 < size < 21 * 1024
    sink.send(backlog)
    assert [[b["seq"] for b in body["heartbeats"]] for body in posts.bodies] == [[0, 1], [2, 3], [4, 5]]
    posts.bodies.clear()
    sink.max_request_bytes = 1000  # a beat larger than a request goes alone
    sink.send(backlog[:2])
    assert [[b["seq"] for b in body["heartbeats"]] for body in posts.bodies] == [[0], [1]]
