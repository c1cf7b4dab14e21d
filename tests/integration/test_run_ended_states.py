"""Every reader of a run's state agrees on which states mean the run ended (onbox/vocab.py's terminal set): a fenced
run's beats through a real `onboxctl tracker serve` read ended, in the tracker's rows, the dashboard's overview and
`onboxctl status`, not SILENT; a live run that stops beating still reads SILENT (issue 34: the tracker's own ended set
lacked `fenced`)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests

from tests.conftest import subprocess_env
from tests.hosts.tracker import TrackerProcess
from tests.polling import wait_for

pytestmark = pytest.mark.integration

INTERVAL = 0.05  # the beats' interval: a run that stops beating reads SILENT 5 intervals after its last beat


def beat(run, state):
    return {"schema": "onbox.heartbeat/1", "run": run, "box": "gpu1", "attempt": 0, "seq": 1, "time": time.time(),
            "state": state, "interval_s": INTERVAL, "progress": {"step": 7, "loss": 1.5}}


@pytest.fixture()
def tracker(tmp_path):
    t = TrackerProcess(str(tmp_path / "tracker")).start()
    try:
        yield t
    finally:
        t.stop()


def rows(tracker, path="/api/v1/runs"):
    r = requests.get(tracker.url + path, headers=tracker.headers(), timeout=10)
    assert r.status_code == 200, r.text
    return {row["run"]: row for row in r.json()["runs"]}


def ctl_status(tracker, tmp_path, *extra):
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg")})
    r = subprocess.run([sys.executable, "-m", "controller", "status", "--tracker", tracker.url, "--tracker-token-file",
                        tracker.token_file, *extra], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r.stdout


def test_a_fenced_run_reads_ended_and_a_live_run_that_stops_beating_reads_silent(tracker, tmp_path):
    assert tracker.post([beat("fenced-run", "fenced"), beat("live-run", "running"),
                         beat("done-run", "done")]).status_code == 200
    # the live run's beats stop: once it reads silent, the fenced run's last beat is as old
    wait_for(lambda: rows(tracker)["live-run"]["liveness"] == "silent", 30, "the live run reads silent")
    runs = rows(tracker)
    assert runs["fenced-run"]["liveness"] == "ended" and runs["done-run"]["liveness"] == "ended"
    overview = rows(tracker, "/api/v1/overview")
    assert overview["fenced-run"]["liveness"] == "ended" and overview["live-run"]["liveness"] == "silent"

    doc = json.loads(ctl_status(tracker, tmp_path, "--json"))
    by_run = {r["run"]: r for r in doc["runs"]}
    assert by_run["fenced-run"]["liveness"] == "ended" and by_run["live-run"]["liveness"] == "silent"
    table = {line.split()[1]: line for line in ctl_status(tracker, tmp_path).splitlines() if line.startswith("gpu1 ")}
    assert "SILENT" in table["live-run"] and "fenced" in table["fenced-run"]
    assert "SILENT" not in table["fenced-run"] and "SILENT" not in table["done-run"]
