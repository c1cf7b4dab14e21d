"""One bad beat can no longer break the tracker (a real `onboxctl tracker serve` process).

Before: one authenticated beat `{"gpus": {"temp": 1e400}}` was stored (json.loads turns 1e400 into inf, the
store wrote it back as `Infinity`), and from then on GET /api/v1/runs and the run's heartbeats answered 500 to
everyone, also after a restart. Now such a beat is refused at the door (400, with the reason), every section is
checked against heartbeat.schema.json, and a bad row already in the database is skipped and counted.
"""
from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys

import pytest
import requests

from tests.conftest import subprocess_env
from tests.hosts.tracker import TrackerProcess

pytestmark = pytest.mark.integration


def beat(seq, run="good", **extra):
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": "b", "attempt": 0, "seq": seq, "time": 1.0e9 + seq,
           "state": "running", "interval_s": 30.0, "progress": {"step": seq, "loss": 2.0}}
    doc.update(extra)
    return doc


def post_raw(t, text):
    return requests.post(t.url + "/api/v1/heartbeats", data=text.encode(), headers=dict(
        t.headers(), **{"Content-Type": "application/json"}), timeout=10)


def get(t, path, **params):
    return requests.get(t.url + path, params=params, headers=t.headers(), timeout=10)


POISON = [  # (raw JSON of one beat's extra sections, what the 400 must name)
    ('"gpus": {"temp": 1e400}', "out of range"),
    ('"gpus": {"gpus": [{"temperature_c": -1e999}]}', "out of range"),
    ('"alerts": [{"code": "x", "data": {"v": NaN}}]', "NaN is not JSON"),
    ('"host": {"load_average": [Infinity]}', "Infinity is not JSON"),
    ('"gpus": {"available": true, "gpus": [{"temperature_c": "hot"}]}', "gpus.gpus[0].temperature_c"),
    ('"disks": [{"free_bytes": "lots"}]', "disks[0].free_bytes"),
    ('"child": {"alive": "yes"}', "child.alive"),
    ('"spool": {"backlog": 1.5}', "spool.backlog"),
    ('"slurm": {"restart_count": -2}', "slurm.restart_count"),
    ('"alerts": [{"severity": "warning"}]', "alerts[0].code"),
]


def test_poison_beats_are_refused_and_reads_stay_up_across_a_restart(tracker):
    t = tracker
    assert t.post([beat(1)]).status_code == 200
    base = json.dumps(beat(2, run="poison"))[:-1]
    for extra, reason in POISON:
        r = post_raw(t, '{"heartbeats": [%s, %s}]}' % (json.dumps(beat(3)), base + ", " + extra))
        assert r.status_code == 400, (extra, r.status_code, r.text)
        assert reason in r.json()["error"], (extra, r.json())
        if "index" in r.json():
            assert r.json()["index"] == 1
    assert get(t, "/api/v1/runs/poison/heartbeats").json()["heartbeats"] == []  # nothing of it was stored
    assert get(t, "/api/v1/runs/good/heartbeats").json()["heartbeats"][-1]["seq"] == 1  # nor its batch-mate
    for _ in range(2):
        r = get(t, "/api/v1/runs")
        assert r.status_code == 200 and [x["run"] for x in r.json()["runs"]] == ["good"]
        assert r.json()["skipped_rows"] == 0
        t.kill()
        t.start()


def _plant(db, run, doc_text, received="1e9", seq=7):
    """What an older tracker (or a hand-edited database) left: rows written straight into SQLite."""
    con = sqlite3.connect(db)
    with con:
        con.execute("INSERT INTO beats (run, attempt, seq, time, received, state, doc) VALUES (?,?,?,?,?,?,?)",
                    (run, 0, seq, 1.0, 1.0e9, "running", doc_text))
        con.execute("INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?)",
                    (run, "b", 0, seq, 1.0, received, 30.0, "running"))
    con.close()


def test_bad_rows_already_stored_are_skipped_and_counted(tracker):
    t = tracker
    for i in range(3):
        assert t.post([beat(i)]).status_code == 200
    t.stop()
    poisoned = json.dumps(beat(7, run="oldpoison", gpus={"temp": float("inf")}))  # allow_nan: `Infinity`, as before
    assert "Infinity" in poisoned
    _plant(t.db, "oldpoison", poisoned)
    _plant(t.db, "garbage", "{not json")
    _plant(t.db, "alist", "[1, 2, 3]")
    _plant(t.db, "badclock", json.dumps(beat(7, run="badclock")), received="yesterday")
    for i, text in enumerate(("Infinity", json.dumps(beat(9, run="good")))):  # a bad page in the middle of a run
        con = sqlite3.connect(t.db)
        with con:
            con.execute("INSERT INTO beats (run, attempt, seq, time, received, state, doc) VALUES (?,?,?,?,?,?,?)",
                        ("good", 0, 5 + 4 * i, 1.0, 1.0e9, "running", text))
        con.close()
    t.start()

    r = get(t, "/api/v1/runs")
    assert r.status_code == 200, r.text
    doc = r.json()
    runs = {x["run"]: x for x in doc["runs"]}
    # a run whose newest document is unreadable stays listed without it; one whose columns are wrong is skipped
    assert set(runs) == {"good", "garbage", "alist", "oldpoison"}
    assert runs["oldpoison"]["latest"] is None and runs["oldpoison"]["liveness"] == "silent"
    assert runs["good"]["latest"]["seq"] == 2
    assert doc["skipped_rows"] == 4  # oldpoison, garbage, alist (their newest docs), badclock (its received)

    page = get(t, "/api/v1/runs/good/heartbeats", limit=4)
    assert page.status_code == 200
    assert [b["seq"] for b in page.json()["heartbeats"]] == [0, 1, 2]
    assert page.json()["skipped_rows"] == 1 and page.json()["next_after"] == 5  # the cursor moves past the bad row
    rest = get(t, "/api/v1/runs/good/heartbeats", after=5).json()
    assert [b["seq"] for b in rest["heartbeats"]] == [9]
    r = get(t, "/api/v1/runs/oldpoison/heartbeats")
    assert r.status_code == 200 and r.json()["heartbeats"] == [] and r.json()["skipped_rows"] == 1
    assert requests.get(t.url + "/healthz", timeout=10).json()["skipped_rows"] >= 6
    assert "skipping unreadable stored" in t.log()

    # the controller's own reader: `onboxctl status` shows the good run and exits 0
    r = subprocess.run([sys.executable, "-m", "controller", "status", "--json", "--tracker", t.url,
                        "--tracker-token-file", t.token_file], env=subprocess_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(x["run"] for x in json.loads(r.stdout)["runs"]) == ["alist", "garbage", "good", "oldpoison"]


def test_database_wal_and_shm_are_private(tmp_path):
    """The tracker creates its database 0600 (SQLite gives the WAL and SHM the same mode) and narrows an old
    one that was world-readable."""
    t = TrackerProcess(str(tmp_path / "tr")).start()
    try:
        assert t.post([beat(1)]).status_code == 200
        for suffix in ("", "-wal", "-shm"):
            assert stat.S_IMODE(os.stat(t.db + suffix).st_mode) == 0o600, suffix
    finally:
        t.stop()
    os.chmod(t.db, 0o644)
    t.start()
    try:
        assert stat.S_IMODE(os.stat(t.db).st_mode) == 0o600
        assert t.post([beat(2)]).status_code == 200
        for suffix in ("-wal", "-shm"):
            assert stat.S_IMODE(os.stat(t.db + suffix).st_mode) == 0o600, suffix
    finally:
        t.stop()
