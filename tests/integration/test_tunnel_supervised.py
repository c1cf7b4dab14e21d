"""The tracker tunnel stays up without the user: the supervisor `onboxctl run` starts beside it
(controller/boxes/tunnelwatch.py) re-opens it after a link drop, and `onboxctl tunnel --keep` prints each change once.

- a box in its own network namespace (it cannot reach this machine's 127.0.0.1), a real tracker on 127.0.0.1,
  `onboxctl run --tracker http://127.0.0.1:PORT`: the box's link is cut for 20 s (`ip -n NS link set IF down`,
  the namespace's unreachable route in place), the agent spools its beats, the ssh master dies of ServerAlive,
  and after the heal the supervisor re-opens the tunnel on the same box port and the spooled beats reach the
  tracker, in order and without a gap, with no command typed. The time from the heal to the re-open and to the
  spooled beats' arrival is printed. Then the run ends, and so does the supervisor; `tunnel --close` leaves nothing.
- `--keep` against a box whose sshd goes away and comes back: one line when it goes down, one when it is re-opened,
  and nothing more while nothing changes (it follows the new master: no "reopened" every interval).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import default_sigint, subprocess_env
from tests.hosts.sshd_box import close_masters, stop_tunnel_supervisors, tunnel_supervisors
from tests.hosts.tracker import TrackerProcess
from tests.polling import wait_for
from tests.processes import Started

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]

RUN = "kept"
TRAINER = ("import time\nfor i in range(100000):\n"
           "    print('iter %d: loss %.4f, time 5.00ms, mfu 1.00%%' % (i, 3.0 / (i + 1)), flush=True)\n"
           "    time.sleep(0.05)\n")
CUT_S = 20.0


class Ctl:
    def __init__(self, tmp_path, **env):
        self.cm = tempfile.mkdtemp(prefix="ow", dir="/tmp")
        self.cfg = str(tmp_path / "cfg")
        self.env = subprocess_env(dict({"ONBOX_CONFIG_DIR": self.cfg, "ONBOX_SSH_CONTROL_DIR": self.cm,
                                        "ONBOX_SSH_CONNECT_TIMEOUT": "3", "ONBOX_SSH_ALIVE_INTERVAL": "1",
                                        "ONBOX_SSH_ALIVE_COUNT": "3", "ONBOX_TUNNEL_POLL": "0.5",
                                        "ONBOX_TUNNEL_BACKOFF_MAX": "2", "ONBOX_TUNNEL_RUN_CHECK": "3"}, **env))

    def __call__(self, *args, check=True, stdin=None, timeout=120):
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout, stdin=stdin)
        if check and r.returncode != 0:
            raise AssertionError("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args[:2]), r.returncode, r.stdout,
                                                                    r.stderr))
        return r

    def add(self, name, box):
        e = box.inventory_entry()  # onbox's own host-key handling: no StrictHostKeyChecking of the test's
        self("box", "add", name, "--host", e["host"], "--port", str(e["port"]), "--user", "root",
             "--identity", e["identity"], "--python", e["python"])

    def record(self):
        try:
            with open(os.path.join(self.cfg, "tunnels.json")) as f:
                return json.load(f)["tunnels"][0]
        except (OSError, ValueError, IndexError, KeyError):
            return {}

    def close(self):
        stop_tunnel_supervisors(self.cfg)
        close_masters(self.cm)
        shutil.rmtree(self.cm, ignore_errors=True)


def cut(netns, side):
    """The box's own link down (`ip -n NS link set IF down`: its sockets learn at once that they have no route), or
    this machine's end of the veth pair (the box keeps its link up, as in a partition beyond it: its sshd's
    sessions learn nothing). The unreachable route for the box's /24 is in place either way (Netns.create)."""
    netns.check_route()
    if side == "box":
        netns.cut()
    else:
        subprocess.run(["ip", "link", "set", netns.host_if, "down"], check=True)
    no_route_out(netns)


def heal(netns, side):
    if side == "box":
        netns.restore()
    else:
        subprocess.run(["ip", "link", "set", netns.host_if, "up"], check=True)
    netns.check_route()


