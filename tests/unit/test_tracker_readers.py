"""The readers of the tracker (controller/tracker/client.py, through controller/tracker/runview.py): each run of an answer
is checked on its own, so one bad run is said and never hides the others; an answer that cannot be read at all is
told apart from one that lists no run. And the tracker's own side of the same bound: a deep row an older tracker
stored marks its run in the list, is skipped in its history and on the dashboard, and the status table shows text
from beats with its control characters escaped."""
from __future__ import annotations

import json
import os
import sqlite3

import pytest

from controller.tracker.overview import Overview
from controller.tracker.pulled import PullsView
from controller.tracker.runview import (
    RunRow,
    check_runs,
    render_table,
    row_from_heartbeat,
    rows_from_tracker,
    view_of_answer,
)
from controller.tracker.store import Store

URL = "http://127.0.0.1:8787"


def beat(seq, run="good", **extra):
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": "b", "attempt": 0, "seq": seq, "time": 1.9e9 + seq,
           "state": "running", "interval_s": 30.0, "progress": {"step": seq, "loss": 2.0}}
    doc.update(extra)
    return doc


def nest(levels):
    doc = {}
    for _ in range(levels - 1):
        doc = {"x": doc}
    return doc


def entry(run="good", **kw):
    return dict({"run": run, "box": "b", "attempt": 0, "seq": 1, "state": "running", "age_s": 2.0,
                 "liveness": "ok", "latest": beat(1, run=run)}, **kw)


def body(*entries, **extra):
    return json.dumps(dict({"runs": list(entries)}, **extra)).encode()


def test_a_deep_beat_costs_its_run_that_beat_and_nothing_else():
    view = view_of_answer(URL, body(entry(), entry("deep", latest=beat(2, run="deep", x=nest(100))),
                                    entry("at64", latest=beat(2, run="at64", x=nest(63)))))
    assert view.answered and [e["run"] for e in view.runs] == ["good", "deep", "at64"]
    assert view.runs[1]["latest"] is None and view.runs[2]["latest"]["seq"] == 2  # the bound itself passes
    [s] = view.skipped
    assert (s.run, s.shown) == ("deep", True)
    assert s.describe() == "run 'deep': its newest beat nests more than 64 levels deep (listed without it)"
    rows = {r.run: r for r in rows_from_tracker(view.document())}
    assert rows["good"].step == 1 and rows["deep"].step is None and rows["deep"].state == "running"


@pytest.mark.parametrize("bad,says,shown", [
    ("text", "runs[1]: not an object (left out)", False),
    ({"box": "b"}, "runs[1]: names no run (left out)", False),
    (entry("../x"), "runs[1]: '../x' is not a run name (left out)", False),
    (entry("n\x1b[2Jx"), "runs[1]: 'n\\x1b[2Jx' is not a run name (left out)", False),
    (entry("wide", box=nest(70)), "run 'wide': its entry nests more than 64 levels deep (left out)", False),
    (entry("flat", latest=[1, 2]), "run 'flat': its newest beat is not an object (listed without it)", True),
    (entry("marked", latest=None, problem="its newest beat nests more than 64 levels deep\x1b]0;t\x07"),
     "run 'marked': its newest beat nests more than 64 levels deep\\x1b]0;t\\x07 (listed without it)", True),
])
def test_each_bad_entry_is_said_and_the_good_run_stays(bad, says, shown):
    view = view_of_answer(URL, body(entry(), bad, skipped_rows=2))
    assert view.answered
    assert view.runs[0] == entry()
    [s] = view.skipped
    assert s.describe() == says and s.shown is shown
    doc = view.document()
    assert [e["run"] for e in doc["runs"]] == (["good", bad["run"]] if shown else ["good"])
    assert doc["skipped_rows"] == 2 + (not shown)  # what the reader left out counts with the tracker's own


