"""`onboxctl keep` for real: network-namespace boxes on one bridged subnet, each with its own sshd (the box's /root
private, the durable dir a path every box shares, as a mounted durable target), the real onbox.pyz, real agents, a
real trainer (tests/integration/keep_trainer.py: pure Python, checkpoints every 5 steps, resumes from
ONBOX_RESUME_FROM, logs every start to a trace file the boxes share); the controller side is tests/hosts/keeper_rig.py.

- a box dies (its agent, trainer and sshd killed, by PID and start time): the keeper recovers the run on the pool's
  spare (pushing the pyz there first) and training resumes at the newest durable step, with one launch;
- preempted with the box still up: relaunched on the same box; the spare is not even looked at;
- no usable spare (it fails `onbox audit`) and a provision command that fails every way (exits 1, prints garbage,
  hangs): `keep --once` from cron ends the run failed_no_resource, exit 1; nothing launched, nothing deleted;
- the keeper SIGKILLed while its launch on the spare is in flight, then started again: one launch;
- a two-node group that loses a node recovers whole on two spares, node 0 first; the surviving old node 0 is
  fenced;
- leases: the recovered run holds a newer lease than the lost box's; a partitioned box is recovered elsewhere with
  --take-over and, after the heal, its agent sees the newer lease and ends `fenced`, and nothing it committed after
  the takeover is ever restored; with the storage cut too (the durable target an rclone sftp remote served on
  this machine, out of the cut box's reach), the cut box's first write after the heal is refused by its lease check.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, Optional

import pytest

from tests.hosts.keeper_rig import PHASES, RUN, Rig
from tests.hosts.sshd_box import BridgeNet
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def rig(tmp_path, onbox_pyz):
    r = Rig(tmp_path, onbox_pyz)
    yield r
    r.close()


def test_a_box_that_dies_is_recovered_on_a_spare_and_resumes_at_the_newest_durable_step(netns_boxes, rig):
    from tests.hosts.tracker import TrackerProcess

    b0, s0 = netns_boxes(2)
    tracker = TrackerProcess(str(rig.tmp / "tracker"), host=b0.netns.host_addr).start()  # the boxes reach it
    rig.env["ONBOX_TRACKER_TOKEN"] = tracker.token  # keep's; its URL is the run's own --tracker

    def tracker_get(path):
        req = urllib.request.Request(tracker.url + path, headers={"Authorization": "Bearer " + tracker.token})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    try:
        rig.add("b0", b0)
        rig.add("s0", s0, pool="p")  # no onbox.pyz there yet: the keeper pushes it
        rig.ctl("push", "b0", "--pyz", rig.pyz)
        rig.launch("b0", "--tracker", tracker.url, "--tracker-token-file", tracker.token_file)
        wait_for(lambda: len(rig.committed()) >= 2, 60, "two durable commits on b0")
        r = rig.ctl("keep", "--once", "--json")  # healthy: nothing to do
        assert json.loads(r.stdout.splitlines()[-1])["runs"][0]["state"] == "watching"

        rig.kill_box("b0")
        t_dead = time.time()
        newest = max(rig.committed())
        rig.keeper()
        rec = wait_for(rig.recovered, 90, "the run to train again on the spare", 0.3)
        took = time.time() - t_dead

        starts = rig.starts()
        assert [(s["box"], s["start"]) for s in starts] == [("b0", 0), ("s0", newest)], starts  # one launch
        assert rig.committed()[-1] >= newest
        assert rec["boxes"] == ["s0"] and rec["recoveries"] == 1 and rec["state"] == "watching"
        last = rec["history"][-1]
        phases = PHASES
        times = [last["phases"][p] for p in phases]
        assert times == sorted(times) and last["kind"] == "elsewhere" and last["take_over"] is True
        assert last["resume_step"] == newest and last["first_step"] > newest
        assert "its beats are late" in last["reason"] or "its beats are silent" in last["reason"], last["reason"]
        assert rig.took_over("s0")  # the spare's agent superseded b0's lease
        wait_for(lambda: rig.state("s0").get("state") == "running", 30, "the spare's run running")
        # the beats go on under the same run, from the spare now; every decision is in the tracker with its time
        boxes = wait_for(lambda: (lambda b: b if "s0" in b else None)(
            [x["box"] for x in tracker_get("/api/v1/runs/%s/heartbeats?after=-1&limit=1000" % RUN)["heartbeats"]]),
            30, "beats from the spare")
        assert boxes[0] == "b0" and boxes[-1] == "s0"
        kinds = wait_for(lambda: (lambda k: k if "first_new_step" in k else None)(
            [e["kind"] for e in tracker_get("/api/v1/runs/%s/events" % RUN)["events"]]), 30, "the events")
        assert [k for k in kinds if k in phases] == list(phases)
        # status (over ssh, the spare only: b0 is gone) shows where it lives now and its work at risk
        doc = json.loads(rig.ctl("status", "--box", "s0", "--json").stdout)
        row = next(x for x in doc["runs"] if x["run"] == RUN)
        assert row["box"] == "s0" and row["keeper"]["recoveries"] == 1 and row["at_risk"]["bound"] == 3600.0
        kept = next(k for k in doc["keeper"] if k["run"] == RUN)
        assert [e["kind"] for e in kept["events"]][-6:] == list(phases)
        print("box death to the first new step on the spare: %.1f s (lost-after 3 s, heartbeat 1 s)" % took)
    finally:
        tracker.stop()


def test_preempted_with_the_box_up_is_relaunched_there_and_the_spare_is_not_used(netns_boxes, rig):
    b0, s0 = netns_boxes(2)
    rig.add("b0", b0)
    rig.add("s0", s0, pool="p")
    rig.ctl("push", "b0", "--pyz", rig.pyz)
    rig.launch("b0")
    wait_for(lambda: len(rig.committed()) >= 1, 60, "a durable commit")
    rig.kill_run("b0", signal.SIGTERM)  # a preemption notice to the agent: checkpoint, commit, exit 75
    wait_for(lambda: rig.state("b0").get("state") == "preempted", 60, "the run preempted")
    final = max(rig.committed())
    r = rig.ctl("keep", "--once")
    assert "relaunched kp on b0" in r.stdout, r.stdout
    wait_for(lambda: len(rig.starts()) == 2, 30, "the relaunch to start")
    assert [(s["box"], s["start"]) for s in rig.starts()] == [("b0", 0), ("b0", final)]
    rec = wait_for(lambda: rig.ctl("keep", "--once") and rig.recovered(), 60, "the first new step", 0.5)
    assert rec["boxes"] == ["b0"] and rec["recoveries"] == 1 and rec["history"][-1]["kind"] == "same_box"
    assert not rec["history"][-1]["take_over"]
    assert not os.path.exists(os.path.join(s0.home, ".onbox"))  # the spare was not touched at all


def test_no_usable_spare_and_a_failing_provision_end_failed_no_resource_from_cron(netns_boxes, rig):
    b0, s0 = netns_boxes(2)
    rig.add("b0", b0)
    rig.add("s0", s0, pool="p")
    with open(os.path.join(s0.home, "ckpt"), "w") as f:  # the run's --ckpt-dir is under a file there: audit fails
        f.write("not a directory\n")
    tries = str(rig.tmp / "tries")
    script = str(rig.tmp / "new-box.sh")
    with open(script, "w") as f:  # fails every way the contract names: exit 1, garbage, a hang
        f.write("#!/bin/sh\necho x >> %s\nn=$(wc -l < %s)\necho \"key $ONBOX_PROVISION_KEY\" >&2\n"
                "[ $n = 1 ] && { echo 'out of capacity in every region' >&2; exit 1; }\n"
                "[ $n = 2 ] && { echo 'Welcome to the RunPod CLI!'; exit 0; }\nexec sleep 60\n" % (tries, tries))
    os.chmod(script, 0o755)
    rig.ctl("push", "b0", "--pyz", rig.pyz)
    rig.launch("b0", "--ckpt-dir", "/root/ckpt/kp", "--provision", script, "--provision-timeout", "2s",
               "--recover-tries", "3")
    wait_for(lambda: len(rig.committed()) >= 1, 60, "a durable commit")
    rig.kill_box("b0")
    before = rig.durable_files()
    codes = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # cron: `keep --once` again and again
        r = rig.ctl("keep", "--once", check=False)
        codes.append(r.returncode)
        assert "Traceback" not in r.stderr, r.stderr
        if r.returncode == 1:
            assert r.stderr.startswith("onboxctl: 1 run(s) could not be recovered: kp"), r.stderr
            break
        time.sleep(0.3)
    assert codes[-1] == 1 and set(codes[:-1]) <= {0}, codes
    rec = rig.record()
    assert rec["state"] == "failed_no_resource"
    assert "no healthy spare in pool p and no box from the provision command after 3 tries" in rec["message"]
    texts = [e["text"] for e in rec["events"]]
    assert any("spare s0: fails `onbox audit`: checkpoint dir /root/ckpt/kp is not writable" in t for t in texts), texts
    failed = [t for t in texts if t.startswith("the provision command")]
    assert len(failed) == 3 and "exited 1: out of capacity in every region" in failed[0]
    assert "printed 'Welcome to the RunPod CLI!' as its last line" in failed[1] and "within 2 s" in failed[2]
    assert not os.path.exists(os.path.join(s0.home, ".onbox", "runs"))  # nothing launched anywhere
    assert [s["box"] for s in rig.starts()] == ["b0"]
    assert rig.durable_files() == before  # nothing deleted (or written) in durable storage
    assert rig.ctl("keep", "--once").returncode == 0  # said once: the next pass has nothing new to fail


def test_a_keeper_killed_while_its_launch_is_in_flight_finishes_with_one_launch(netns_boxes, rig):
    b0, s0 = netns_boxes(2)
    marker = str(rig.tmp / "runs-on-s0")
    rig.add("b0", b0)
    rig.add("s0", s0, pool="p", python=rig.wrapper("s0", slow_run=4.0, marker=marker))
    rig.ctl("push", "b0", "--pyz", rig.pyz)
    rig.launch("b0")
    wait_for(lambda: len(rig.committed()) >= 1, 60, "a durable commit")
    rig.kill_box("b0")
    first = rig.keeper()
    wait_for(lambda: os.path.exists(marker), 60, "the keeper's `onbox run` on the spare")
    first.kill()  # SIGKILL: mid-launch, its ssh to the spare still on its way
    first.wait(timeout=10)
    assert rig.record()["current"]["launch_started_at"] and "relaunched" not in rig.record()["current"]["phases"]
    rig.keeper()
    rec = wait_for(rig.recovered, 90, "the recovery finished by the second keeper", 0.3)
    with open(marker) as f:
        assert f.read().splitlines() == ["run"]  # one `onbox run` on the spare, ever
    assert [s["box"] for s in rig.starts()] == ["b0", "s0"]
    assert rec["recoveries"] == 1 and rec["boxes"] == ["s0"]
    assert any("not launched again" in e["text"] for e in rec["events"]), rec["events"]


def test_the_recovered_run_holds_the_newer_lease(netns_boxes, rig):
    b0, s0 = netns_boxes(2)
    rig.add("b0", b0)
    rig.add("s0", s0, pool="p")
    rig.ctl("push", "b0", "--pyz", rig.pyz)
    rig.launch("b0")
    wait_for(lambda: (len(rig.committed()) >= 1 and (rig.state("b0").get("lease") or {}).get("epoch") is not None)
             or _lease_of(rig, "b0"), 60, "a durable commit under b0's lease")
    old = _lease_of(rig, "b0")
    rig.kill_box("b0")
    rig.keeper()
    wait_for(rig.recovered, 90, "the recovery")
    new = wait_for(lambda: _lease_of(rig, "s0"), 30, "the spare's lease")
    assert new["epoch"] > old["epoch"] and new["holder"] != old["holder"] and not new.get("fenced")
    taken = [e for e in rig.events("s0") if e.get("type") == "lease_taken"]
    # superseding b0's lease (netns boxes share one hostname and boot id, so the agent may see b0's dead agent as
    # its own box's and need no take-over: `lease_taken_over` is not asserted)
    assert taken and (taken[-1].get("previous") or {}).get("epoch") == old["epoch"], taken


def _lease_of(rig: Rig, name: str) -> Optional[Dict[str, Any]]:
    """The run's lease as the agent on box `name` says it (`onbox status RUN --json`)."""
    box = rig.boxes[name]
    r = subprocess.run(["ssh", *box.client_options_argv(), "-p", str(box.port), "root@" + box.listen,
                        "%s .onbox/onbox.pyz status %s --json" % (sys.executable, RUN)], capture_output=True,
                       text=True, timeout=60)
    try:
        lease = json.loads(r.stdout).get("lease")
    except ValueError:
        return None
    return lease if isinstance(lease, dict) and lease.get("epoch") is not None else None


