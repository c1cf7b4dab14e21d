"""Property: whatever beats a token holder posts (random bodies, and near-valid beats with deep or large unknown
keys, junk sections, control characters, run names of other runs), the tracker answers a 2xx or a 4xx with one
line, never a 500; and its run list, read back through the controller's own reader (controller/tracker/runview.py), is
always readable, skips nothing (the tracker takes nothing its readers refuse: one bound), keeps the good run with
its newest beat, and renders as a status table with no control character in it.

Through the real app and store in-process (starlette's TestClient); the real server is
tests/integration/test_bad_inputs_tracker.py.
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Dict

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controller.tracker.app import create_app
from controller.tracker.hosts import AllowedHosts
from controller.tracker.runview import render_table, rows_from_tracker, view_of_answer
from controller.tracker.store import open_store

with warnings.catch_warnings():  # starlette 1.x would rather have httpx2; httpx is what this venv has
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TOKEN = "t0ken"
AUTH = {"Authorization": "Bearer " + TOKEN}
GOOD = {"schema": "onbox.heartbeat/1", "run": "good", "box": "b", "attempt": 0, "seq": 1, "time": 1.9e9,
        "state": "running", "interval_s": 30.0, "progress": {"step": 1, "loss": 2.0}}

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 70), st.floats(allow_nan=False,
                                                                                    allow_infinity=False),
                      st.text(max_size=8))
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                       max_size=3), max_leaves=12)


def nest(levels: int, leaf: Any = None) -> Any:
    doc: Any = leaf if leaf is not None else {}
    for i in range(levels - 1):
        doc = {"x": doc} if i % 2 else [doc]
    return doc


deep = st.builds(nest, st.integers(1, 130), json_leaf)
big = st.sampled_from([0, 100, 30000, 65000, 66000, 70000]).map(lambda n: "x" * n)
odd_text = st.one_of(st.text(max_size=12), st.sampled_from(["gpu1\x1b]0;PWNED\x07", "a\nb", "\r", "\x00", "é" * 300,
                                                            "x" * 257]))
sections = ["child", "progress", "checkpoint", "gpus", "host", "disks", "alerts", "spool", "preemption", "deadline",
            "lease", "phase", "node", "log_tail", "points", "slurm"]
changes = st.dictionaries(
    st.one_of(st.sampled_from([*sections, "run", "box", "state", "seq", "attempt", "time", "interval_s"]),
              st.text(min_size=1, max_size=6)),
    st.one_of(json_any, deep, big, odd_text, st.sampled_from(["good", "other", 5, -1, 2 ** 53])), max_size=3)


@st.composite
def near_valid(draw: Any) -> Dict[str, Any]:
    """The good beat's shape under another run (or the good run itself, later), with up to three keys changed:
    most draws are one step from being stored, where a missing bound would let a beat through."""
    doc = dict(GOOD, run=draw(st.sampled_from(["other", "good", "third"])), seq=draw(st.integers(2, 10 ** 6)))
    doc.update(draw(changes))
    if draw(st.booleans()):
        doc.setdefault("alerts", [{"code": draw(odd_text)[:64] or "x", "message": draw(odd_text),
                                   "data": draw(st.one_of(json_any, deep))}])
    return doc


# the beat of issue 30: valid in every section, one unknown key nested around the bound (it blinded every reader)
around_the_bound = st.builds(lambda run, seq, key, levels: dict(GOOD, run=run, seq=seq, **{key: nest(levels)}),
                             st.sampled_from(["other", "good"]), st.integers(2, 10 ** 6),
                             st.sampled_from(["extra", "future", "x"]), st.integers(55, 130))
bodies = st.one_of(
    st.lists(near_valid(), min_size=1, max_size=3).map(lambda bs: json.dumps({"heartbeats": bs}).encode()),
    around_the_bound.map(lambda b: json.dumps({"heartbeats": [b]}).encode()),
    st.lists(near_valid(), min_size=1, max_size=3).map(lambda bs: json.dumps({"heartbeats": bs}).encode()),
    json_any.map(lambda v: json.dumps({"heartbeats": [v]}).encode()),
    st.binary(max_size=64),
    st.integers(1, 5000).map(lambda n: b'{"heartbeats": [' + b"[" * n + b"]" * n + b"]}"),
)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    store = open_store(str(tmp_path_factory.mktemp("fuzz") / "t.db"))
    app = create_app(store, TOKEN, thin_every_s=0, allowed_hosts=AllowedHosts("127.0.0.1"))
    with TestClient(app, base_url="http://127.0.0.1:8787") as c:
        assert c.post("/api/v1/heartbeats", json={"heartbeats": [GOOD]}, headers=AUTH).status_code == 200
        yield c
    store.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=bodies)
def test_no_beat_breaks_the_tracker_or_hides_a_run_from_its_readers(client, raw):
    r = client.post("/api/v1/heartbeats", content=raw, headers=dict(AUTH, **{"Content-Type": "application/json"}))
    assert r.status_code in (200, 400, 413), (r.status_code, r.text[:300])
    if r.status_code != 200:
        assert "\n" not in r.json()["error"]
    event("stored" if r.status_code == 200 else "refused")

    listed = client.get("/api/v1/runs", headers=AUTH)
    assert listed.status_code == 200
    view = view_of_answer("http://127.0.0.1:8787", listed.content)
    assert view.answered, view.problem
    assert view.skipped == []  # the tracker took nothing its readers refuse
    runs = {e["run"]: e for e in view.runs}
    assert isinstance(runs["good"]["latest"], dict)
    rows = rows_from_tracker(view.document())
    table = render_table(rows)
    assert "good" in table and "\x1b" not in table and "\x07" not in table
    warned = sum(len(r.alert_details) for r in rows)  # a WARN line under its run for each alert the agent raised
    assert sum(1 for line in table.splitlines()) == len(view.runs) + 1 + warned  # no forged line
    for run in runs:
        assert client.get("/api/v1/runs/%s/heartbeats" % run, headers=AUTH).status_code == 200
        assert client.get("/api/v1/runs/%s/series" % run, headers=AUTH).status_code == 200
    assert client.get("/api/v1/overview", headers=AUTH).status_code == 200
