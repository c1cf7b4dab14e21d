"""The whole controller story against a "rental" box: a network namespace with its own address running sshd
(tests/hosts/netns.py), the tracker on the host side of the veth pair, the example trainer under onbox.

push -> run -> status via the tracker -> a network cut during the run (the job goes on; the heartbeats backfill)
-> the ssh client killed mid-command (the job goes on) -> `down` refuses -> pull interrupted part-way, resumed
-> verified (sizes and hashes, formats, loaded with torch: the pull says so) -> `down` allows.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from tests.conftest import REPO_ROOT, default_sigint, subprocess_env
from tests.hosts.sshd_box import close_masters
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NEEDED = ("torch",)  # the trainer's; onbox's own modules are imported, never skipped (a regression fails here)


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is missing
        return True


MISSING = [m for m in NEEDED if _absent(m)]
RUN = "e2e"




@pytest.mark.skipif(bool(MISSING), reason="needs the trainer's %s" % ", ".join(MISSING))
def test_rental_box_end_to_end(netns_box, tmp_path, onbox_pyz):
    from tests.hosts.tracker import TrackerProcess

    cm = tempfile.mkdtemp(prefix="oe", dir="/tmp")
    tracker = TrackerProcess(str(tmp_path / "tracker"), host=netns_box.netns.host_addr).start()
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm,
                          "ONBOX_TRACKER": tracker.url, "ONBOX_TRACKER_TOKEN": tracker.token,
                          "ONBOX_SSH_ALIVE_INTERVAL": "1", "ONBOX_SSH_ALIVE_COUNT": "2"})

    def ctl(*args, check=True, timeout=90, stdin=None):
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                           timeout=timeout, stdin=stdin)
        if check:
            assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r

    def tracker_row():
        doc = json.loads(ctl("status", "--json").stdout)
        return next((r for r in doc["runs"] if r["run"] == RUN), {})

    def beats():
        req = urllib.request.Request("%s/api/v1/runs/%s/heartbeats?after=-1&limit=1000" % (tracker.url, RUN),
                                     headers={"Authorization": "Bearer " + tracker.token})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["heartbeats"]

    try:
        e = netns_box.inventory_entry()
        add = ["box", "add", "b1", "--host", e["host"], "--port", str(e["port"]), "--user", "root",
               "--identity", e["identity"], "--python", e["python"]]
        for o in e["options"]:
            add += ["--ssh-option", o]
        ctl(*add)
        proj = tmp_path / "proj"
        proj.mkdir()
        shutil.copy(os.path.join(REPO_ROOT, "onbox", "examples", "charlm.py"), proj)
        ctl("push", "b1", "--code", str(proj), "--pyz", onbox_pyz)
        with open(tracker.token_file, "rb") as tok:
            ctl("secrets", "push", "b1", "tracker", stdin=tok)

        t0 = time.monotonic()
        ctl("run", "b1", "--name", RUN, "--durable", "/root/durable", "--tracker", tracker.url,
            "--tracker-token-file", "/root/.onbox/secrets/tracker", "--heartbeat-interval", "0.3",
            "--sync-interval", "0.5", "--set", "settle_seconds=0.5", "--max-restarts", "0", "--",
            e["python"], "charlm.py", "--steps", "260", "--ckpt-every", "40", "--log-every", "5",
            "--step-delay", "0.06", "--threads", "1", "--batch-size", "4", "--block", "32", "--d-model", "48")
        assert time.monotonic() - t0 < 30  # returns at once; the job is detached on the box

        row = wait_for(lambda: (lambda r: r if r.get("step") else None)(tracker_row()), 60, "the run in the tracker", 0.2)
        assert row["box"] == "b1" and row["state"] == "running" and row["liveness"] == "ok"

        # a partition: the box goes silent in the tracker, the job goes on, the backlog arrives afterwards
        netns_box.netns.cut()
        wait_for(lambda: tracker_row().get("liveness") == "silent", 30, "liveness silent", 0.2)
        cut_step = tracker_row()["step"]
        time.sleep(1.0)  # a little more training behind the cut
        netns_box.netns.restore()
        row = wait_for(lambda: (lambda r: r if r.get("liveness") == "ok" and r["step"] > cut_step else None)(
            tracker_row()), 30, "fresh beats after the cut", 0.2)
        seqs = {}
        for b in beats():
            seqs.setdefault(b["attempt"], []).append(b["seq"])
        for attempt, got in seqs.items():
            assert sorted(got) == list(range(min(got), max(got) + 1)), "gap in seqs of attempt %s" % attempt

        # the ssh client killed mid-command: the job does not notice
        follow = subprocess.Popen([sys.executable, "-m", "controller", "logs", "b1", RUN, "-f"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        assert follow.stdout is not None
        assert follow.stdout.readline()  # streaming
        os.killpg(follow.pid, signal.SIGKILL)
        follow.wait(timeout=10)
        before = tracker_row()["step"]
        wait_for(lambda: tracker_row()["step"] > before, 30, "steps after the client was killed", 0.2)

        wait_for(lambda: tracker_row().get("state") == "done", 90, "the run to finish", 0.5)

        # without a tracker, status asks the box over ssh: the same run, its progress and durable checkpoint
        r = subprocess.run([sys.executable, "-m", "controller", "status", "--json"], capture_output=True, text=True,
                           timeout=60, env={k: v for k, v in env.items() if not k.startswith("ONBOX_TRACKER")})
        over_ssh = json.loads(r.stdout)
        assert over_ssh["source"] == "ssh", r.stderr
        row = next(x for x in over_ssh["runs"] if x["run"] == RUN)
        assert row["state"] == "done" and row["step"] == 260 and row["checkpoint"], row

        r = ctl("down", "b1", "--yes", check=False)
        assert r.returncode == 1 and "not pulled" in r.stdout, r.stdout + r.stderr

        # the pull, interrupted part-way (Ctrl-C), then resumed
        dest = tmp_path / "pulled"
        p = subprocess.Popen([sys.executable, "-m", "controller", "pull", "b1", RUN, str(dest), "--latest",
                              "--bwlimit", "150"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, preexec_fn=default_sigint)
        ck_root = dest / RUN / "checkpoints"

        def part_arrived():
            temps = list(ck_root.glob("*/.*.pt.*")) + list(ck_root.glob("*/.onbox-partial/*"))
            return [t for t in temps if t.stat().st_size > 100_000]

        wait_for(part_arrived, 30, "part of the checkpoint", 0.05)
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=30)
        assert p.returncode != 0
        assert list(ck_root.glob("*/.onbox-partial/*"))  # what arrived is kept for the resume
        r = ctl("pull", "b1", RUN, str(dest), "--latest", "--json")
        rep = json.loads(r.stdout)
        assert rep["ok"] and rep["checkpoints"][0]["loaded"] is True and rep["newest"]
        assert re.search(r"; loaded [1-9]\d* file\(s\) with torch ", rep["checkpoints"][0]["checked"]), rep

        r = ctl("down", "b1", "--yes")
        assert "Gate passed" in r.stdout
    finally:
        tracker.stop()
        close_masters(cm)
        shutil.rmtree(cm, ignore_errors=True)
