"""The tracker's store: dedupe on (run, attempt, seq), newest beat per run, liveness, thinning."""
from __future__ import annotations

from controller.tracker.store import Store, liveness


def beat(seq, attempt=0, run="r1", state="running", loss=2.0, interval=30.0):
    return {"schema": "onbox.heartbeat/1", "run": run, "box": "b", "attempt": attempt, "seq": seq, "time": 1.0 + seq,
            "state": state, "interval_s": interval, "progress": {"step": seq * 10, "loss": loss}}


class Now:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_dedupe_and_order(tmp_path):
    now = Now()
    st = Store(str(tmp_path / "t.db"), now=now)
    assert st.add([beat(0), beat(1)]) == (2, 0)
    assert st.add([beat(1), beat(2)]) == (1, 1)
    assert [b["seq"] for b in st.heartbeats("r1")] == [0, 1, 2]
    assert [b["seq"] for b in st.heartbeats("r1", after=0, limit=1)] == [1]
    [run] = st.runs()
    assert run["seq"] == 2 and run["liveness"] == "ok"


def test_liveness_late_silent_ended():
    assert liveness("running", 0.0, 30.0, 59.0) == "ok"
    assert liveness("running", 0.0, 30.0, 61.0) == "late"
    assert liveness("running", 0.0, 30.0, 151.0) == "silent"
    assert liveness("done", 0.0, 30.0, 10**6) == "ended"


def test_runs_liveness_uses_tracker_clock(tmp_path):
    now = Now()
    st = Store(str(tmp_path / "t.db"), now=now)
    st.add([beat(0, interval=10.0)])
    now.t += 25
    assert st.runs()[0]["liveness"] == "late"
    now.t += 30
    assert st.runs()[0]["liveness"] == "silent"


def test_old_beat_does_not_replace_newer(tmp_path):
    st = Store(str(tmp_path / "t.db"), now=Now())
    st.add([beat(5)])
    st.add([beat(3)])
    assert st.runs()[0]["seq"] == 5


def test_thinning_keeps_metric_points_and_newest(tmp_path):
    now = Now()
    st = Store(str(tmp_path / "t.db"), now=now)
    st.add([beat(i, loss=1.0 + i) for i in range(25)])
    now.t += 100
    thinned = st.thin(older_than_s=50, keep_every=10)
    assert thinned == 25 - 3 - 1  # seq 0, 10, 20 kept whole, and the newest (24)
    beats = st.heartbeats("r1", limit=100)
    assert len(beats) == 25
    b7 = beats[7]
    assert b7["thinned"] and b7["progress"]["step"] == 70 and b7["progress"]["loss"] == 8.0
    assert "thinned" not in beats[10] and "thinned" not in beats[24]


def test_replacement_box_is_not_a_duplicate_and_becomes_latest(tmp_path):
    st = Store(str(tmp_path / "t.db"), now=Now())
    st.add([beat(100 + i, attempt=3) for i in range(3)])  # the old box, fourth attempt
    # the replacement box: a fresh run dir, attempt 0 again, seq from its wall clock (larger)
    assert st.add([beat(5000, attempt=0), beat(5001, attempt=0)]) == (2, 0)
    assert st.runs()[0]["seq"] == 5001 and st.runs()[0]["attempt"] == 0
    assert [b["seq"] for b in st.heartbeats("r1", after=101)] == [102, 5000, 5001]


def test_only_a_runs_newest_beat_keeps_its_log_tail(tmp_path):
    st = Store(str(tmp_path / "t.db"), now=Now())

    def tailed(seq, run="r1"):
        return dict(beat(seq, run=run), log_tail={"lines": ["line %d" % seq], "lines_total": seq + 1, "redacted": 0})

    def tails(run="r1"):
        return {b["seq"]: (b.get("log_tail") or {}).get("lines") for b in st.heartbeats(run)}

    st.add([tailed(0), tailed(1), tailed(2), tailed(0, run="r2")])  # a backlog arriving at once
    assert tails() == {0: None, 1: None, 2: ["line 2"]} and tails("r2") == {0: ["line 0"]}
    st.add_many([[tailed(3)], [tailed(4)]])  # two requests in one group commit
    assert tails() == {0: None, 1: None, 2: None, 3: None, 4: ["line 4"]}
    st.add([tailed(5)])  # a newer head: the one it replaces drops its tail
    assert tails()[4] is None and tails()[5] == ["line 5"]
    assert st.add([tailed(4)]) == (0, 1)  # a resent beat is a duplicate: nothing changes
    assert tails()[4] is None and tails()[5] == ["line 5"]
    st.add([tailed(9)])
    st.add([dict(tailed(7), seq=7)])  # a late beat, older than the head: stored without its tail
    assert tails()[7] is None and tails()[9] == ["line 9"] and tails()[5] is None
    [r1] = [r for r in st.runs() if r["run"] == "r1"]
    assert r1["latest"]["log_tail"]["lines"] == ["line 9"] and r1["latest"]["progress"]["step"] == 90