def test_a_partitioned_box_is_recovered_elsewhere_and_fenced_after_the_heal(netns_boxes, rig):
    """Partition, storage still shared: b0's link is cut while it trains; the keeper (ssh probes time out) declares it
    lost and recovers on the spare with --take-over; after the heal b0's agent sees the newer lease, commits nothing
    more and ends `fenced`; nothing b0 committed after the takeover is ever restored."""
    b0, s0 = netns_boxes(2)
    rig.add("b0", b0)
    rig.add("s0", s0, pool="p")
    rig.ctl("push", "b0", "--pyz", rig.pyz)
    rig.launch("b0")
    wait_for(lambda: len(rig.committed()) >= 1, 60, "a durable commit")
    ns = b0.netns
    subprocess.run(["ip", "-n", ns.ns, "link", "set", BridgeNet.IFNAME, "down"], check=True)  # the cut
    try:
        rig.keeper()
        rec = wait_for(rig.recovered, 120, "the recovery on the spare", 0.3)
        assert rec["boxes"] == ["s0"] and rec["history"][-1]["take_over"]
        assert "failed ssh for" in rec["history"][-1]["reason"]
    finally:
        subprocess.run(["ip", "-n", ns.ns, "link", "set", BridgeNet.IFNAME, "up"], check=True)  # the heal
    wait_for(lambda: rig.state("b0").get("state") == "fenced", 60, "b0 fenced after the heal")
    takeover = rig.starts()[-1]
    assert takeover["box"] == "s0"
    # nothing b0 committed after the takeover is what the spare resumed from: it started from a step b0 had
    # committed under its own lease before the cut, and every checkpoint of b0's newer than that is fenced
    stamped = []
    for step in rig.committed():
        m = os.path.join(rig.durable, RUN, "checkpoints")
        for name in os.listdir(m):
            with open(os.path.join(m, name, "MANIFEST.json")) as f:
                doc = json.load(f)
            if doc.get("step") == step:
                stamped.append((step, doc.get("epoch")))
    assert all(epoch != 1 or step <= takeover["start"] for step, epoch in stamped), stamped


