"""The trainer's points in the tracker, in-process on a real SQLite store: a beat's `points` become rows of the
points table (once, whatever the resends), its document keeps their count, and read_trainer serves them as columns
paged by the beats' ids (never half a beat's); a row it would never write is served as nulls and counted."""
from __future__ import annotations

import json
import sqlite3

from controller.tracker.series import TRAINER_COLUMNS, read_trainer, series_body
from controller.tracker.store import Store
from onbox.heartbeat.points import beat_points


def trainer(st, run, after=-1, limit=100000, python=False):
    """read_trainer's answer, the points parsed from their JSON (which must parse); by default both checks of the
    stored columns (SQLite's and Python's) must give it."""
    got = read_trainer(st, run, after, limit, python=python)
    if not python:
        assert got == read_trainer(st, run, after, limit, python=True)
    points = json.loads(got.pop("points_json"))
    assert list(points) == list(TRAINER_COLUMNS) and len({len(col) for col in points.values()}) == 1
    return dict(got, points=points)


def beat(seq, steps, run="r1", attempt=0, eval_every=0, **extra):
    """A beat whose points are the records of `steps` (a loss each, an eval_loss every `eval_every` steps)."""
    recs = []
    for s in steps:
        recs.append([1_700_000_000_000 + s * 100, s, {"loss": round(4.0 / (1 + s / 100.0), 6), "lr": 3e-4}])
        if eval_every and s % eval_every == 0:
            recs.append([1_700_000_000_000 + s * 100 + 1, s, {"eval_loss": 3.0}])
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": "gpu1", "attempt": attempt, "seq": seq,
           "time": 1_700_000_000.0 + seq * 30, "state": "running", "interval_s": 30.0,
           "progress": {"step": steps[-1] if steps else None}, "points": beat_points(recs)}
    doc.update(extra)
    return doc


def test_points_are_stored_once_whatever_the_resends_and_the_document_keeps_their_count(tmp_path):
    st = Store(str(tmp_path / "t.db"))
    b1, b2 = beat(1, list(range(1, 301)), eval_every=100), beat(2, list(range(301, 651)))
    assert st.add([b1]) == (1, 0)
    assert st.add([b1, b2]) == (1, 1)  # the first resent (its ack was lost): stored once, its points too
    assert st.add([b2]) == (0, 1)
    got = trainer(st, "r1")
    p = got["points"]
    assert [s for s, loss in zip(p["step"], p["loss"]) if loss is not None] == list(range(1, 651))
    assert [s for s, e in zip(p["step"], p["eval_loss"]) if e is not None] == [100, 200, 300]
    assert p["seq"] == [1] * 303 + [2] * 350 and p["attempt"] == [0] * 653
    assert p["time"][0] == 1_700_000_000.1 and p["lr"][0] == 3e-4
    assert p["samples_per_s"] == [None] * 653  # a field no record carried
    assert got["more"] is False and got["next_after"] > 0
    assert trainer(st, "r1", after=got["next_after"])["points"]["seq"] == []
    stored = st.heartbeats("r1")
    assert [b["points"] for b in stored] == [{"records": 303, "thinned": 0, "dropped": 0},
                                             {"records": 350, "thinned": 0, "dropped": 0}]


def pages_of(st, run, limit):
    pages, after = [], -1
    while True:
        got = trainer(st, run, after=after, limit=limit)
        pages.append(got["points"]["step"])
        after = got["next_after"]
        if not got["more"]:
            return pages


def test_a_page_ends_on_a_beat_boundary_and_the_next_goes_on_from_there(tmp_path):
    st = Store(str(tmp_path / "t.db"))
    st.add([beat(k, list(range(k * 400 + 1, k * 400 + 401))) for k in range(25)])  # 25 beats x 400 points
    assert [len(p) for p in pages_of(st, "r1", 10_000)] == [10_000]  # exactly one page
    # a beat larger than a page (the API's least limit is the most a beat may carry: only in-process) comes whole
    assert [len(p) for p in pages_of(st, "r1", 100)] == [400] * 25
    st.add([beat(100 + k, list(range(20_001 + k * 300, 20_301 + k * 300)), run="r2") for k in range(40)])
    pages = pages_of(st, "r2", 10_000)
    assert [len(p) for p in pages] == [9_900, 2_100]  # the 34th beat would straddle the first page: it opens the next
    assert [s for p in pages for s in p] == list(range(20_001, 32_001))


