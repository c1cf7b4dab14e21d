"""`onboxctl stop BOX RUN` against a real OpenSSH box (tests/hosts/sshd_box.py), the real onbox.pyz, a real agent and
a real trainer (tests/integration/keep_trainer.py: checkpoints every 5 steps, and on SIGTERM saves the step it is in
and exits 0): the stop is the agent's checkpoint-then-exit, --wait reports the final state and the newest durable
checkpoint, and a run that has ended, a run the box does not have and a box that does not answer are each one
clear line with a non-zero exit.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from onbox.proc import start_time
from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.sshd_box import close_masters
from tests.polling import wait_for
from tests.processes import kill_exact

pytestmark = pytest.mark.integration

TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "keep_trainer.py")


@pytest.fixture
def ctl_env(tmp_path):
    cm = tempfile.mkdtemp(prefix="os", dir="/tmp")
    yield subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def ctl(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def state(box, run):
    try:
        with open(os.path.join(box.home, ".onbox", "runs", run, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def committed(box, run):
    """The steps of the run's committed checkpoints on the box's durable dir (a MANIFEST.json each)."""
    d = os.path.join(box.home, "durable", run, "checkpoints")
    out = []
    for name in os.listdir(d) if os.path.isdir(d) else []:
        try:
            with open(os.path.join(d, name, "MANIFEST.json")) as f:
                out.append(json.load(f).get("step"))
        except (OSError, ValueError):
            continue
    return sorted(s for s in out if isinstance(s, int))


def kill_leftovers(box, runs):
    """The agent and trainer of each run still alive, by PID and start time (never a recycled PID)."""
    for run in runs:
        st = state(box, run)
        for pid_key, start_key in (("agent_pid", "agent_start_time"), ("child_pid", "child_start_time")):
            pid, start = st.get(pid_key), st.get(start_key)
            if isinstance(pid, int) and isinstance(start, int):
                kill_exact(pid, start)


def launch(env, tmp_path, run):
    r = ctl(env, "run", "b1", "--name", run, "--durable", "/root/durable", "--workdir", str(tmp_path),
            "--heartbeat-interval", "1", "--sync-interval", "0.3", "--set", "settle_seconds=0.3",
            "--set", "notice_source=none", "--max-restarts", "0", "--", sys.executable, TRAINER,
            "--steps", "100000", "--interval", "0.05", "--save-every", "5", "--trace", str(tmp_path / "trace.jsonl"))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_stop_is_the_agents_checkpoint_then_exit_and_says_what_happened(sshd_box, ctl_env, tmp_path, onbox_pyz):
    e = sshd_box.inventory_entry()
    add = ["box", "add", "b1", "--host", e["host"], "--port", str(e["port"]), "--user", "root",
           "--identity", e["identity"], "--python", e["python"]]
    for o in e["options"]:
        add += ["--ssh-option", o]
    assert ctl(ctl_env, *add).returncode == 0
    assert ctl(ctl_env, "push", "b1", "--pyz", onbox_pyz).returncode == 0
    try:
        # --wait: the trainer checkpoints on the stop, the agent commits it, and the end is reported
        launch(ctl_env, tmp_path, "st")
        wait_for(lambda: committed(sshd_box, "st"), 60, "a first durable checkpoint", 0.1)
        child = state(sshd_box, "st")["child_pid"]
        t0 = time.monotonic()
        r = ctl(ctl_env, "stop", "b1", "st", "--wait", "--grace", "20")
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stdout + r.stderr
        st = state(sshd_box, "st")
        assert st["state"] == "stopped" and not st.get("agent_alive", False)
        assert start_time(child) is None  # the trainer has exited
        newest = committed(sshd_box, "st")[-1]
        lines = r.stdout.splitlines()
        assert lines[0].startswith("b1/st: stop asked: the trainer checkpoints (grace 20 s)"), r.stdout
        assert lines[1].startswith("b1/st: stopped after "), r.stdout
        assert lines[2] == "  newest durable checkpoint: step_%06d.ckpt (step %d) in /root/durable/st" % (
            newest, newest), r.stdout
        assert took < 20, took  # the trainer saved and exited at its first step boundary, not at the grace
        assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 1  # one start: a stop is not followed by a restart
        with open(os.path.join(sshd_box.home, ".onbox", "runs", "st", "events.jsonl")) as f:
            events = [json.loads(x) for x in f if x.strip()]
        assert any(ev["type"] == "preemption_notice" and ev.get("source") == "stop" for ev in events), events

        # a run that has ended: nothing to stop, exit 1, one line saying so
        r = ctl(ctl_env, "stop", "b1", "st")
        assert r.returncode == 1 and "run st on b1 has already ended (stopped): nothing to stop" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        r = ctl(ctl_env, "stop", "b1", "st", "--json")
        assert r.returncode == 1 and r.stdout == ""

        # a run the box does not have: the agent's own refusal, exit 2
        r = ctl(ctl_env, "stop", "b1", "nosuch")
        assert r.returncode == 2 and "onbox stop nosuch on b1: no run named nosuch" in r.stderr, r.stderr

        # without --wait: returns once the agent has the request; the agent stops the run on its own
        launch(ctl_env, tmp_path, "st2")
        wait_for(lambda: state(sshd_box, "st2").get("state") == "running", 60, "st2 running", 0.1)
        r = ctl(ctl_env, "stop", "b1", "st2", "--json", "--grace", "15")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["outcome"] == "asked" and doc["grace"] == 15 and doc["wait_s"] == 45, doc
        assert doc["state"] in ("running", "stopping"), doc
        wait_for(lambda: state(sshd_box, "st2").get("state") == "stopped", 60, "st2 stopped by its agent", 0.1)
        r = ctl(ctl_env, "stop", "b1", "st2", "--wait", "--json")
        assert r.returncode == 1 and "has already ended (stopped)" in r.stderr

        # the box does not answer: exit 3, one line naming it
        sshd_box.stop()
        r = ctl(ctl_env, "stop", "b1", "st2", timeout=60)
        assert r.returncode == 3 and "cannot reach box b1" in r.stderr and "hint:" in r.stderr, r.stderr
    finally:
        kill_leftovers(sshd_box, ("st", "st2"))