def test_a_partitioned_box_whose_storage_is_cut_too_is_refused_its_first_write_after_the_heal(netns_boxes, rig,
                                                                                                 tmp_path):
    """Partition, storage cut too: the durable target is an rclone sftp remote served on this machine's bridge
    address, which the cut box cannot reach either. b0 trains and commits; its link is cut (ssh and storage); the
    keeper recovers on the spare, whose agent takes the newer lease through rclone. After the heal, b0's first write
    to durable storage meets the lease check: it commits nothing, stops its trainer and ends `fenced`."""
    from tests.hosts.rclone import RcloneSftp

    if shutil.which("rclone") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("rclone/ssh-keygen not installed: run `make sysdeps` (build/sysdeps.sh)")
    b0, s0 = netns_boxes(2)
    server = RcloneSftp(str(tmp_path / "rclone"), host=b0.netns.host_addr)
    server.start()
    try:
        for box in (b0, s0):  # each box's own rclone config, as a user keeps it on a rented box
            os.makedirs(os.path.join(box.home, ".config", "rclone"), exist_ok=True)
            with open(os.path.join(box.home, ".config", "rclone", "rclone.conf"), "w") as f:
                f.write(server.config_section())
        rig.durable, rig.durable_spec = server.durable_root, server.remote
        rig.add("b0", b0)
        rig.add("s0", s0, pool="p")
        rig.ctl("push", "b0", "--pyz", rig.pyz)
        # a checkpoint every 6 s, the trainer keeping only its newest: each lives longer than a commit through
        # rclone's processes takes here (~2 s); at the other tests' pace each one vanishes before its copy ends
        rig.launch("b0", "--set", "lease_ttl=3", step_interval=0.2, save_every=30)
        wait_for(lambda: len(rig.committed()) >= 2, 60, "two commits through rclone")
        ns = b0.netns
        subprocess.run(["ip", "-n", ns.ns, "link", "set", BridgeNet.IFNAME, "down"], check=True)  # ssh AND storage
        try:
            t_cut = time.time()
            rig.keeper()
            rec = wait_for(rig.recovered, 120, "the recovery on the spare", 0.3)
            assert rec["boxes"] == ["s0"] and rec["history"][-1]["take_over"], rec
            new = wait_for(lambda: _lease_of(rig, "s0"), 30, "the spare's lease")
            assert rig.state("b0").get("state") == "running"  # cut off, not dead: it still trains
        finally:
            subprocess.run(["ip", "-n", ns.ns, "link", "set", BridgeNet.IFNAME, "up"], check=True)  # the heal
        t_heal = time.time()
        wait_for(lambda: rig.state("b0").get("state") == "fenced", 60, "b0 fenced after the heal")
        evs = rig.events("b0")
        [fenced] = [e for e in evs if e.get("type") == "fenced"]
        assert fenced["newer_epoch"] == new["epoch"] and fenced["time"] >= t_heal - 1, fenced
        # nothing committed by b0 after the cut: its only writes after the heal met the newer lease
        late = [e for e in evs if e.get("type") == "checkpoint_committed" and e["time"] > t_cut]
        assert not late, late
        [end] = [e for e in evs if e.get("type") == "exit"]
        assert end["classification"] == "fenced"
        takeover = rig.starts()[-1]
        assert takeover["box"] == "s0" and takeover["start"] <= max(rig.committed())
        assert all(s["box"] == "s0" or s["start"] == 0 for s in rig.starts())  # b0 never started again
        print("storage cut: heal -> b0 fenced %.1f s after the heal" % (fenced["time"] - t_heal))
    finally:
        server.stop()


