"""Delivery that loses nothing: a real agent loop pushes to a real tracker process.

- the tracker is SIGKILLed and restarted mid-run: every seq arrives exactly once, in order;
- a partition between a box in a network namespace and the tracker: the job goes on, the backlog arrives after
  the link returns.

Time is scaled down through parameters: heartbeat interval 50 ms, request timeout 1-10 s, backoff cap 0.5 s. The
partition lasts PARTITION_S (6 s: ~120 heartbeat intervals and a dozen backoff cycles, i.e. more beats queued
behind the cut than a minute-long partition at the default 30 s interval); the minute-long partition the issue
names runs too (marked slow).
"""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.tracker import TrackerProcess
from tests.polling import wait_for

RUN = "hbtest"




def start_agent(tmp_path, url, token_file, wrap=lambda argv: argv, request_timeout=1.0):
    run_dir = tmp_path / "run"
    stop = tmp_path / "stop"
    result = tmp_path / "result.json"
    argv = [sys.executable, "-m", "tests.hosts.heartbeat_agent", "--run-dir", str(run_dir), "--name", RUN,
            "--tracker", url, "--token-file", token_file, "--interval", "0.05", "--stop-file", str(stop),
            "--result", str(result), "--request-timeout", str(request_timeout)]
    with open(tmp_path / "agent.log", "wb") as log:
        proc = subprocess.Popen(wrap(argv), env=subprocess_env(), cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    return proc, run_dir, stop, result


def finish_agent(proc, stop, result, tmp_path, timeout=90.0):
    stop.write_text("")
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    assert rc == 0, (tmp_path / "agent.log").read_text()[-3000:]
    return json.loads(result.read_text())


def spool_backlog(run_dir):
    d = run_dir / "heartbeats" / "spool-tracker"
    try:
        return sum(1 for n in os.listdir(d) if n[0].isdigit())
    except FileNotFoundError:
        return 0


def progress_step(run_dir):
    try:
        return json.loads((run_dir / "progress.json").read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


def assert_exactly_once_in_order(tracker: TrackerProcess, res: dict):
    first, n = res["first_seq"], res["next_seq"] - res["first_seq"]
    beats = wait_for(lambda: (lambda b: b if len(b) >= n else None)(tracker.all_heartbeats(RUN)), timeout=60,
                 what="%d beats at the tracker" % n)
    seqs = [b["seq"] for b in beats]
    assert seqs == list(range(first, first + n)), "missing or duplicated seqs"
    db = sqlite3.connect("file:%s?mode=ro" % tracker.db, uri=True)
    try:
        received = [r[0] for r in db.execute("SELECT received FROM beats WHERE run=? ORDER BY seq", (RUN,))]
        rows = db.execute("SELECT COUNT(*), COUNT(DISTINCT seq) FROM beats WHERE run=?", (RUN,)).fetchone()
    finally:
        db.close()
    assert rows == (n, n)
    assert received == sorted(received), "beats were stored out of order"
    assert beats[-1]["state"] == "done" and beats[-1]["reason"] == "final"


@pytest.mark.integration
def test_tracker_killed_and_restarted_every_seq_once_in_order(tracker, tmp_path):
    proc, run_dir, stop, result = start_agent(tmp_path, tracker.url, tracker.token_file)
    try:
        wait_for(lambda: len(tracker.all_heartbeats(RUN)) >= 10, what="first beats")
        tracker.kill()  # SIGKILL: no goodbye, a request may be cut mid-way
        wait_for(lambda: spool_backlog(run_dir) >= 10, what="beats spooled while the tracker is down")
        tracker.start()
        wait_for(lambda: spool_backlog(run_dir) == 0, what="the backlog drained", timeout=60)
        wait_for(lambda: len(tracker.all_heartbeats(RUN)) >= 40, what="more beats")
        tracker.kill(sig=15)  # and a graceful stop
        wait_for(lambda: spool_backlog(run_dir) >= 5, what="beats spooled again")
        tracker.start()
        res = finish_agent(proc, stop, result, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert res["backlog"] == 0
    assert_exactly_once_in_order(tracker, res)


def _partition(netns_host, tmp_path, seconds):
    tr = TrackerProcess(str(tmp_path / "tracker"), host=netns_host.host_ip)
    tr.start()
    proc = None
    try:
        proc, run_dir, stop, result = start_agent(tmp_path, tr.url, tr.token_file, wrap=netns_host.argv,
                                                  request_timeout=10.0)
        wait_for(lambda: len(tr.all_heartbeats(RUN)) >= 5, what="first beats from the box")
        netns_host.cut()
        at_cut = len(tr.all_heartbeats(RUN))
        step_at_cut = progress_step(run_dir)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the agent died during the partition"
            time.sleep(0.1)
        # nothing crossed the cut (one request may have been in flight), and the job kept going
        assert len(tr.all_heartbeats(RUN)) <= at_cut + 1
        assert spool_backlog(run_dir) >= 10
        assert progress_step(run_dir) > step_at_cut + 50
        netns_host.restore()
        res = finish_agent(proc, stop, result, tmp_path)
        # a request into the cut blocks for its 10 s timeout: the job's loop must never have waited for one
        assert res["max_tick_s"] < 5.0, "a tick blocked on the network"
        assert res["backlog"] == 0
        assert_exactly_once_in_order(tr, res)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        tr.stop()


@pytest.mark.integration
@pytest.mark.root
def test_partition_job_undisturbed_backlog_arrives(netns_host, tmp_path):
    _partition(netns_host, tmp_path, float(os.environ.get("HEARTBEAT_PARTITION_S", "6")))


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.slow
def test_partition_for_a_minute(netns_host, tmp_path):
    _partition(netns_host, tmp_path, 60.0)