@pytest.mark.parametrize("raw,says", [
    (b'{"runs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "it nests more than 64 levels deep"),
    (b"<html>proxy error</html>", "answered something unreadable"),
    (b'{"error": "maintenance"}', "answered no run list"),
    (b'\xff\xfe{"runs": []}', "answered something unreadable"),
])
def test_an_answer_that_is_no_run_list_is_a_problem_not_an_empty_list(raw, says):
    view = view_of_answer(URL, raw)
    assert not view.answered and view.runs == [] and view.problem is not None
    assert says in view.problem.message and URL in view.problem.message


def test_a_run_list_from_an_older_tracker_nested_to_json_s_limit_is_still_read_run_by_run():
    # an older tracker took beats as deep as json.loads parses (~980 levels less the caller's stack): 600 leaves
    # room for a test runner's own frames (pytest-xdist's worker runs tests ~200 frames deep), far past the bound
    deep = "[" * 600 + "]" * 600
    raw = body(entry()).decode().replace('"runs": [', '"runs": [{"run": "old", "latest": {"x": %s}}, ' % deep)
    view = view_of_answer(URL, raw.encode())
    assert view.answered and [e["run"] for e in view.runs] == ["old", "good"]
    assert view.runs[0]["latest"] is None


def test_check_runs_keeps_a_well_formed_list_as_it_is():
    entries = [entry(), entry("b2", latest=None), entry("b3", latest=beat(5, run="b3", future={"k": [1, {"v": 2}]}))]
    runs, skipped = check_runs(entries)
    assert runs == entries and skipped == []


# -- the tracker's side: a deep row stored before the bound -------------------------------------------------------
def _plant(db, run, text, seq=7):
    con = sqlite3.connect(db)
    with con:
        con.execute("INSERT INTO beats (run, attempt, seq, time, received, state, doc, box) VALUES (?,?,?,?,?,?,?,?)",
                    (run, 0, seq, 1.9e9, 1000.0, "running", text, "b"))
        con.execute("INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?)",
                    (run, "b", 0, seq, 1.9e9, 1000.0, 30.0, "running"))
    con.close()


def test_a_deep_stored_row_marks_its_run_and_is_skipped_everywhere(tmp_path):
    db = str(tmp_path / "t.db")
    st = Store(db, now=lambda: 1001.0)
    st.add([beat(1)])
    _plant(db, "deep", json.dumps(beat(7, run="deep", extra=nest(100))))
    runs, skipped = st.runs_checked()
    by = {r["run"]: r for r in runs}
    assert by["deep"]["latest"] is None and by["deep"]["liveness"] == "ok"
    assert by["deep"]["problem"] == "its newest beat nests more than 64 levels deep"
    assert "problem" not in by["good"] and skipped == 1
    beats, skipped, nxt = st.heartbeats_checked("deep")
    assert beats == [] and skipped == 1 and nxt == 7  # the cursor moves past it
    overview = Overview(st, PullsView(str(tmp_path / "pulls.json"))).overview(-1)
    assert "good" in json.dumps(overview)
    view = view_of_answer(URL, json.dumps({"runs": runs, "skipped_rows": skipped}).encode())
    assert [s.describe() for s in view.skipped] == [
        "run 'deep': its newest beat nests more than 64 levels deep (listed without it)"]
    st.close()


# -- item 11: text from beats in the status table ------------------------------------------------------------------
def test_the_status_table_shows_control_characters_of_beat_text_as_escapes():
    row = row_from_heartbeat(beat(1, run="esc", box="gpu1\x1b]0;PWNED\x07", state="run\rning",
                                  alerts=[{"code": "x\x1b[1A", "message": "m\nFORGED\x1b[2J"}],
                                  checkpoint={"latest_durable": {"name": "ck\nFORGED", "step": 1}},
                                  phase={"name": "p\x1b[31m", "index": 0, "count": 2}), now=1.9e9 + 2)
    text = render_table([row, RunRow(box="b", run="plain", state="running")], now=1.9e9 + 2)
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert "gpu1\\x1b]0;PWNED\\x07" in text and "run\\x0dning" in text and "x\\x1b[1A" in text
    assert "ck\\x0aFORGED" in text and "p\\x1b[31m" in text
    assert "m FORGED\\x1b[2J" in text  # the alert's WARN line: one line, escaped
    assert len(text.splitlines()) == 4  # the header, two rows and the alert's WARN line: no forged line


def test_the_dashboard_writes_tracker_values_as_text_never_as_html():
    here = os.path.join(os.path.dirname(__file__), "..", "..", "controller", "tracker", "static", "dashboard.js")
    with open(here, encoding="utf-8") as f:
        js = f.read()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink
    assert js.count("textContent") >= 20


# -- the bound itself, as the tracker checks every beat (onbox/heartbeat/schema.py) -------------------------------
@pytest.mark.parametrize("extra,says", [
    ({"x": nest(63)}, None),  # 64 levels with the beat: the bound passes
    ({"x": nest(64)}, "x nests 65 levels deep, more than 64"),
    ({"x": [[[[nest(60)]]]]}, "x nests 65 levels deep, more than 64"),
    ({"points": {"time": [1.0] * 600, "step": list(range(600)), "loss": [2.0] * 600}}, None),
    ({"alerts": [{"code": "c", "data": nest(70)}]}, "alerts nests 73 levels deep, more than 64"),
    ({"x": "y" * 65500}, None),
    ({"x": "y" * 65536}, "the keys the schema does not name (x) hold 64.0 KiB, more than 64 KiB"),
])
def test_a_beat_is_bounded_in_depth_and_unknown_keys(extra, says):
    from collections import OrderedDict

    from onbox.heartbeat.schema import validate

    problems = validate(beat(1, **extra))
    assert problems == ([] if says is None else [says])
    if says and "nests" in says:  # a dict or list of another class nests the same (not only what json.loads makes)
        key = next(iter(extra))
        assert validate(OrderedDict(beat(1), **{key: _as_ordered(extra[key])})) == [says]


def _as_ordered(v):
    from collections import OrderedDict

    if isinstance(v, dict):
        return OrderedDict((k, _as_ordered(x)) for k, x in v.items())
    if isinstance(v, list):
        return [_as_ordered(x) for x in v]
    return v


@pytest.mark.parametrize("entry, age", [
    ({"read_at": 1000.0, "beat_at": 990.0}, 10.0),
    ({"read_at": 1000.0, "beat_at": 990.0, "updated_at": 995.0}, 5.0),  # the newest news counts
    ({"read_at": 1000.0, "beat_at": 2000.0}, 0.0),  # a beat newer than the read: 0 s, never negative
    ({"read_at": 1000.0, "beat_at": float("nan"), "updated_at": 980.0}, 20.0),  # no finite number: left out
    ({"read_at": 1000.0, "beat_at": float("inf")}, None),
    ({"read_at": 1000.0, "beat_at": "soon", "progress": {"time": [1]}}, None),  # not numbers at all
    ({"read_at": float("nan"), "beat_at": 990.0}, None),  # the read's time unknown: the caller's clock decides
    ({"beat_at": 990.0}, None),  # an agent too old to say read_at
    ({"read_at": 1000.0}, None),
])
def test_a_box_s_own_word_on_its_beat_age_is_read_as_a_number_or_not_at_all(entry, age):
    from controller.tracker.runview import box_age

    assert box_age(entry) == age