def no_route_out(netns):
    """The box's address goes nowhere but its veth: `ip route get` names that link, or fails on the unreachable
    route (this machine's end down takes its routes with it)."""
    r = subprocess.run(["ip", "route", "get", netns.box_addr], capture_output=True, text=True, timeout=10)
    assert ("dev %s" % netns.host_if in r.stdout) if r.returncode == 0 else "No route to host" in r.stderr, r
    assert "unreachable %s" % netns.subnet in subprocess.run(["ip", "route", "show", netns.subnet],
                                                               capture_output=True, text=True, timeout=10).stdout


@pytest.mark.parametrize("side", ["box", "laptop"])
def test_a_tunnel_opened_by_run_survives_a_link_cut_without_a_command(netns_box, tmp_path, onbox_pyz, side):
    tracker = TrackerProcess(str(tmp_path / "tracker")).start()  # 127.0.0.1: the box's netns cannot reach it
    ctl = Ctl(tmp_path, ONBOX_TRACKER=tracker.url, ONBOX_TRACKER_TOKEN=tracker.token)
    e = netns_box.inventory_entry()
    spool = os.path.join(netns_box.home, ".onbox", "runs", RUN, "heartbeats", "spool-tracker")

    def seqs():
        return sorted(b["seq"] for b in tracker.all_heartbeats(RUN))

    def spooled():
        try:
            return sorted(int(n.split(".")[0]) for n in os.listdir(spool) if n.split(".")[0].isdigit())
        except OSError:
            return []

    is_cut = False
    try:
        ctl.add("b1", netns_box)
        ctl("push", "b1", "--pyz", onbox_pyz)
        with open(tracker.token_file, "rb") as tok:
            ctl("secrets", "push", "b1", "tracker", stdin=tok)
        r = ctl("run", "b1", "--name", RUN, "--tracker", tracker.url, "--tracker-token-file",
                "/root/.onbox/secrets/tracker", "--heartbeat-interval", "0.5", "--json", "--",
                e["python"], "-c", TRAINER)
        [res] = json.loads(r.stdout)["runs"]
        port = res["tunnel"]["box_port"]
        sup = res["tunnel"]["supervisor"]
        assert res["ok"] and isinstance(sup, int), res
        assert [p for p, _ in tunnel_supervisors(ctl.cfg)] == [sup]
        with open("/proc/%d/environ" % sup, "rb") as f:  # it lives for days: no tracker token in its environment
            assert b"ONBOX_TRACKER_TOKEN=" not in f.read()
        assert res["tunnel"]["log"] == os.path.join(ctl.cfg, "tunnels", "b1-%d.log" % tracker.port)
        wait_for(lambda: seqs(), 60, "beats through the tunnel", 0.2)
        first_master = ctl.record()["master_pid"]
        assert ctl.record()["state"] == "up" and ctl.record()["reopens"] == 0

        # the cut: nothing for the box leaves its namespace; the master dies of ServerAlive, the agent spools
        cut(netns_box.netns, side)
        is_cut = True
        t_cut = time.monotonic()
        wait_for(lambda: ctl.record().get("state") == "down", 20, "the supervisor to see the tunnel down", 0.2)
        noticed = time.monotonic() - t_cut
        wait_for(lambda: len(spooled()) >= 5, 30, "beats spooled on the box", 0.2)
        time.sleep(max(0.0, t_cut + CUT_S - time.monotonic()))
        waiting = spooled()
        heal(netns_box.netns, side)
        is_cut = False
        t_heal = time.monotonic()
        heal_wall = time.time()

        # no command typed: the supervisor re-opens it on the same port, the spooled beats arrive
        rec = wait_for(lambda: (lambda r: r if r.get("state") == "up" and r.get("since", 0) >= heal_wall - 1 else
                                None)(ctl.record()), 60, "the supervisor to re-open the tunnel", 0.1)
        reopened = time.monotonic() - t_heal
        wait_for(lambda: set(waiting) <= set(seqs()), 120, "the beats spooled during the cut at the tracker", 0.2)
        arrived = time.monotonic() - t_heal
        print("\ntunnel cut %.0f s (%s side): seen down after %.1f s; after the heal re-opened in %.1f s, the %d "
              "spooled beats at the tracker in %.1f s" % (CUT_S, side, noticed, reopened, len(waiting), arrived))
        assert rec["remote_port"] == port and rec["master_pid"] != first_master and rec["reopens"] == 1, rec
        got = seqs()
        assert got == list(range(got[0], got[0] + len(got))), "a gap in the seqs"
        with open(res["tunnel"]["log"]) as f:
            log = f.read()
        assert "down: its ssh master is gone" in log and "reopened on box port %d" % port in log, log
        row = json.loads(ctl("tunnel", "b1", "--json").stdout)["tunnels"][0]
        assert row["state"] == "open" and row["reopens"] == 1 and row["supervisor"] == sup, row
        assert [p for p, _ in tunnel_supervisors(ctl.cfg)] == [sup]  # `tunnel` started no second one

        # the run ends: nothing needs the tunnel, the supervisor says so and goes
        subprocess.run(["ssh", *netns_box.client_options_argv(), "-p", str(e["port"]), "root@" + e["host"],
                        "%s .onbox/onbox.pyz stop %s --grace 2" % (e["python"], RUN)], capture_output=True,
                       timeout=60)
        wait_for(lambda: not tunnel_supervisors(ctl.cfg), 30, "the supervisor to end with the run", 0.2)
        with open(res["tunnel"]["log"]) as f:
            assert "no run on b1 has a live agent any more" in f.read()
        assert ctl.record().get("supervisor_pid") is None
        assert "closed b1 127.0.0.1:%d" % port in ctl("tunnel", "--close", "b1").stdout
        assert ctl.record() == {}
    finally:
        if is_cut:  # the run's agent and trainer live in the box: reach them to stop them
            heal(netns_box.netns, side)
        subprocess.run(["ssh", *netns_box.client_options_argv(), "-p", str(e["port"]), "root@" + e["host"],
                        "%s .onbox/onbox.pyz stop %s --grace 2" % (e["python"], RUN)], capture_output=True,
                       timeout=60)
        ctl.close()
        tracker.stop()


