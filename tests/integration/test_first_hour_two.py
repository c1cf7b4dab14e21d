"""The first hour, round two (issue 34, section 4): what the README journey met on a box of its own, each driven
through the real onboxctl (`python -m controller`) against a real sshd in a network namespace (tests/hosts/
sshd_box.py) running the real onbox.pyz: `logs -f` ended by Ctrl-C, where `status` read what it shows and how old
it is, a push after a pull, a refusal's words, what typing the box name to `down` does, and an unknown box or run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import pytest

from tests.conftest import default_sigint, subprocess_env
from tests.hosts.sshd_box import close_masters
from tests.hosts.terminal import down_on_a_terminal
from tests.polling import wait_for
from tests.processes import kill_exact

pytestmark = [pytest.mark.integration, pytest.mark.root]

# a trainer that says one line every 0.1 s: something for `logs -f` to follow
TICKER = "import itertools, sys, time\nfor i in itertools.count():\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n"


@pytest.fixture
def ctl_env(tmp_path):
    cm = tempfile.mkdtemp(prefix="o2", dir="/tmp")
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm,
                          "ONBOX_SSH_CONNECT_TIMEOUT": "5"})
    yield env
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def ctl(env: Dict[str, str], *args: str, timeout: float = 120, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)


def add_box(env: Dict[str, str], name: str, box, *extra: str) -> subprocess.CompletedProcess:
    e = box.inventory_entry()
    argv = ["box", "add", name, "--host", e["host"], "--port", str(e["port"]), "--user", "root",
            "--identity", e["identity"], "--python", e["python"], *extra]
    for o in e["options"]:
        argv += ["--ssh-option", o]
    return ctl(env, *argv)


def state(box, run: str) -> Dict:
    try:
        with open(os.path.join(box.home, ".onbox", "runs", run, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def kill_leftovers(box, runs: List[str]) -> None:
    for run in runs:
        st = state(box, run)
        for pid_key, start_key in (("agent_pid", "agent_start_time"), ("child_pid", "child_start_time")):
            pid, start = st.get(pid_key), st.get(start_key)
            if isinstance(pid, int) and isinstance(start, int):
                kill_exact(pid, start)


def pushed_box(env: Dict[str, str], box, pyz: str) -> None:
    r = add_box(env, "b1", box)
    assert r.returncode == 0, r.stdout + r.stderr
    r = ctl(env, "push", "b1", "--pyz", pyz)
    assert r.returncode == 0, r.stdout + r.stderr


def launch(env: Dict[str, str], box, tmp_path, run: str, *extra: str) -> None:
    trainer = tmp_path / "ticker.py"
    trainer.write_text(TICKER)
    r = ctl(env, "run", "b1", "--name", run, "--workdir", str(tmp_path), "--heartbeat-interval", "1",
            "--set", "notice_source=none", *extra, "--", sys.executable, str(trainer))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: state(box, run).get("state") == "running", 60, "run %s running" % run, 0.1)


# -- 1. `logs -f` ends with Ctrl-C: exit 0, quietly ----------------------------------------------------------------
def test_logs_follow_ended_by_ctrl_c_exits_0_quietly(netns_box, ctl_env, tmp_path, onbox_pyz):
    pushed_box(ctl_env, netns_box, onbox_pyz)
    try:
        launch(ctl_env, netns_box, tmp_path, "tk")
        p = subprocess.Popen([sys.executable, "-m", "controller", "logs", "b1", "tk", "-f"], env=ctl_env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=default_sigint)
        seen = b""
        while b"tick" not in seen:  # the follow is under way: lines arrive from the box
            chunk = p.stdout.read1(4096)
            assert chunk, "onboxctl logs -f ended before any line: %s" % p.stderr.read()
            seen += chunk
        os.kill(p.pid, signal.SIGINT)  # onboxctl alone, as `kill -INT`; a terminal's Ctrl-C reaches ssh too
        _, err = p.communicate(timeout=30)
        assert p.returncode == 0, (p.returncode, err)
        assert err == b"", err  # no "ended with exit 255", no "Aborted!"

        # beside it: a follow that the link ends (the box's sshd goes, and the session with it) is no Ctrl-C: it
        # says the box was lost, exit 3
        p = subprocess.Popen([sys.executable, "-m", "controller", "logs", "b1", "tk", "-f"], env=ctl_env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=default_sigint)
        seen = b""
        while b"tick" not in seen:
            chunk = p.stdout.read1(4096)
            assert chunk, "onboxctl logs -f ended before any line: %s" % p.stderr.read()
            seen += chunk
        netns_box.stop()
        _, err = p.communicate(timeout=60)
        assert p.returncode == 3 and b"cannot reach box b1" in err, (p.returncode, err)
    finally:
        kill_leftovers(netns_box, ["tk"])


# -- 2. `status` without a tracker: where it read, when, and BEAT by the box's own clock ----------------------------
def seq_mtime(box, run: str) -> float:
    return os.stat(os.path.join(box.home, ".onbox", "runs", run, "heartbeats", "seq.json")).st_mtime


def newest_news(box, run: str) -> float:
    """The newest thing the box recorded of the run: its last beat, state change or progress."""
    prog = {}
    try:
        with open(os.path.join(box.home, ".onbox", "runs", run, "progress.json")) as f:
            prog = json.load(f)
    except (OSError, ValueError):
        pass
    return max(t for t in (seq_mtime(box, run), state(box, run).get("updated_at"), prog.get("time"))
               if isinstance(t, (int, float)))


@pytest.mark.slow
def test_status_over_ssh_names_its_source_and_beat_is_the_newest_beat_on_the_box(netns_box, ctl_env, tmp_path,
                                                                                 onbox_pyz):
    pushed_box(ctl_env, netns_box, onbox_pyz)
    try:
        launch(ctl_env, netns_box, tmp_path, "bt")
        # beats every second, the last state change (running) well behind them: what BEAT used to show
        wait_for(lambda: seq_mtime(netns_box, "bt") - state(netns_box, "bt")["updated_at"] > 3, 60,
                 "beats 3 s past the run's last state change", 0.2)
        beat_before = seq_mtime(netns_box, "bt")
        r = ctl(ctl_env, "status", "--json")
        after = time.time()
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        [row] = [x for x in doc["runs"] if x["run"] == "bt"]
        assert doc["source"] == "ssh" and row["source"] == "ssh"
        assert row["age_s"] is not None and row["age_s"] <= after - beat_before, (row["age_s"], after - beat_before)

        r = ctl(ctl_env, "status")
        assert r.returncode == 0, r.stderr
        head = r.stdout.splitlines()[0]
        assert re.fullmatch(r"from the boxes over ssh, read \d\d:\d\d:\d\d \(BEAT: each run's newest beat or "
                            r"progress, by its box's clock\)", head), r.stdout
        assert r.stdout.splitlines()[1].startswith("BOX "), r.stdout

        # beside it: once the run has ended its beats stop, and BEAT grows from its last one (never a fresh 0s)
        assert ctl(ctl_env, "stop", "b1", "bt", "--wait", "--grace", "5").returncode == 0
        last = newest_news(netns_box, "bt")
        wait_for(lambda: time.time() - last > 3, 30, "3 s past the run's last beat", 0.2)
        before = time.time()
        doc = json.loads(ctl(ctl_env, "status", "--json").stdout)
        [row] = [x for x in doc["runs"] if x["run"] == "bt"]
        assert row["state"] == "stopped" and row["age_s"] >= before - last, (row, before - last)
    finally:
        kill_leftovers(netns_box, ["bt"])


# -- 3. `push --code .` after `pull ... ./results`: what pull brought home stays home -------------------------------
KEEP_TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keep_trainer.py")


def committed(box, run: str) -> List[str]:
    d = os.path.join(box.home, "durable", run, "checkpoints")
    return sorted(n for n in (os.listdir(d) if os.path.isdir(d) else [])
                  if os.path.exists(os.path.join(d, n, "MANIFEST.json")))


@pytest.mark.slow
def test_push_after_pull_leaves_the_pulled_checkpoints_home(netns_box, ctl_env, tmp_path, onbox_pyz):
    pushed_box(ctl_env, netns_box, onbox_pyz)
    code = tmp_path / "proj"
    (code / "outputs").mkdir(parents=True)
    (code / "train.py").write_text("print('hi')\n")
    (code / "outputs" / "mine.txt").write_text("not pulled: pushed like any file\n")
    try:
        r = ctl(ctl_env, "run", "b1", "--name", "pp", "--durable", "/root/durable", "--workdir", str(tmp_path),
                "--sync-interval", "0.3", "--set", "settle_seconds=0.3", "--set", "notice_source=none",
                "--max-restarts", "0", "--", sys.executable, KEEP_TRAINER, "--steps", "20", "--interval", "0.05",
                "--save-every", "5", "--trace", str(tmp_path / "trace.jsonl"))
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: state(netns_box, "pp").get("state") == "done", 90, "run pp done", 0.2)
        assert committed(netns_box, "pp")
        r = ctl(ctl_env, "pull", "b1", "pp", "./results", "--no-load", cwd=str(code))
        assert r.returncode == 0, r.stdout + r.stderr
        assert os.listdir(code / "results" / "pp" / "checkpoints")

        r = ctl(ctl_env, "push", "b1", "--code", ".", "--pyz", onbox_pyz, cwd=str(code))
        assert r.returncode == 0, r.stdout + r.stderr
        assert "push: left out what `onboxctl pull` brought home (its record, %s): ./results/pp/" % (
            os.path.join(ctl_env["ONBOX_CONFIG_DIR"], "pulls.json")) in r.stdout, r.stdout
        landed = os.path.join(netns_box.home, ".onbox", "code", "proj")
        sent = sorted(os.path.relpath(os.path.join(d, f), landed) for d, _, fs in os.walk(landed) for f in fs)
        assert sent == ["outputs/mine.txt", "train.py"], sent  # (results/ itself may land, empty)

        r = ctl(ctl_env, "push", "b1", "--code", ".", "--pyz", onbox_pyz, "--json", cwd=str(code))
        assert r.returncode == 0 and json.loads(r.stdout)["pulled_left_out"] == ["results/pp"], r.stdout + r.stderr
    finally:
        kill_leftovers(netns_box, ["pp"])


# -- 4. a refusal says "refused"; a run that never started is not named ---------------------------------------------
def test_a_refusal_says_refused_and_a_run_never_started_is_not_named(netns_box, ctl_env, tmp_path, onbox_pyz):
    # a box the inventory does not know (nor DNS): nothing started, and no run name is made up for it
    r = ctl(ctl_env, "run", "gpu2", "--", "python3", "train.py")
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stderr.startswith("gpu2: no run started: cannot reach box gpu2"), r.stderr
    assert "train-" not in r.stderr and "FAILED" not in r.stderr, r.stderr

    pushed_box(ctl_env, netns_box, onbox_pyz)
    try:
        launch(ctl_env, netns_box, tmp_path, "lv")
        # the same name while it runs: the agent refuses (exit 2), in its words, once
        r = ctl(ctl_env, "run", "b1", "--name", "lv", "--workdir", str(tmp_path), "--", sys.executable,
                str(tmp_path / "ticker.py"))
        assert r.returncode == 2, r.stdout + r.stderr
        first = r.stderr.splitlines()[0]
        assert first.startswith("b1: refused, nothing started: onbox run on b1: "), r.stderr
        assert "failed to start" not in first.lower() and "lv" in first, r.stderr
        # the same command without --name: this launch finds the live run and refuses to start a second one
        r = ctl(ctl_env, "run", "b1", "--workdir", str(tmp_path), "--heartbeat-interval", "1", "--set",
                "notice_source=none", "--", sys.executable, str(tmp_path / "ticker.py"))
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.startswith("b1: refused, nothing started: run lv of this command is still running on b1"), \
            r.stderr
        # beside them: a launch that is not refused still says what it started
        r = ctl(ctl_env, "run", "b1", "--name", "lv2", "--workdir", str(tmp_path), "--", sys.executable,
                str(tmp_path / "ticker.py"))
        assert r.returncode == 0 and r.stdout.startswith("b1: started run lv2 "), r.stdout + r.stderr
    finally:
        kill_leftovers(netns_box, ["lv", "lv2"])


# -- 5. `down`'s prompt says what typing the name does --------------------------------------------------------------
def test_down_says_what_typing_the_box_name_does(netns_box, ctl_env, onbox_pyz):
    r = add_box(ctl_env, "b1", netns_box, "--profile", "runpod")
    assert r.returncode == 0, r.stderr
    assert ctl(ctl_env, "push", "b1", "--pyz", onbox_pyz).returncode == 0
    rc, screen = down_on_a_terminal(ctl_env, "b1", "b1")
    assert rc == 0, screen
    assert ("Type the box name (b1) to show how to stop its meter (onboxctl stops and deletes nothing on the box: "
            "stopping the meter is yours to do): ") in screen, screen
    assert "teardown" not in screen.split("Type the box name")[1].split("\n")[0], screen
    assert "To stop the meter, terminate the pod" in screen.split("stopping the meter is yours to do): ")[1], screen
    assert netns_box.probe()  # the box still answers: nothing was torn down
    assert os.path.exists(os.path.join(netns_box.home, ".onbox", "onbox.pyz"))
    # beside it: a name typed wrong does nothing, and says so
    rc, screen = down_on_a_terminal(ctl_env, "b1", "b2")
    assert rc == 2 and "confirmation did not match 'b1': nothing done" in screen, screen


# -- 6. an unknown box or run, a token not sent, a box added without a look ----------------------------------------
def test_box_add_check_adds_only_a_box_that_answers(netns_box, ctl_env):
    inventory = os.path.join(ctl_env["ONBOX_CONFIG_DIR"], "boxes.toml")
    r = add_box(ctl_env, "b1", netns_box, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    v = "%d.%d.%d" % sys.version_info[:3]
    assert "box b1 answers over ssh: %s %s; no onbox.pyz yet (`onboxctl push b1`)" % (sys.executable, v) in r.stdout
    assert os.path.exists(inventory) and "b1" in ctl(ctl_env, "box", "ls").stdout

    e = netns_box.inventory_entry()
    # a port nothing listens on: ssh's word for it, exit 3, and no entry
    closed = ["box", "add", "b2", "--host", e["host"], "--port", "1", "--user", "root", "--identity", e["identity"],
              "--check"] + [w for o in e["options"] for w in ("--ssh-option", o)]
    r = ctl(ctl_env, *closed)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "cannot reach box b2" in r.stderr and "box b2 was not added to %s" % inventory in r.stderr, r.stderr
    # it answers, but its --python does not run: exit 3, and no entry
    r = add_box(ctl_env, "b3", netns_box, "--check", "--python", "/nonexistent/python3")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "box b3 answers, but its python /nonexistent/python3 does not run" in r.stderr, r.stderr
    assert "box b3 was not added" in r.stderr and "--python PATH" in r.stderr, r.stderr
    listed = [line.split()[0] for line in ctl(ctl_env, "box", "ls").stdout.splitlines()[1:]]
    assert listed == ["b1"], listed
    # without --check, as before: added without a connection
    r = ctl(ctl_env, *[w for w in closed if w != "--check"])
    assert r.returncode == 0 and "added box b2" in r.stdout, r.stdout + r.stderr


def test_an_unknown_box_or_run_is_said_with_the_command_that_lists_them(netns_box, ctl_env, tmp_path, onbox_pyz,
                                                                        tracker):
    pushed_box(ctl_env, netns_box, onbox_pyz)
    try:
        launch(ctl_env, netns_box, tmp_path, "lg")
        # a box that is not in the inventory, over ssh and from a tracker: unknown, exit 2, how to list them
        r = ctl(ctl_env, "status", "--box", "gpu2")
        assert r.returncode == 2 and "unknown box gpu2: it is not in the inventory" in r.stderr, r.stdout + r.stderr
        assert "`onboxctl box ls`" in r.stderr and "(no runs)" not in r.stdout, r.stderr
        r = ctl(ctl_env, "status", "--box", "gpu2", "--tracker", tracker.url, "--tracker-token-file",
                tracker.token_file)
        assert r.returncode == 2 and "the tracker %s has no runs from it" % tracker.url in r.stderr, r.stderr
        r = ctl(ctl_env, "status", "--box", "b1")  # beside it: a known box, its runs
        assert r.returncode == 0 and re.search(r"^b1 +lg +running", r.stdout, re.M), r.stdout + r.stderr

        # logs without a run: the box's runs; a run it does not have: the same, never the box-side `onbox ls`
        r = ctl(ctl_env, "logs", "b1")
        assert r.returncode == 2 and "which run? b1 has: lg (running)" in r.stderr, r.stderr
        assert "`onboxctl logs b1 lg`" in r.stderr, r.stderr
        r = ctl(ctl_env, "logs", "b1", "nosuch")
        assert r.returncode == 2 and "no run named nosuch on b1; it has: lg (running)" in r.stderr, r.stderr
        assert "onboxctl status --box b1" in r.stderr and "onbox ls" not in r.stderr, r.stderr
        r = ctl(ctl_env, "logs", "b1", "lg", "-n", "2")  # beside it: a run it has
        assert r.returncode == 0 and "tick" in r.stdout, r.stdout + r.stderr

        # a tracker that asks for a token: none sent is said so, a wrong one is refused
        r = ctl(ctl_env, "status", "--tracker", tracker.url)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "tracker %s asks for a token and none was sent (HTTP 401)" % tracker.url in r.stderr, r.stderr
        assert "--tracker-token-file FILE, ONBOX_TRACKER_TOKEN" in r.stderr, r.stderr
        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-the-token\n")
        r = ctl(ctl_env, "status", "--tracker", tracker.url, "--tracker-token-file", str(wrong))
        assert r.returncode == 2 and "refused the token (HTTP 401)" in r.stderr, r.stderr
    finally:
        kill_leftovers(netns_box, ["lg"])
