"""The trainer's points over real HTTP, against a real `onboxctl tracker serve`: the agent's tracker sink delivers
a backlog of beats with their points (cut into requests that fit), `/series?points_after=` serves every record
paged by the beats' ids, a resent beat adds no point, bad points and bad query values are a 400, and a page that
does not ask gets the answer it got before points existed."""
from __future__ import annotations

import pytest
import requests

from onbox.heartbeat.points import beat_points
from onbox.heartbeat.sinks import TrackerSink
from tests.hosts.tracker import TrackerProcess

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0


def beat(seq, steps, run="r1", **extra):
    recs = [[int((T0 + s) * 1000), s, {"loss": round(4.0 / (1 + s / 100.0), 6), "tokens_per_s": 1000.0 + s}]
            for s in steps]
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": "gpu1", "attempt": 0, "seq": seq, "time": T0 + seq * 30,
           "state": "running", "interval_s": 30.0, "progress": {"step": steps[-1] if steps else None},
           "points": beat_points(recs)}
    doc.update(extra)
    return doc


def test_every_record_of_a_delivered_backlog_is_served_once_in_pages(tmp_path):
    t = TrackerProcess(str(tmp_path / "tracker")).start()
    h = t.headers()

    def series(run="r1", **params):
        r = requests.get(t.url + "/api/v1/runs/%s/series" % run, params=params, headers=h, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        # 60 beats x 400 records (a trainer at 13 steps/s with 30 s beats) spooled while the tracker was away
        backlog = [beat(k, list(range(k * 400 + 1, k * 400 + 401))) for k in range(60)]
        sink = TrackerSink(t.url, t.token_file)
        for start in range(0, 60, 20):
            sink.send(backlog[start:start + 20])  # the sender's batches (its batch size is 100; 20 here)
        sink.send(backlog[10:30])  # a batch resent whose acknowledgement was lost
        sink.close()
        steps, after, pages = [], -1, 0
        while True:
            got = series(after=-1, points_after=after, points_limit=10_000)
            steps += got["trainer"]["points"]["step"]
            assert len(got["trainer"]["points"]["step"]) % 400 == 0  # whole beats only
            after, pages = got["trainer"]["next_after"], pages + 1
            if not got["trainer"]["more"]:
                break
        assert steps == list(range(1, 24_001)) and pages == 3
        whole = series(points_after=-1)["trainer"]
        assert whole["points"]["loss"][:2] == [3.960396, 3.921569] and whole["more"] is False
        assert whole["points"]["tokens_per_s"][-1] == 25_000.0 and whole["points"]["time"][0] == T0 + 1
        assert set(whole["points"]) == {"seq", "attempt", "time", "step", "loss", "eval_loss", "lr", "tokens_per_s",
                                        "samples_per_s", "epoch", "steps_per_s"}
        # the beats themselves: one per beat as before, their documents keep the count of their records
        plain = series()
        assert "trainer" not in plain and plain["points"]["step"] == [k * 400 + 400 for k in range(60)]
        stored = requests.get(t.url + "/api/v1/runs/r1/heartbeats", params={"limit": 1}, headers=h, timeout=10)
        assert stored.json()["heartbeats"][0]["points"] == {"records": 400, "thinned": 0, "dropped": 0}
        # a poll with the cursor: nothing new, then one new beat's records
        assert series(after=59, points_after=whole["next_after"])["trainer"]["points"]["step"] == []
        assert t.post([beat(60, [24_001, 24_002])]).status_code == 200
        new = series(after=59, points_after=whole["next_after"])
        assert new["trainer"]["points"]["step"] == [24_001, 24_002] and new["points"]["seq"] == [60]
    finally:
        t.stop()


def test_bad_points_and_bad_query_values_are_a_400_and_nothing_is_stored(tmp_path):
    t = TrackerProcess(str(tmp_path / "tracker")).start()
    h = t.headers()
    try:
        short = beat(1, [1, 2])
        short["points"]["loss"] = [1.0]
        r = t.post([beat(0, [0]), short])
        assert r.status_code == 400 and r.json()["index"] == 1
        assert "points.loss must be a list as long as points.time (2)" in r.json()["error"]
        huge = beat(1, [1])
        huge["points"] = {"time": [T0] * 10_001, "step": list(range(10_001)), "thinned": 0, "dropped": 0}
        r = t.post([huge])
        assert r.status_code == 400 and "points: at most 10000 records a beat" in r.json()["error"]
        nan = beat(1, [1])
        nan["points"]["loss"] = ["lots"]
        assert t.post([nan]).status_code == 400
        got = requests.get(t.url + "/api/v1/runs/r1/series", params={"points_after": -1}, headers=h, timeout=10)
        assert got.json()["trainer"]["points"]["step"] == [] and got.json()["points"]["seq"] == []
        for params in ({"points_after": "-2"}, {"points_after": "x"}, {"points_after": "0", "points_limit": "9999"},
                       {"points_after": "0", "points_limit": "200001"}):
            r = requests.get(t.url + "/api/v1/runs/r1/series", params=params, headers=h, timeout=10)
            assert r.status_code == 400 and r.json()["error"], (params, r.text)
        r = requests.get(t.url + "/api/v1/runs/r1/series", params={"points_after": -1}, timeout=10)
        assert r.status_code == 401  # reads need the token or the cookie, as every read
    finally:
        t.stop()
