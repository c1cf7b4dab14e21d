"""Fencing with real agents: two (or three) `onbox run` agents on this machine, each with its own ONBOX_HOME and
local checkpoint disk, sharing one durable target (a mounted directory, or an rclone remote on loopback: sftp, S3).

- A takeover (`--take-over`, as `onboxctl keep` does after declaring a box lost): the old agent commits nothing
  more, stops its trainer within one sync interval and ends `fenced`; the new one resumed from the old one's
  newest durable checkpoint (invariant 1).
- The race window: the old agent is held (at hashcopy's fault point: PAUSED_AGENT) between its lease check and its manifest
  write while the new agent takes over, and the new one right after its take, before its first write (else its
  cleanup of interrupted commits removes the old agent's manifest-less copy: no orphan at all); the checkpoint
  the old agent then commits is never restored, by the new agent nor by a third launch, and ends in
  quarantine/ (invariant 2).
- Two launches at once without --take-over: exactly one writer (invariant 3).

Each test signals only the processes it started (agents and trainers, by pid AND start time) and stops them all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

import pytest

from onbox.checkpoints.leases import lease_files
from tests.integration.supervisor_helpers import env_for, events, state
from tests.polling import wait_for
from tests.processes import Started, with_env

pytestmark = pytest.mark.integration

SYNC = 1.0  # --sync-interval: a fenced agent must stop its trainer within this long
TTL = 3.0  # --lease-ttl

# Saves <tag>-step_<n>.pt (a torch-zip layout, atomically) every 0.25 s, resuming from ONBOX_RESUME_FROM's step;
# appends what it started from (pid, resume path, step) to the file argv[2].
TRAINER = r"""
import io, json, os, re, sys, time, zipfile
tag, out = sys.argv[1], sys.argv[2]
resume = os.environ.get("ONBOX_RESUME_FROM", "")
m = re.search(r"step_(\d+)", os.path.basename(resume))
step = int(m.group(1)) if m else 0
with open(out, "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "resume": resume, "start": step}) + "\n")
ck = os.environ["ONBOX_CKPT_DIR"]
while True:
    step += 1
    time.sleep(0.25)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        zf.writestr("archive/data/0", os.urandom(2000))
        zf.writestr("archive/version", b"3\n")
    path = os.path.join(ck, "%s-step_%d.pt" % (tag, step))
    with open(path + ".tmp", "wb") as f:
        f.write(buf.getvalue())
    os.replace(path + ".tmp", path)
    print("step %d" % step, flush=True)
"""


# `onbox` with a pause at a fault point (hashcopy.fault_hook, the seam tests set): `LABEL:N:GATE` holds the agent
# the N-th time it passes LABEL: it creates GATE.waiting and waits until GATE exists (at most 120 s). The detached
# agent is a fork of this process, so it keeps the hook.
PAUSED_AGENT = """\
import os, sys, time
from onbox.checkpoints.durable import hashcopy
label, count, gate = sys.argv[1].split(":", 2)
seen = [0]
def pause(at):
    if at != label:
        return
    seen[0] += 1
    if seen[0] != int(count):
        return
    open(gate + ".waiting", "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
hashcopy.fault_hook = pause
from onbox.cli import main
main(sys.argv[2:])
"""


class Box:
    """One agent's box on this machine: its ONBOX_HOME, its local checkpoint disk, its trainer's log; `pause`:
    hold its agent at a fault point (PAUSED_AGENT)."""

    def __init__(self, tmp: Any, tag: str, durable: str, started: Started, env: Optional[Dict[str, str]] = None,
                 pause: Optional[str] = None):
        self.tag = tag
        self.home = tmp / ("home-" + tag)
        self.disk = tmp / ("disk-" + tag)
        self.log = str(tmp / ("trainer-%s.jsonl" % tag))
        self.trainer = str(tmp / "trainer.py")
        self.durable = durable
        self.started = started
        self.env = dict(env or {})
        self.pause = pause
        with open(self.trainer, "w") as f:
            f.write(TRAINER)

    def argv(self, *extra: str) -> List[str]:
        onbox = [sys.executable, "-c", PAUSED_AGENT, self.pause] if self.pause else [sys.executable, "-m", "onbox"]
        return [*onbox, "run", "--name", "fx", "--durable", self.durable, "--ckpt-dir",
                str(self.disk), "--sync-interval", str(SYNC), "--lease-ttl", str(TTL), "--settle-seconds", "0",
                "--restart", "never", *extra, "--", sys.executable, self.trainer, self.tag, self.log]

    def popen(self, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*extra), env=env_for(self.home, **self.env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, *extra: str) -> subprocess.CompletedProcess:
        p = self.popen(*extra)
        out, err = p.communicate(timeout=90)
        self.track()
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def track(self) -> None:
        """The agent and its trainers, by pid and start time, for the teardown."""
        doc = state(self.home, "fx")
        self.started.add(doc.get("agent_pid"), doc.get("agent_start_time"))
        for t in self.trainers():
            self.started.add(t["pid"])

    def trainers(self) -> List[Dict[str, Any]]:
        try:
            with open(self.log) as f:
                return [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []

    def state(self) -> Dict[str, Any]:
        return state(self.home, "fx")

    def events(self, kind: Optional[str] = None) -> List[Dict[str, Any]]:
        return [e for e in events(self.home, "fx") if kind is None or e["type"] == kind]

    def stop(self) -> None:
        r = subprocess.run([sys.executable, "-m", "onbox", "stop", "fx"], env=env_for(self.home),
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stdout + r.stderr


def pid_alive(pid: int) -> bool:
    from onbox.proc import is_alive

    return is_alive(pid)


def leases(run_root: str) -> List[Dict[str, Any]]:
    out = []
    for f in lease_files(os.listdir(os.path.join(run_root, "leases"))):
        with open(os.path.join(run_root, "leases", f.name)) as fh:
            out.append(json.load(fh))
    return out


def lease_of(run_root: str, epoch: int) -> Dict[str, Any]:
    """The lease of that epoch (its lowest holder's, should two launches have tied)."""
    return min((d for d in leases(run_root) if d["epoch"] == epoch), key=lambda d: d["holder"])


def manifests(run_root: str, sub: str = "checkpoints") -> Dict[str, Dict[str, Any]]:
    """Every committed checkpoint under <run_root>/<sub>/ by directory name, with its manifest."""
    found = {}
    root = os.path.join(run_root, sub)
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name, "MANIFEST.json")
        if os.path.isfile(path):
            with open(path) as f:
                found[name] = json.load(f)
    return found


@pytest.fixture
def started():
    with Started() as s:
        yield s


def _wait_commits(box: Box, n: int) -> None:
    wait_for(lambda: len(box.events("checkpoint_committed")) >= n, timeout=60, what="%d commits of %s" % (n, box.tag))


def test_takeover_fences_the_old_agent_and_resumes_from_its_newest_checkpoint(tmp_path, started):
    durable = str(tmp_path / "durable")
    root = os.path.join(durable, "fx")
    a1, a2, a3 = (Box(tmp_path, t, durable, started) for t in ("a1", "a2", "a3"))
    r = a1.run()
    assert r.returncode == 0, r.stderr
    _wait_commits(a1, 2)
    # without --take-over the live lease refuses a second launch, naming its holder, host and last renewal
    refused = a2.run()
    assert refused.returncode == 2, refused.stderr
    holder1 = leases(root)[0]["holder"]
    assert "held by another agent: %s on" % holder1 in refused.stderr and "renewed" in refused.stderr
    assert "--take-over" in refused.stderr and not a2.trainers()
    r = a2.run("--take-over")
    assert r.returncode == 0, r.stderr
    lease2 = lease_of(root, 2)
    taken = lease2["taken_at"]
    # invariant 1: agent 1 sees the newer lease, stops its trainer within a sync interval and ends fenced
    wait_for(lambda: a1.state().get("state") == "fenced", timeout=30, what="agent 1 fenced")
    [fenced] = a1.events("fenced")
    assert (fenced["epoch"], fenced["newer_epoch"], fenced["newer_holder"]) == (1, 2, lease2["holder"])
    [trainer1] = a1.trainers()
    assert not pid_alive(trainer1["pid"])
    [gone] = [e for e in a1.events("exit")]
    assert gone["classification"] == "fenced" and lease2["holder"] in gone["hint"]
    assert "nothing to do on this box" in gone["hint"]
    stopped_after = gone["time"] - taken
    assert stopped_after <= SYNC + 0.75, "the trainer stopped %.2f s after the takeover" % stopped_after
    last = a1.state()["last_exit"]
    assert last["classification"] == "fenced" and "the run continues on %s" % lease2["holder"] in last["hint"]
    # it commits nothing after the fence; what it committed after the takeover (a race window) is an orphan
    assert not [e for e in a1.events("checkpoint_committed") if e["time"] > fenced["time"]]
    # agent 2 resumed from agent 1's newest checkpoint committed before the takeover, recorded in its lease
    wait_for(lambda: a2.trainers(), timeout=30, what="agent 2's trainer")
    resumed = os.path.basename(a2.trainers()[0]["resume"])
    assert resumed == lease2["resumed_from"] and resumed.startswith("a1-") and resumed in lease2["base"]
    before = [e for e in a1.events("checkpoint_committed") if e["time"] < taken]
    assert resumed == max(before, key=lambda e: e["step"])["checkpoint"]
    _wait_commits(a2, 2)
    a2.stop()
    assert a2.state()["state"] == "stopped"
    assert lease_of(root, 2)["released_at"] is not None
    # a third launch needs no --take-over after a release, and continues agent 2's lineage
    r = a3.run()
    assert r.returncode == 0, r.stderr
    wait_for(lambda: a3.trainers(), timeout=30, what="agent 3's trainer")
    assert os.path.basename(a3.trainers()[0]["resume"]).startswith("a2-")
    a3.stop()
    for name, m in manifests(root).items():  # every committed checkpoint says which lease committed it
        assert (m["epoch"], m["holder"]) in {(d["epoch"], d["holder"]) for d in leases(root)}, name
    print("\nfencing: takeover -> old trainer gone %.2f s, old agent fenced %.2f s (sync interval %.1f s)" % (
        stopped_after, a1.events("state")[-1]["time"] - taken, SYNC))


def test_a_checkpoint_committed_in_the_race_window_is_never_restored_and_ends_in_quarantine(tmp_path, started):
    durable = str(tmp_path / "durable")
    root = os.path.join(durable, "fx")
    gate1, gate2 = str(tmp_path / "gate1"), str(tmp_path / "gate2")
    # agent 1 stops at its 3rd manifest write, after that commit's lease check passed
    a1 = Box(tmp_path, "a1", durable, started, pause="before-manifest:3:" + gate1)
    a2 = Box(tmp_path, "a2", durable, started, pause="after-lease:1:" + gate2)
    a3 = Box(tmp_path, "a3", durable, started)
    assert a1.run().returncode == 0
    wait_for(lambda: os.path.exists(gate1 + ".waiting"), timeout=60, what="agent 1 inside the race window")
    before = set(manifests(root))
    assert len(before) == 2
    p2 = a2.popen("--take-over")
    wait_for(lambda: os.path.exists(gate2 + ".waiting"), timeout=60, what="agent 2's lease written")
    lease2 = lease_of(root, 2)
    assert set(lease2["base"]) == before  # listed before agent 2 wrote its lease
    with open(gate1, "w"):
        pass  # agent 1 writes its manifest now: a checkpoint of epoch 1 committed after epoch 2 exists
    orphan = [e for e in a1.events("checkpoint_commit_started")][-1]["checkpoint"]
    wait_for(lambda: orphan in manifests(root), timeout=30, what="the race-window manifest")
    assert orphan not in before and orphan not in lease2["base"] and manifests(root)[orphan]["epoch"] == 1
    with open(gate2, "w"):
        pass
    _out, err = p2.communicate(timeout=90)
    a2.track()
    assert p2.returncode == 0, err
    wait_for(lambda: a1.state().get("state") == "fenced", timeout=30, what="agent 1 fenced")
    # agent 2 moves it to quarantine/ whole at its take (never deletes it), and never restores it
    wait_for(lambda: any(n.startswith(orphan + ".") for n in manifests(root, "quarantine")), timeout=30,
             what="the orphan in quarantine/")
    [q] = [e for e in a2.events("checkpoint_quarantined") if e["checkpoint"] == orphan]
    assert "fenced orphan" in q["reason"] and q["epoch"] == 1
    assert orphan not in manifests(root)
    wait_for(lambda: a2.trainers(), timeout=30, what="agent 2's trainer")  # it starts after the quarantine
    resumed2 = os.path.basename(a2.trainers()[0]["resume"])
    assert resumed2 in before  # agent 2 resumed from agent 1's newest before the takeover, not the orphan
    _wait_commits(a2, 1)
    a2.stop()
    r = a3.run()
    assert r.returncode == 0, r.stderr
    wait_for(lambda: a3.trainers(), timeout=30, what="agent 3's trainer")
    resumed3 = os.path.basename(a3.trainers()[0]["resume"])
    assert resumed3.startswith("a2-"), resumed3
    a3.stop()
    restored = [e["checkpoint"] for b in (a2, a3) for e in b.events("checkpoint_resume")]
    assert orphan not in restored


def test_two_launches_at_once_make_exactly_one_writer(tmp_path, started):
    durable = str(tmp_path / "durable")
    boxes = [Box(tmp_path, t, durable, started) for t in ("b1", "b2")]
    procs = [b.popen() for b in boxes]  # no --take-over: a person and a keeper, or two keepers
    outs = [p.communicate(timeout=90) for p in procs]
    for b in boxes:
        b.track()
    codes = [p.returncode for p in procs]
    assert sorted(codes) in ([0, 0], [0, 2]), (codes, outs)
    # settle: a launch that won its take but lost the tie is fenced at its first check
    wait_for(lambda: sum(b.state().get("state") == "running" for b in boxes) == 1 and all(
        b.state().get("state") in ("running", "fenced", "") or codes[i] == 2 for i, b in enumerate(boxes)),
        timeout=30, what="exactly one running agent")
    [writer] = [b for b in boxes if b.state().get("state") == "running"]
    loser = next(b for b in boxes if b is not writer)
    _wait_commits(writer, 1)
    if codes[boxes.index(loser)] == 2:
        assert "held by another agent" in outs[boxes.index(loser)][1] or "at the same moment" in \
            outs[boxes.index(loser)][1]
    else:
        assert loser.state()["state"] == "fenced" and not loser.events("checkpoint_committed")
    root = os.path.join(durable, "fx")
    holders = {m.get("holder") for m in manifests(root).values()}
    assert len(holders) == 1
    writer.stop()
    how = outs[boxes.index(loser)][1].strip().splitlines()[0] if codes[boxes.index(loser)] == 2 else "fenced"
    print("\nrace of two launches: the other one %s" % how)


def test_two_launches_that_tie_on_an_epoch_make_exactly_one_writer(tmp_path, started):
    """Both launches listed the leases before either wrote its own (held there, test only): both write epoch 1.
    The lowest holder wins; the other is refused at its take (it saw the winner when it listed again) or, if it
    listed again before the winner's lease was there, fenced at its first check, before its first write."""
    durable = str(tmp_path / "durable")
    gates = [str(tmp_path / ("gate-" + t)) for t in ("t1", "t2")]
    boxes = [Box(tmp_path, t, durable, started, pause="before-lease:1:" + g)
             for t, g in zip(("t1", "t2"), gates)]
    procs = [b.popen() for b in boxes]
    wait_for(lambda: all(os.path.exists(g + ".waiting") for g in gates), timeout=60, what="both before their lease")
    for g in gates:
        with open(g, "w"):
            pass
    outs = [p.communicate(timeout=90) for p in procs]
    for b in boxes:
        b.track()
    root = os.path.join(durable, "fx")
    ones = [d for d in leases(root) if d["epoch"] == 1]
    assert len(ones) == 2  # a tie
    winner_holder = min(d["holder"] for d in ones)
    codes = [p.returncode for p in procs]
    # the loser: refused at its take (2), fenced at its first write before its child started (1), or after (0)
    assert sorted(codes) in ([0, 0], [0, 1], [0, 2]), (codes, outs)
    wait_for(lambda: sum(b.state().get("state") == "running" for b in boxes) == 1, timeout=30,
             what="exactly one running agent")
    [writer] = [b for b in boxes if b.state().get("state") == "running"]
    [mine] = [d for d in ones if d["holder"] == winner_holder]
    assert mine["agent"]["pid"] == writer.state()["agent_pid"]  # the lowest holder is the writer
    loser = next(b for b in boxes if b is not writer)
    i = boxes.index(loser)
    if codes[i] == 2:
        assert "at the same moment" in outs[i][1] and winner_holder in outs[i][1], outs[i][1]
    elif codes[i] == 1:
        assert "fenced: the run continues on %s" % winner_holder in outs[i][1], outs[i][1]
        assert loser.state()["state"] == "fenced" and not loser.trainers()
    else:
        wait_for(lambda: loser.state().get("state") == "fenced", timeout=30, what="the loser fenced")
        assert not loser.events("checkpoint_committed")
    _wait_commits(writer, 1)
    assert {m.get("holder") for m in manifests(root).values()} == {winner_holder}
    writer.stop()
    print("\ntie of two launches: the loser %s" % {2: "was refused at its take", 1: "was fenced before its child "
                                                    "started", 0: "was fenced while running"}[codes[i]])


@pytest.mark.slow
def test_takeover_on_an_rclone_remote(tmp_path, started, rclone_backend):
    """Over sftp and over S3 (leases are objects there: taken by an upload, seen by listing again)."""
    remote = rclone_backend.remote
    a1, a2 = (Box(tmp_path, t, remote, started, env=rclone_backend.env) for t in ("a1", "a2"))
    assert a1.run().returncode == 0
    _wait_commits(a1, 2)
    root = os.path.join(rclone_backend.durable_root, "fx")
    refused = a2.run()
    assert refused.returncode == 2 and "held by another agent" in refused.stderr
    r = a2.run("--take-over")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: a1.state().get("state") == "fenced", timeout=30, what="agent 1 fenced")
    lease2 = lease_of(root, 2)
    [fenced] = a1.events("fenced")
    assert fenced["newer_holder"] == lease2["holder"]
    assert not [e for e in a1.events("checkpoint_committed") if e["time"] > fenced["time"]]
    [gone] = a1.events("exit")
    # within a sync interval, plus what rclone's listing processes take (seconds each on a loaded 2-core machine)
    assert gone["classification"] == "fenced" and gone["time"] - lease2["taken_at"] <= SYNC + 3.0
    # nothing of rclone's goes on for the fenced agent (over S3 its rclone rcd stopped at the fence)
    wait_for(lambda: not with_env("ONBOX_HOME", str(a1.home), argv_has="rclone"), timeout=10,
             what="no rclone of the fenced agent left")
    print("\nfencing on %s: takeover -> old trainer gone %.2f s (sync interval %.1f s)" % (
        remote.split(":")[0], gone["time"] - lease2["taken_at"], SYNC))
    wait_for(lambda: a2.trainers(), timeout=30, what="agent 2's trainer")
    assert os.path.basename(a2.trainers()[0]["resume"]) == lease2["resumed_from"]
    _wait_commits(a2, 1)
    a2.stop()
    assert lease_of(root, 2)["released_at"] is not None
