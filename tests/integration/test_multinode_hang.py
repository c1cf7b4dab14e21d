"""A hang in a multi-node group over plain SSH boxes is restarted by the whole group, for real: two network-namespace
boxes with their own sshd, `onboxctl run b0 b1 --nodes`, a real `torchrun` (CPU, gloo) on each that all-reduces every
step; node 1's trainer prints no step (its ranks log nothing, as trainers that log from rank 0 only), so node 1's own
cadence can never judge it. Node 1's rank is SIGSTOPped: node 0's rank blocks in the all_reduce, node 0's agent judges
the hang (--hang-after 3), keeps its stacks, tells node 1 (an authenticated `restart` notice) and restarts; node 1's
agent takes its own stacks (the stopped rank's state in them), stops its attempt and restarts it; both resume from
node 0's committed checkpoint at the same step and train to the end.

The test signals only the rank it stopped (by pid AND start time, SIGCONTed at the end whatever happened); at the end
each agent's tree is killed if it still runs. The figures (stop -> detection on node 0 -> node 1 stopped -> first new
step) are printed with `-s`."""
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
from tests.checkpoint_files import committed_steps
from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.sshd_box import BridgeNet, close_masters
from tests.integration.test_hang_real import Stopped, descendants, env_of
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
torch = pytest.importorskip("torch")

RUN = "mnh"
STEPS = 40


def _run_file(box, run, name):
    return os.path.join(box.home, ".onbox", "runs", run, name)


def _state(box, run):
    try:
        with open(_run_file(box, run, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _lines(box, run):
    try:
        with open(_run_file(box, run, "output.log")) as f:
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


def _events(box, run, kind=None):
    try:
        with open(_run_file(box, run, "events.jsonl")) as f:
            evs = [json.loads(x) for x in f if x.strip()]
    except OSError:
        return []
    return [e for e in evs if kind is None or e["type"] == kind]


def test_a_hang_node0_judges_restarts_the_group_even_a_node_that_prints_no_step(netns_boxes, tmp_path, onbox_pyz):
    import psutil

    boxes = netns_boxes(2)
    names = ((RUN, boxes[0]), (RUN + ".node1", boxes[1]))
    cm = tempfile.mkdtemp(prefix="omh", dir="/tmp")
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    durable = str(tmp_path / "durable")
    os.makedirs(durable)
    stopped = Stopped()

    def ctl(*args):
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
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
            shutil.copy(onbox_pyz, os.path.join(box.home, ".onbox", "onbox.pyz"))
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        trainer = os.path.join(REPO_ROOT, "tests", "integration", "mn_trainer.py")
        r = ctl("run", "b0", "b1", "--nodes", "--name", RUN, "--durable", durable, "--workdir", str(tmp_path),
                "--grace", "30", "--env", "GLOO_SOCKET_IFNAME=%s" % BridgeNet.IFNAME, "--hang-after", "3",
                "--set", "sync_interval=0.3", "--set", "tick_interval=0.2", "--set", "notice_source=none",
                "--set", "backoff_initial=0.5", "--set", "term_timeout=2", "--json",
                "--", torchrun, "--nproc-per-node=1", trainer, "--steps", str(STEPS), "--save-every", "2",
                "--sleep", "0.2", "--steps-on-node0-only")
        assert all(x["ok"] for x in json.loads(r.stdout)["runs"]), r.stdout

        # both nodes train (node 0's steps need node 1's rank in every all_reduce); node 1 prints no step at all
        wait_for(lambda: any(x.get("step", -1) >= 6 for x in _lines(boxes[0], RUN)), 120, "node 0 past step 6")
        wait_for(lambda: committed_steps(durable, RUN), 30, "node 0 to commit a checkpoint")
        assert not [x for x in _lines(boxes[1], RUN + ".node1") if "step" in x]

        # node 1's rank stops: the group hangs in its all_reduce
        child = _state(boxes[1], RUN + ".node1")["child_pid"]
        rank1 = wait_for(lambda: next((p for p in descendants(child) if env_of(p).get("RANK") == "1"), None), 30,
                         "node 1's rank among its agent's descendants")
        stopped_at = time.time()
        stopped.stop(rank1)

        hang0 = wait_for(lambda: next(iter(_events(boxes[0], RUN, "hang_detected")), None), 60, "node 0's judgement")
        hang1 = wait_for(lambda: next(iter(_events(boxes[1], RUN + ".node1", "hang_detected")), None), 60,
                         "node 1 to act on node 0's word")
        wait_for(lambda: all(_state(b, n).get("state") == "done" for n, b in names), 180, "both nodes done")

        # node 0 judged and told; node 1 took its own stacks (the stopped rank in them) and restarted with it
        assert hang0["phase"] == "train" and "peer" not in hang0
        assert any(e["kind"] == "restart" and e["to"] == [1] for e in _events(boxes[0], RUN, "peer_notice_sent"))
        assert hang1["phase"] == "group" and hang1["peer"]["node"] == 0 and hang1["peer"]["stacks"] == hang0["stacks"]
        assert [e["kind"] for e in _events(boxes[1], RUN + ".node1", "peer_notice")] == ["restart"]
        with open(_run_file(boxes[1], RUN + ".node1", os.path.basename(hang1["stacks"]))) as f:  # the box's home
            text = f.read()
        assert "pid %d" % rank1 in text and "T (stopped)" in text, text[:3000]
        exits = [a["exit"] for a in _state(boxes[1], RUN + ".node1")["attempts"]]
        assert exits[0]["classification"] == "hung" and "node 0 judged it hung" in exits[0]["message"]
        assert _state(boxes[0], RUN)["attempts"][0]["exit"]["classification"] == "hung"
        assert not _events(boxes[1], RUN + ".node1", "peer_notice_sent")  # a peer's word is never sent on

        # the group's second attempt: every rank starts at the same step, after node 0's committed checkpoint
        resumed = [e for e in _events(boxes[1], RUN + ".node1", "checkpoint_resume")]
        assert resumed and resumed[-1]["source"].startswith("node0:")
        for name, box in names:
            starts = [x for x in _lines(box, name) if x.get("event") == "start"]
            assert len(starts) == 2 and starts[-1]["min_start"] == starts[-1]["max_start"] == starts[-1]["start"]
            assert starts[-1]["start"] == resumed[-1]["step"] + 1, (name, starts)
        assert max(x["step"] for x in _lines(boxes[0], RUN) if "step" in x and "event" not in x) == STEPS - 1

        (back,) = _events(boxes[0], RUN, "hang_recovered")  # node 0's first new step, after its detection
        print("\nstop -> node 0 judged it %.1f s later -> node 1 acted %+.2f s -> the group's first new step %.1f s "
              "after the judgement" % (hang0["time"] - stopped_at, hang1["time"] - hang0["time"], back["after_s"]))
    finally:
        stopped.release()
        for name, box in names:
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