def test_keep_prints_one_line_per_change(sshd_box, tmp_path):
    """A tunnel recorded for a loopback box; its sshd stops (the master goes with its sessions) and starts again on
    the same port: --keep says `down at T`, then `reopened at T (down N s)`, and nothing else."""
    ctl = Ctl(tmp_path)
    try:
        ctl.add("b1", sshd_box)
        from controller.boxes.inventory import Inventory
        from controller.boxes.ssh import Ssh, SshSettings
        from controller.boxes.tunnel import Records, open_tunnel, start_supervisor

        ssh = Ssh(SshSettings(control_dir=ctl.cm, connect_timeout=3, alive_interval=1, alive_count=3))
        records = Records(ctl.cfg)
        box = Inventory(ctl.cfg).resolve("b1")
        t = open_tunnel(ssh, box, "http://127.0.0.1:9", records)  # what `onboxctl run` opens (no run needed here)
        saved = dict(os.environ)
        os.environ.update({k: v for k, v in ctl.env.items() if k.startswith("ONBOX_")})
        try:
            sup, why = start_supervisor(t, records)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert sup and why is None
        out = str(tmp_path / "keep.out")
        with Started() as started, open(out, "wb") as f:
            # Ctrl-C ends it below: its SIGINT must not be the ignored one a background runner passes down
            keep = started.popen([sys.executable, "-m", "controller", "tunnel", "b1", "--keep", "--interval", "1"],
                                 env=ctl.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=default_sigint)

            def lines():
                with open(out) as g:
                    return [ln for ln in g.read().splitlines() if ln.strip()]

            wait_for(lambda: lines(), 20, "--keep's first line")
            assert len(lines()) == 1 and ": open (up since " in lines()[0] and "supervised by pid %d" % sup in \
                lines()[0], lines()
            sshd_box.stop()
            wait_for(lambda: len(lines()) >= 2, 30, "--keep to say the tunnel is down")
            time.sleep(3)
            sshd_box.start()
            wait_for(lambda: len(lines()) >= 3, 30, "--keep to say it was re-opened")
            time.sleep(4)  # several intervals with nothing new: nothing more is said
            keep.send_signal(signal.SIGINT)
            keep.wait(timeout=20)
            got = lines()
        assert len(got) == 3, got
        head = "tunnel: b1 127.0.0.1:%d -> 127.0.0.1:9: " % t.remote_port
        # the reason: the master gone, or (when the supervisor tried already) why the box did not answer
        assert got[1].startswith(head + "down at ") and ("its ssh master is gone" in got[1] or
                                                         "nothing accepts ssh connections" in got[1]), got
        assert got[2].startswith(head + "reopened at ") and " (down " in got[2], got
        assert Records(ctl.cfg).get(t.key).reopens == 1
    finally:
        ctl.close()
