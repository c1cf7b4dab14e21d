"""The same `onboxctl run` line again continues its run (issue 22): real sshd boxes (tests/hosts/sshd_box.py: the
box's /root private, the durable dir a path every box shares, as a mounted durable target), the real onbox.pyz and
agents, and a pure-Python trainer that checkpoints every 5 steps and resumes from ONBOX_RESUME_FROM
(tests/integration/keep_trainer.py; every start is appended to a trace file with the box and its first step).

- on one box: launched without --name (a new run, said so), the same line while it runs is refused (exit 2, what
  to do), a preemption (SIGTERM to the agent, by PID and start time) and the same line again resumes it under the
  same name at the newest durable step, saying `resuming <run> from step <S>`; --new, another durable target and
  another command are new runs, each saying why;
- a run that ended done: the same line is a new run, saying so; the released lease says how it ended;
- a fan-out (two boxes, one line): the same line again resumes each box's own run;
- replacement boxes that never saw the run: after a preemption the launch log and the durable target find it and
  it resumes there; with the lost box cut off but its agent alive (its lease live) the launch is refused until
  --take-over, then it resumes on a third box and the old agent ends fenced.
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
from typing import Any, Dict, List

import pytest

from tests.checkpoint_files import committed_steps
from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.sshd_box import SshdBox, _need_root_tools, close_masters
from tests.polling import wait_for
from tests.processes import kill_exact, start_ticks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "keep_trainer.py")
TERMINAL = ("done", "failed", "preempted", "stopped", "fenced")


class Rig:
    """One test's controller side (config dir, ssh control dir), its boxes, the shared durable dir, the trainer's
    working dir and trace; and, at the end, every agent and trainer its boxes still run, by PID and start time."""

    def __init__(self, tmp_path: Any, pyz: str) -> None:
        self.tmp = tmp_path
        self.pyz = pyz
        self.cm = tempfile.mkdtemp(prefix="or", dir="/tmp")
        self.cfg = str(tmp_path / "cfg")
        self.durable = str(tmp_path / "durable")
        self.work = str(tmp_path / "work")
        self.trace = str(tmp_path / "trace.jsonl")
        os.makedirs(self.durable)
        os.makedirs(self.work)
        self.env = subprocess_env({"ONBOX_CONFIG_DIR": self.cfg, "ONBOX_SSH_CONTROL_DIR": self.cm,
                                   "ONBOX_SSH_CONNECT_TIMEOUT": "3", "ONBOX_SSH_ALIVE_INTERVAL": "1",
                                   "ONBOX_SSH_ALIVE_COUNT": "2"})
        self.boxes: Dict[str, SshdBox] = {}

    def ctl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        assert "Traceback" not in r.stderr, r.stderr
        if check and r.returncode != 0:
            pytest.fail("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args[:4]), r.returncode, r.stdout, r.stderr))
        return r

    def box(self, name: str) -> SshdBox:
        """A new box `name` with its own sshd, in the inventory, onbox.pyz pushed."""
        box = SshdBox(str(self.tmp / ("box-" + name)))
        self.boxes[name] = box
        box.start()
        e = box.inventory_entry()
        argv = ["box", "add", name, "--host", e["host"], "--port", str(e["port"]), "--user", "root",
                "--identity", e["identity"], "--python", e["python"]]
        for o in e["options"]:
            argv += ["--ssh-option", o]
        self.ctl(*argv)
        self.ctl("push", name, "--pyz", self.pyz)
        return box

    def launch(self, box: str, *extra: str, steps: int = 100000, durable: str = "", check: bool = True,
               ) -> subprocess.CompletedProcess:
        """The line a person types again and again: no --name."""
        return self.ctl("run", box, "--durable", durable or self.durable, "--workdir", self.work,
                        "--sync-interval", "0.3", "--set", "settle_seconds=0.3", "--set", "notice_source=none",
                        "--max-restarts", "0", *extra, "--", sys.executable, TRAINER, "--steps", str(steps),
                        "--interval", "0.05", "--save-every", "5", "--trace", self.trace, check=check)

    def state(self, box: str, run: str) -> Dict[str, Any]:
        try:
            with open(os.path.join(self.boxes[box].home, ".onbox", "runs", run, "state.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def committed(self, run: str) -> List[int]:
        return committed_steps(self.durable, run)

    def starts(self) -> List[Dict[str, Any]]:
        try:
            with open(self.trace) as f:
                return [json.loads(x) for x in f if x.strip()]
        except OSError:
            return []

    def preempt(self, box: str, run: str) -> None:
        """A preemption notice: SIGTERM to the run's agent (by PID and start time); it checkpoints, commits and
        exits `preempted`."""
        st = self.state(box, run)
        assert kill_exact(st["agent_pid"], st["agent_start_time"], signal.SIGTERM), st
        wait_for(lambda: self.state(box, run).get("state") == "preempted", 60, "%s preempted on %s" % (run, box))
        # and gone: it releases the run's lease as it exits (until then the run is still its)
        wait_for(lambda: start_ticks(st["agent_pid"]) != st["agent_start_time"], 30, "the agent of %s gone" % run)

    def close(self) -> None:
        for name, box in self.boxes.items():
            runs = os.path.join(box.home, ".onbox", "runs")
            for run in os.listdir(runs) if os.path.isdir(runs) else []:
                st = self.state(name, run)
                for pid, start in ((st.get("agent_pid"), st.get("agent_start_time")),
                                   (st.get("child_pid"), st.get("child_start_time"))):
                    if pid and start is not None:
                        kill_exact(pid, start)
            box.stop()
        close_masters(self.cm)
        shutil.rmtree(self.cm, ignore_errors=True)


@pytest.fixture
def rig(tmp_path, onbox_pyz):
    _need_root_tools()
    r = Rig(tmp_path, onbox_pyz)
    yield r
    r.close()


def _said(r: subprocess.CompletedProcess, pattern: str) -> re.Match:
    m = re.search(pattern, r.stdout, re.M)
    assert m, "%r not in:\n%s\n%s" % (pattern, r.stdout, r.stderr)
    return m


def test_the_same_command_resumes_its_run_after_a_preemption(rig):
    rig.box("a")
    r = rig.launch("a")
    run = _said(r, r"^a: new run (keep_trainer-\d{8}-\d{6}): no earlier run of this command with this working dir "
                   r"and durable target on a or in this machine's launch log$").group(1)
    _said(r, r"^a: started run %s " % run)
    wait_for(lambda: len(rig.committed(run)) >= 2, 60, "two durable commits")

    r = rig.launch("a", check=False)  # the same line while the run is alive: refused, nothing started
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "a: refused, nothing started: run %s of this command is still running on a (running, agent pid" % run in r.stderr
    assert "--new" in r.stderr and "stop %s" % run in r.stderr
    assert len(rig.starts()) == 1

    rig.preempt("a", run)
    newest = max(rig.committed(run))
    r = rig.launch("a", "--json")
    doc = json.loads(r.stdout)["runs"][0]
    assert doc["ok"] and doc["name"] == run
    assert doc["match"] == {"decision": "resume", "run": run, "step": newest, "step_from": "durable", "found": "box",
                            "others": [], "why": "the run of this command on a (preempted)"}
    wait_for(lambda: len(rig.starts()) == 2, 30, "the relaunch to start")
    assert [s["start"] for s in rig.starts()] == [0, newest]  # the same run, at the newest durable step

    wait_for(lambda: max(rig.committed(run)) > newest, 60, "a commit after the resume")
    rig.preempt("a", run)
    again = max(rig.committed(run))
    r = rig.launch("a")  # the words a person reads
    _said(r, r"^a: resuming %s from step %d: the run of this command on a \(preempted\)$" % (run, again))
    _said(r, r"^a: started run %s " % run)
    wait_for(lambda: len(rig.starts()) == 3, 30, "the second relaunch to start")
    assert rig.starts()[-1]["start"] == again
    rig.preempt("a", run)

    r = rig.launch("a", "--new")  # a new run on purpose
    other = _said(r, r"^a: new run (keep_trainer-\S+): asked for with --new$").group(1)
    assert other != run and rig.state("a", other).get("state") == "running"
    rig.preempt("a", other)

    elsewhere = str(rig.tmp / "durable2")
    os.makedirs(elsewhere)
    r = rig.launch("a", durable=elsewhere)  # another durable target: another run
    third = _said(r, r"^a: new run (keep_trainer-\S+): ").group(1)
    assert third not in (run, other)
    assert "%s ran this command with another durable target (%s)" % (run, rig.durable) in r.stdout, r.stdout
    rig.preempt("a", third)

    r = rig.launch("a", steps=99999)  # another command (its arguments differ): another run
    fourth = _said(r, r"^a: new run (keep_trainer-\S+): no earlier run of this command").group(1)
    assert fourth not in (run, other, third)
    rig.preempt("a", fourth)
    starts = rig.starts()
    assert [s["start"] for s in starts[3:]] == [0, 0, 0]  # the new runs start from scratch


def test_a_run_that_ended_done_is_followed_by_a_new_run(rig):
    rig.box("a")
    r = rig.launch("a", steps=12)
    run = _said(r, r"^a: new run (keep_trainer-\S+): ").group(1)
    wait_for(lambda: rig.state("a", run).get("state") == "done", 60, "the run done")
    leases = os.path.join(rig.durable, run, "leases")

    def lease() -> Dict[str, Any]:
        with open(os.path.join(leases, sorted(os.listdir(leases))[-1])) as f:
            return json.load(f)

    # the agent releases its lease as it exits, after the state says done: what a replacement box would read
    released = wait_for(lambda: (lambda doc: doc if doc.get("released_at") else None)(lease()), 30, "the release")
    assert released["ended"] == "done"
    r = rig.launch("a", steps=12, check=False)
    new = _said(r, r"^a: new run (keep_trainer-\S+): the newest run of this command, %s, ended done$" % run).group(1)
    assert new != run and r.returncode == 0, r.stderr
    wait_for(lambda: rig.state("a", new).get("state") == "done", 60, "the new run done")
    assert [s["start"] for s in rig.starts()] == [0, 0]


def test_replacement_boxes_resume_the_run_from_the_launch_log_and_take_it_over_when_its_lease_is_live(rig):
    rig.box("a")
    b = rig.box("b")
    r = rig.launch("a")
    run = _said(r, r"^a: new run (keep_trainer-\S+): ").group(1)
    wait_for(lambda: len(rig.committed(run)) >= 2, 60, "two durable commits on a")
    rig.preempt("a", run)
    newest = max(rig.committed(run))

    # b never saw the run: this machine's launch log names it, the durable target holds its checkpoints
    r = rig.launch("b")
    _said(r, r"^b: resuming %s from step %d: launched on a at \S+ \S+ UTC, found in this machine's launch log and "
             r"on the durable target$" % (run, newest))
    _said(r, r"^b: started run %s " % run)
    wait_for(lambda: len(rig.starts()) == 2, 30, "the run to start on b")
    assert [(s["box"], s["start"]) for s in rig.starts()] == [("a", 0), ("b", newest)]
    wait_for(lambda: max(rig.committed(run)) > newest, 60, "a commit from b")

    # b is cut off (its sshd gone), its agent trains on and renews its lease: a third box is refused ...
    rig.box("c")
    b.stop()
    r = rig.launch("c", check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "run %s of this command (launched on b) is held by another agent: its lease on %s was renewed" % (
        run, rig.durable) in r.stderr, r.stderr
    assert "--take-over" in r.stderr and not os.path.exists(os.path.join(rig.boxes["c"].home, ".onbox", "runs"))

    # ... until --take-over: the run resumes on c and b's agent, still alive, is fenced
    r = rig.launch("c", "--take-over", "--json")
    doc = json.loads(r.stdout)["runs"][0]
    assert doc["ok"] and doc["name"] == run and doc["match"]["found"] == "launch log", doc
    step = doc["match"]["step"]
    # the newest durable step when c asked (b trains on and commits until it meets c's lease: retention may have
    # retired that step since, under load)
    assert isinstance(step, int) and step > newest, doc
    assert "--take-over: the live lease of" in doc["match"]["why"]
    wait_for(lambda: rig.state("b", run).get("state") == "fenced", 60, "b's agent fenced")
    wait_for(lambda: len(rig.starts()) == 3, 30, "the run to start on c")
    last = rig.starts()[-1]
    assert last["box"] == "c" and last["start"] >= step  # b may have committed once more before the takeover
    with open(os.path.join(rig.cfg, "launches.json")) as f:
        assert [(e["run"], e["box"]) for e in json.load(f)["launches"]] == [(run, "a"), (run, "b"), (run, "c")]
    rig.preempt("c", run)


def test_a_fan_out_relaunch_resumes_each_box_s_own_run(rig):
    rig.box("a")
    rig.box("b")
    r = rig.ctl("run", "a", "b", "--json", "--durable", rig.durable, "--workdir", rig.work, "--sync-interval", "0.3",
                "--set", "settle_seconds=0.3", "--set", "notice_source=none", "--max-restarts", "0", "--",
                sys.executable, TRAINER, "--interval", "0.05", "--trace", rig.trace)
    first = {x["box"]: x for x in json.loads(r.stdout)["runs"]}
    assert all(x["match"]["decision"] == "new" for x in first.values())
    runs = {box: first[box]["name"] for box in ("a", "b")}
    assert runs["a"].endswith("-a") and runs["b"].endswith("-b")
    for box in ("a", "b"):
        wait_for(lambda run=runs[box]: rig.committed(run), 60, "a commit of %s" % runs[box])
        rig.preempt(box, runs[box])
    newest = {box: max(rig.committed(runs[box])) for box in ("a", "b")}
    r = rig.ctl("run", "a", "b", "--durable", rig.durable, "--workdir", rig.work, "--sync-interval", "0.3",
                "--set", "settle_seconds=0.3", "--set", "notice_source=none", "--max-restarts", "0", "--",
                sys.executable, TRAINER, "--interval", "0.05", "--trace", rig.trace)
    for box in ("a", "b"):
        _said(r, r"^%s: resuming %s from step %d: the run of this command on %s \(preempted\)$" % (
            box, runs[box], newest[box], box))
    wait_for(lambda: len(rig.starts()) == 4, 30, "both relaunches to start")
    assert sorted((s["box"], s["start"]) for s in rig.starts()[2:]) == [("a", newest["a"]), ("b", newest["b"])]
    for box in ("a", "b"):
        rig.preempt(box, runs[box])


def test_a_hand_relaunch_with_name_refused_by_a_live_lease_exits_2_with_the_agents_words(rig):
    """Issue 31 (also found): with --name, the launch goes straight to `onbox run`, whose refusal (exit 2: the run's
    lease is live on another box) was wrapped as a remote failure and exited 1; the README's table says 2."""
    rig.box("a")
    rig.box("b")
    rig.launch("a", "--name", "held")
    wait_for(lambda: rig.state("a", "held").get("state") == "running", 60, "the run on a")
    r = rig.launch("b", "--name", "held", check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "b: refused, nothing started: onbox run on b: run held is held by another agent:" in r.stderr, r.stderr
    assert "--take-over" in r.stderr and "Traceback" not in r.stderr
    assert rig.state("a", "held").get("state") == "running"  # the false-positive side: the holder trains on
    rig.preempt("a", "held")
