"""A run's deadline through the real agent (`onbox run --foreground --deadline 12s`) and a pure-Python trainer that
checkpoints (keep_trainer.py) with a mounted durable dir: the checkpoint is asked for before the deadline (at
deadline - (grace + commit + margin)), the newest checkpoint is committed, the run exits 75 `session_limit` with
how to continue, and a relaunch resumes from it. A trainer that ignores SIGTERM is killed a grace later and the
newest complete checkpoint it saved is still committed before the wall."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tests.integration.supervisor_helpers import events, onbox, state
from tests.processes import kill_test_processes

pytestmark = pytest.mark.integration
TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keep_trainer.py")
DEADLINE_S = 12.0
KNOBS = {"ONBOX_DEADLINE_MARGIN": "2", "ONBOX_SETTLE_SECONDS": "0.3", "ONBOX_SYNC_INTERVAL": "0.5"}


def run_until_deadline(home, tmp_path, *trainer_args: str):
    argv = ["run", "--foreground", "--name", "dl", "--deadline", "%gs" % DEADLINE_S, "--grace", "3",
            "--restart", "never", "--ckpt-dir", str(tmp_path / "ck"), "--durable", str(tmp_path / "dur"),
            "--", sys.executable, TRAINER, "--steps", "100000", "--interval", "0.05", "--save-every", "5",
            "--trace", str(tmp_path / "trace.jsonl"), *trainer_args]
    t0 = time.time()
    r = onbox(home, *argv, timeout=DEADLINE_S + 30, env_extra=KNOBS)
    return r, t0, time.time()


def config(home, name="dl"):
    with open(os.path.join(str(home), "runs", name, "config.json")) as f:
        return json.load(f)


def durable_latest(home, name="dl"):
    with open(os.path.join(str(home), "runs", name, "checkpoint_status.json")) as f:
        return (json.load(f).get("latest_durable") or {}).get("name")


def trace(tmp_path):
    with open(tmp_path / "trace.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_a_deadline_asks_for_the_checkpoint_in_time_commits_exits_75_and_a_relaunch_resumes(tmp_path):
    home = tmp_path / "home"
    try:
        r, t0, t1 = run_until_deadline(home, tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 75, out
        at = config(home)["deadline_at"]
        assert config(home)["deadline_source"] == "flag" and t0 + DEADLINE_S - 1 <= at <= t0 + DEADLINE_S + 5
        assert t1 < at, "the agent outlived its deadline"
        evs = events(home, "dl")
        notice = [e for e in evs if e["type"] == "preemption_notice"]
        assert notice and notice[0]["source"] == "session_limit"
        asked = next(e for e in evs if e["type"] == "signal_forwarded")["time"]
        assert asked <= at - (3.0 + 2.0), "the checkpoint was asked for too late"  # grace + margin at least
        assert not [e for e in evs if e["type"] == "escalated"]  # it checkpointed on the signal and exited
        final = [e for e in evs if e["type"] == "final_checkpoint"][-1]
        assert final["time"] <= at - 2.0 and (final["summary"] or {}).get("name")
        st = state(home, "dl")
        last = st["last_exit"]
        assert st["state"] == "preempted" and last["classification"] == "session_limit"
        committed = durable_latest(home)
        assert committed and committed in last["hint"] and last["hint"].startswith("relaunch to continue")
        assert st["deadline"]["source"] == "flag" and st["deadline"]["asked_at"] is not None
        stopped_at = trace(tmp_path)
        # the relaunch computes its own deadline (12 s from now) and resumes from the committed checkpoint
        r2, t2, _ = run_until_deadline(home, tmp_path)
        assert r2.returncode == 75, r2.stdout + r2.stderr
        assert config(home)["deadline_at"] >= t2 + DEADLINE_S - 1
        starts = [t for t in trace(tmp_path) if "start" in t]
        assert len(starts) == 2 and len(stopped_at) == 1
        assert starts[1]["resume"] and os.path.basename(starts[1]["resume"]) == committed
        assert starts[1]["start"] > 0
        status = onbox(home, "status", "dl")
        assert "deadline:" in status.stdout and "session_limit" in status.stdout, status.stdout
    finally:
        kill_test_processes(str(home), settle=0.0)


@pytest.mark.slow
def test_a_trainer_that_ignores_the_signal_is_killed_and_its_newest_checkpoint_committed_before_the_wall(tmp_path):
    home = tmp_path / "home"
    try:
        r, _t0, t1 = run_until_deadline(home, tmp_path, "--ignore-term")
        assert r.returncode == 75, r.stdout + r.stderr
        at = config(home)["deadline_at"]
        assert t1 < at, "the agent outlived its deadline"
        evs = events(home, "dl")
        kills = [e for e in evs if e["type"] == "escalated" and e.get("signal") == "SIGKILL"]
        asked = next(e for e in evs if e["type"] == "signal_forwarded")["time"]
        assert kills and kills[0]["time"] - asked <= 3.0 + 1.0  # a grace after the ask
        last = state(home, "dl")["last_exit"]
        assert last["classification"] == "session_limit" and "Signal 9" in last["message"]
        committed = durable_latest(home)
        assert committed, "no checkpoint was committed"
        saved = sorted(n for n in os.listdir(tmp_path / "ck") if n.endswith(".ckpt"))
        assert committed == saved[-1]  # the newest complete checkpoint it saved before the KILL
        finals = [e for e in evs if e["type"] == "final_checkpoint"]
        assert finals and all(e["time"] <= at - 2.0 for e in finals)
    finally:
        kill_test_processes(str(home), settle=0.0)
