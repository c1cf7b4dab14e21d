"""The README journey, for real: a tracker on the laptop's 127.0.0.1, a box in its own network namespace (which
cannot reach that address), `onboxctl run --tracker http://127.0.0.1:PORT`, and the run's heartbeats arrive
through the reverse tunnel onboxctl opens over the box's ssh master. Then the tunnel's lifetime: onboxctl has
exited and the tunnel stays; its master dies and the agent spools; `onboxctl tunnel BOX` re-opens it on the same
box port and the backlog arrives without a gap; `--close` closes it. This is the tunnel by hand, without its
supervisor (ONBOX_TUNNEL_WATCH=0); test_tunnel_supervised.py has the supervised one."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import subprocess_env
from tests.hosts.sshd_box import close_masters, stop_tunnel_supervisors, tunnel_supervisors
from tests.hosts.tracker import TrackerProcess
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.root]

RUN = "tunnelled"
TRAINER = ("import time\nfor i in range(100000):\n"
           "    print('iter %d: loss %.4f, time 5.00ms, mfu 1.00%%' % (i, 3.0 / (i + 1)), flush=True)\n"
           "    time.sleep(0.05)\n")  # nanoGPT's line: the agent reads step and loss from it


def test_box_reaches_a_loopback_tracker_through_the_tunnel(netns_box, tmp_path, onbox_pyz):
    cm = tempfile.mkdtemp(prefix="ot", dir="/tmp")
    tracker = TrackerProcess(str(tmp_path / "tracker")).start()  # 127.0.0.1: unreachable from the box's netns
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm,
                          "ONBOX_TRACKER": tracker.url, "ONBOX_TRACKER_TOKEN": tracker.token,
                          "ONBOX_TUNNEL_WATCH": "0"})
    e = netns_box.inventory_entry()

    def ctl(*args, check=True, stdin=None):
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                           timeout=120, stdin=stdin)
        if check and r.returncode != 0:
            raise AssertionError("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args[:2]), r.returncode, r.stdout,
                                                                    r.stderr))
        return r

    def on_box(script):
        return subprocess.run([*netns_box.netns.exec_prefix(), "sh", "-c", script], capture_output=True, text=True,
                              timeout=30)

    def seqs():
        return sorted(b["seq"] for b in tracker.all_heartbeats(RUN))

    try:
        add = ["box", "add", "b1", "--host", e["host"], "--port", str(e["port"]), "--user", "root",
               "--identity", e["identity"], "--python", e["python"]]
        for o in e["options"]:
            add += ["--ssh-option", o]
        ctl(*add)
        ctl("push", "b1", "--pyz", onbox_pyz)
        with open(tracker.token_file, "rb") as tok:
            ctl("secrets", "push", "b1", "tracker", stdin=tok)
        r = ctl("run", "b1", "--name", RUN, "--tracker", tracker.url, "--tracker-token-file",
                "/root/.onbox/secrets/tracker", "--heartbeat-interval", "0.2", "--json", "--",
                e["python"], "-c", TRAINER)
        [res] = json.loads(r.stdout)["runs"]
        port = res["tunnel"]["box_port"]
        assert res["ok"] and res["tracker"] == "http://127.0.0.1:%d" % port, res
        assert res["tunnel"]["supervisor"] is None and res["tunnel"]["unsupervised"] == "ONBOX_TUNNEL_WATCH=0", res
        assert not tunnel_supervisors(env["ONBOX_CONFIG_DIR"])
        # onboxctl has exited; the beats arrive through the tunnel it left in place
        wait_for(lambda: [b for b in tracker.all_heartbeats(RUN) if (b.get("progress") or {}).get("step")], 60,
                 "beats with progress through the tunnel", 0.2)
        row = json.loads(ctl("status", "--json").stdout)["runs"][0]
        assert row["run"] == RUN and row["box"] == "b1" and row["step"] is not None

        # the box side listens on its own loopback only
        listening = on_box("ss -ltnH 'sport = :%d'" % port).stdout
        assert {line.split()[3] for line in listening.splitlines()} == {"127.0.0.1:%d" % port}, listening

        # the master (and so the tunnel) dies: the agent keeps its beats; status says so and how to fix it
        subprocess.run(["ssh", "-o", "ControlPath=%s/%%C" % cm, "-p", str(e["port"]), "-O", "exit", "--",
                        "root@" + e["host"]], capture_output=True, timeout=30)
        wait_for(lambda: "tunnel of b1 is down" in ctl("status").stdout, 30, "status to notice the tunnel is down")
        before = len(seqs())
        spool = os.path.join(netns_box.home, ".onbox", "runs", RUN, "heartbeats", "spool-tracker")
        wait_for(lambda: len(os.listdir(spool)) >= 3, 30, "beats spooled on the box")
        r = ctl("tunnel", "b1", "--json")
        [row] = json.loads(r.stdout)["tunnels"]
        assert {k: row[k] for k in ("box", "to", "box_port", "state", "reopens", "supervisor")} == {
            "box": "b1", "to": "127.0.0.1:%d" % tracker.port, "box_port": port, "state": "reopened", "reopens": 1,
            "supervisor": None}, row
        wait_for(lambda: len(seqs()) > before + 3, 60, "the backlog and new beats after the re-open", 0.2)
        got = seqs()
        assert got == list(range(got[0], got[0] + len(got))), "a gap in the seqs"  # nothing lost while it was down
        assert json.loads(ctl("tunnel", "b1", "--json").stdout)["tunnels"][0]["state"] == "open"

        r = ctl("tunnel", "--close", "b1")
        assert "closed b1 127.0.0.1:%d" % port in r.stdout
        wait_for(lambda: "127.0.0.1:%d" % port not in on_box("ss -ltnH").stdout, 30, "the box port to close")
        assert ctl("tunnel", "b1", check=False).returncode == 2  # nothing recorded any more

        # the journey's stop: the agent's own, and what became of the run (no --durable: nothing committed)
        r = ctl("stop", "b1", RUN, "--wait", "--grace", "2")
        lines = r.stdout.splitlines()
        assert lines[1].startswith("b1/%s: stopped after " % RUN) and lines[2] == (
            "  nothing is committed: the run has no durable storage (no --durable); its checkpoints stay on the box"), \
            r.stdout  # the agent's own why
    finally:
        subprocess.run(["ssh", *netns_box.client_options_argv(), "-p", str(e["port"]), "root@" + e["host"],
                        "%s .onbox/onbox.pyz stop %s --grace 2" % (e["python"], RUN)], capture_output=True, timeout=60)
        tracker.stop()
        stop_tunnel_supervisors(env["ONBOX_CONFIG_DIR"])
        close_masters(cm)
        shutil.rmtree(cm, ignore_errors=True)