def test_late_beats_from_a_spool_arrive_after_the_cursor_and_runs_stay_apart(tmp_path):
    """A backlog delivered after newer beats (a box cut off, then back): its points come with the next poll, by
    the beats' ids, which only grow, although their seqs are lower than those already read."""
    st = Store(str(tmp_path / "t.db"))
    st.add([beat(5, [50, 51]), beat(1, [9], run="r2")])
    first = trainer(st, "r1")
    assert first["points"]["step"] == [50, 51]
    st.add([beat(3, [30, 31]), beat(4, [40])])
    late = trainer(st, "r1", after=first["next_after"])
    assert late["points"]["step"] == [30, 31, 40] and late["points"]["seq"] == [3, 3, 4]
    assert trainer(st, "r2")["points"]["step"] == [9]
    assert trainer(st, "none")["points"]["step"] == [] and trainer(st, "none")["next_after"] == -1


def test_values_that_are_not_finite_numbers_are_gaps(tmp_path):
    st = Store(str(tmp_path / "t.db"))
    b = beat(1, [1, 2, 3])
    b["points"]["loss"] = [1.5, "NaN", "Infinity"]
    b["points"]["step"] = [1, None, 3]
    st.add([b])
    p = trainer(st, "r1")["points"]
    assert p["loss"] == [1.5, None, None] and p["step"] == [1, None, 3]


def test_a_beat_of_an_older_agent_has_no_points_and_its_document_is_as_sent(tmp_path):
    st = Store(str(tmp_path / "t.db"))
    old = beat(1, [1])
    del old["points"]
    st.add([old, dict(beat(2, [2]), points=None)])
    assert trainer(st, "r1")["points"]["step"] == []
    stored = st.heartbeats("r1")
    assert "points" not in stored[0] and stored[1]["points"] is None


def test_the_series_body_carries_the_trainer_block_only_when_asked():
    series = {"points_json": '{"seq":[]}', "run": "r1", "events": [], "next_after": -1, "more": False,
              "skipped_rows": 0}
    plain = json.loads(series_body(dict(series), {"summary": None}))
    assert "trainer" not in plain and plain["points"] == {"seq": []}
    both = json.loads(series_body(dict(series), {"summary": None},
                                  {"points_json": '{"step":[1]}', "next_after": 7, "more": True}))
    assert both["trainer"] == {"points": {"step": [1]}, "next_after": 7, "more": True, "skipped_rows": 0}
    assert both["run"] == "r1" and both["summary"] is None


def test_a_row_the_store_would_never_write_is_served_as_nulls_and_counted(tmp_path):
    st = Store(str(tmp_path / "t.db"))
    st.add([beat(1, [1, 2]), beat(2, [3, 4]), beat(3, [5]), beat(4, [6, 7])])
    db = sqlite3.connect(str(tmp_path / "t.db"))
    db.execute("UPDATE points SET loss='[1,2}]' WHERE seq=1")  # would break the answer's JSON
    db.execute("UPDATE points SET lr='[1]', step='{\"a\": 1}', loss='[1.5e+300,-2.5e-07]' WHERE seq=2")
    db.execute("UPDATE points SET n='one' WHERE seq=3")
    db.execute("UPDATE points SET tokens_per_s=7 WHERE seq=4")
    db.commit()
    got = trainer(st, "r1")
    assert got["points"]["step"] == [1, 2, None, None, 6, 7]
    assert got["points"]["loss"] == [None, None, 1.5e300, -2.5e-07, 3.773585, 3.738318]
    assert got["points"]["lr"] == [3e-4, 3e-4, None, None, 3e-4, 3e-4] and got["points"]["tokens_per_s"][4:] == [None] * 2
    assert got["skipped_rows"] == 5 and got["more"] is False
    assert trainer(st, "r1", after=got["next_after"])["points"]["step"] == []
    # what SQLite's JSON parser takes and the store never writes: a number past a double (Python's check refuses it)
    db.execute("UPDATE points SET loss='[1e400,2]' WHERE seq=4")
    db.commit()
    db.close()
    strict = trainer(st, "r1", python=True)
    assert strict["points"]["loss"][4:] == [None, None] and strict["skipped_rows"] == 6