def test_a_group_that_loses_a_node_recovers_whole_on_fresh_boxes_node_0_first(netns_boxes, rig):
    """A two-node group (n0, n1) loses n1's box. The group recovers whole on the pool's two spares, node 0 on the
    first, both nodes resuming at the newest durable step; n0, alive but no longer the group's, meets the newer
    lease and ends fenced (its trainer stopped), and nothing it wrote after the takeover is what the group resumed."""
    n0, n1, s0, s1 = netns_boxes(4)
    for name, box in (("n0", n0), ("n1", n1)):
        rig.add(name, box)
    rig.add("s0", s0, pool="p")
    rig.add("s1", s1, pool="p")
    for name in ("n0", "n1"):
        rig.ctl("push", name, "--pyz", rig.pyz)
    rig.launch("n0 n1", "--nodes")
    wait_for(lambda: len(rig.committed()) >= 2, 60, "two commits by node 0")
    assert rig.run_on("n1") == RUN + ".node1" and rig.state("n1").get("state") == "running"
    rig.kill_box("n1")
    rig.keeper()
    rec = wait_for(rig.recovered, 120, "the group training again on the spares", 0.3)
    assert rec["boxes"] == ["s0", "s1"] and rec["recoveries"] == 1, rec
    last = rec["history"][-1]
    assert last["kind"] == "elsewhere" and last["take_over"] and "node 1" in last["reason"], last
    wait_for(lambda: rig.state("n0").get("state") == "fenced", 60, "n0 fenced by the group's newer lease")
    assert rig.run_on("s0") == RUN and rig.run_on("s1") == RUN + ".node1"
    starts = rig.starts()
    first = [(s["box"], s["start"]) for s in starts[:2]]
    assert sorted(first) == [("n0", 0), ("n1", 0)], starts
    again = [s for s in starts[2:]]
    assert sorted(s["box"] for s in again) == ["s0", "s1"], starts  # one launch per node, on the spares only
    node1 = [e for e in rig.events("s1") if e.get("type", "").startswith(("node_", "checkpoint_", "restore"))]
    assert again[0]["start"] == again[1]["start"] == last["resume_step"] > 0, (again, node1)
    # n0 trained on after n1's loss; what it committed after the takeover is not what the group resumed from
    lease = wait_for(lambda: _lease_of(rig, "s0"), 30, "the group's lease on node 0")
    assert lease["epoch"] >= 2 and (lease.get("resumed_from") or "").startswith("step_")
    ended = [e for e in rig.events("n0") if e.get("type") == "exit"]
    assert ended and ended[-1]["classification"] == "fenced", ended
