"""Multi-node over plain SSH boxes, for real: two network-namespace boxes on one bridged subnet, each with its own
sshd; `onboxctl run b0 b1 --nodes` starts one agent per box and a real `torchrun` (CPU, gloo) on each that
all-reduces every step, rank 0 (on node 0) saving checkpoints that node 0's agent commits. SIGTERM to node 1's
agent (a preemption of node 1) stops BOTH nodes cleanly: node 1's agent tells node 0's over the authenticated UDP
notice, both trainers stop at the same step, node 0 commits the stop-step checkpoint, both runs end `preempted`.
`onboxctl run b0 b1 --nodes --name mn` again (from the recorded runs) relaunches both: every rank resumes from the
step after node 0's committed checkpoint (node 1 restores it read-only from node 0's durable run dir) and runs to
the end."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from onbox.proc import start_time
from tests.checkpoint_files import committed_steps
from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.sshd_box import BridgeNet, close_masters
from tests.polling import wait_for
from tests.processes import kill_exact

pytestmark = [pytest.mark.integration, pytest.mark.slow]
torch = pytest.importorskip("torch")

RUN = "mn"
STEPS = 10


def _state(box, run):
    try:
        with open(os.path.join(box.home, ".onbox", "runs", run, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _lines(box, run):
    try:
        with open(os.path.join(box.home, ".onbox", "runs", run, "output.log")) as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _events(box, run):
    with open(os.path.join(box.home, ".onbox", "runs", run, "events.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def _committed_steps(durable):
    return committed_steps(durable, RUN)


def test_two_ssh_boxes_preempted_on_one_node_stop_together_and_resume_together(netns_boxes, tmp_path, onbox_pyz):
    import psutil

    boxes = netns_boxes(2)
    cm = tempfile.mkdtemp(prefix="omn", dir="/tmp")
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    durable = str(tmp_path / "durable")
    os.makedirs(durable)

    def ctl(*args, check=True):
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                           timeout=120)
        if check and r.returncode != 0:
            pytest.fail("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args[:6]), r.returncode, r.stdout, r.stderr))
        return r

    try:
        for k, box in enumerate(boxes):
            e = box.inventory_entry()
            add = ["box", "add", "b%d" % k, "--host", e["host"], "--port", str(e["port"]), "--user", "root",
                   "--identity", e["identity"], "--python", e["python"]]
            for o in e["options"]:
                add += ["--ssh-option", o]
            ctl(*add)
            os.makedirs(os.path.join(box.home, ".onbox"), exist_ok=True)
            shutil.copy(onbox_pyz, os.path.join(box.home, ".onbox", "onbox.pyz"))  # where `onboxctl push` puts it
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        trainer = os.path.join(REPO_ROOT, "tests", "integration", "mn_trainer.py")
        r = ctl("run", "b0", "b1", "--nodes", "--name", RUN, "--durable", durable, "--workdir", str(tmp_path),
                "--grace", "30", "--env", "GLOO_SOCKET_IFNAME=%s" % BridgeNet.IFNAME,
                "--set", "sync_interval=0.3", "--set", "tick_interval=0.2",
                "--set", "notice_source=none", "--json",
                "--", torchrun, "--nproc-per-node=1", trainer, "--steps", str(STEPS), "--save-every", "2",
                "--sleep", "0.1")
        runs = json.loads(r.stdout)["runs"]
        assert [(x["box"], x["name"], x["ok"]) for x in runs] == [("b0", RUN, True), ("b1", RUN + ".node1", True)]

        # both nodes train together: the all-reduce needs both ranks; node 0 commits rank 0's saves
        wait_for(lambda: any(x.get("step", -1) >= 1 for x in _lines(boxes[1], RUN + ".node1")), 90,
                 "node 1 to train past step 1")
        wait_for(lambda: _committed_steps(durable), 30, "node 0 to commit a checkpoint")
        first = [x for x in _lines(boxes[0], RUN) if x.get("event") == "start"]
        assert first and first[0]["world"] == 2 and first[0]["start"] == 0

        # a preemption of node 1 (SIGTERM to its agent), by the agent's PID and start time
        st1 = _state(boxes[1], RUN + ".node1")
        assert kill_exact(st1["agent_pid"], st1["agent_start_time"], signal.SIGTERM)  # that very agent
        wait_for(lambda: _state(boxes[0], RUN).get("state") == "preempted"
                 and _state(boxes[1], RUN + ".node1").get("state") == "preempted", 60, "both nodes preempted")
        ev0 = _events(boxes[0], RUN)
        notice = [e for e in ev0 if e["type"] == "preemption_notice"]
        assert notice and notice[0]["source"] == "peer:node1"
        stopped = {x["rank"]: x["step"] for n, b in ((RUN, boxes[0]), (RUN + ".node1", boxes[1]))
                   for x in _lines(b, n) if x.get("event") == "stopped"}
        assert set(stopped) == {0, 1} and stopped[0] == stopped[1], stopped  # the same step on both nodes
        final = [e for e in ev0 if e["type"] == "final_checkpoint"][-1]["summary"]
        assert final and final["step"] == stopped[0] == max(_committed_steps(durable))
        ev1 = _events(boxes[1], RUN + ".node1")
        assert not [e for e in ev1 if e["type"] == "checkpoint_committed"]  # node 1 never commits
        assert stopped[0] < STEPS - 1

        # relaunch the group from the recorded runs: both resume from node 0's committed step
        r = ctl("run", "b0", "b1", "--nodes", "--name", RUN, "--json")
        assert all(x["ok"] for x in json.loads(r.stdout)["runs"]), r.stdout
        wait_for(lambda: _state(boxes[0], RUN).get("state") == "done"
                 and _state(boxes[1], RUN + ".node1").get("state") == "done", 90, "both nodes done")
        for name, box in ((RUN, boxes[0]), (RUN + ".node1", boxes[1])):
            starts = [x for x in _lines(box, name) if x.get("event") == "start"]
            assert starts[-1]["start"] == stopped[0] + 1, (name, starts)
            assert starts[-1]["min_start"] == starts[-1]["max_start"] == stopped[0] + 1
            assert max(x["step"] for x in _lines(box, name) if "step" in x and "event" not in x) == STEPS - 1
        resumed = [e for e in _events(boxes[1], RUN + ".node1") if e["type"] == "checkpoint_resume"]
        assert resumed and resumed[-1]["step"] == stopped[0] and resumed[-1]["source"].startswith("node0:")
        assert max(_committed_steps(durable)) == STEPS - 1
    finally:  # a failed test leaves no agent, torchrun or worker behind: each agent's tree, by PID and start time
        for name, box in ((RUN, boxes[0]), (RUN + ".node1", boxes[1])):
            st = _state(box, name)
            pid = st.get("agent_pid")
            if pid and st.get("state") not in ("done", "failed", "preempted", "stopped") \
                    and start_time(pid) == st.get("agent_start_time"):
                try:
                    tree = [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]
                except psutil.Error:
                    tree = []
                for p in tree:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
        close_masters(cm)
        shutil.rmtree(cm, ignore_errors=True)
