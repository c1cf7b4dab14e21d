"""The README's journey ("The journey, from your laptop"), command by command, against a box with an address of its
own (a network namespace with its own sshd, which cannot reach this machine's 127.0.0.1, as a rented box cannot),
with the tracker on this machine: add a never-seen box, push the code, the token, the tracker, the secret, run,
status; then what the first hour brings: a 60 s link cut healed without a command typed, a preemption, and the same
`onboxctl run` line again resuming its run; then stop, pull and down. Each step's time is printed.

Deviations from the README's lines, each because the box is a test box: its port and key (`--port`, `--identity`),
its python (the inventory's `--python`, and the same path in the run's command), a free tracker port, and a durable
dir under the box's own /root (the namespace shares this machine's other directories).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional

import pytest

from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.sshd_box import close_masters, free_port, stop_tunnel_supervisors
from tests.polling import wait_for
from tests.processes import Started, kill_exact

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]

CUT_S = 60.0
TRAIN = """import os, runpy, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.argv = [os.path.join(here, "keep_trainer.py"), "--steps", "100000", "--interval", "0.05", "--save-every", "20",
            "--trace", os.path.join(here, "trace.jsonl")]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def test_the_readme_journey_on_a_box_of_its_own(netns_box, tmp_path, onbox_pyz):
    e = netns_box.inventory_entry()
    py = e["python"]
    cm = tempfile.mkdtemp(prefix="oj", dir="/tmp")
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm,
                          "ONBOX_PYZ": onbox_pyz, "ONBOX_SSH_CONNECT_TIMEOUT": "5"})
    env.pop("ONBOX_TRACKER", None)
    env.pop("ONBOX_TRACKER_TOKEN", None)
    code = tmp_path / "code"
    code.mkdir()
    for name in ("keep_trainer.py", "slurm_trainer.py"):
        shutil.copy(os.path.join(REPO_ROOT, "tests", "integration", name), str(code / name))
    (code / "train.py").write_text(TRAIN)
    token = str(tmp_path / "onbox-token")
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # (umask 077; openssl rand -hex 32 > ...)
    os.write(fd, (secrets.token_hex(32) + "\n").encode())
    os.close(fd)
    took: Dict[str, float] = {}

    def ctl(*args: str, stdin: Optional[str] = None, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=env, input=stdin, capture_output=True,
                           text=True, timeout=timeout, cwd=str(tmp_path))
        if check and r.returncode != 0:
            raise AssertionError("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args[:3]), r.returncode, r.stdout,
                                                                    r.stderr))
        return r

    def ctl_on_a_terminal(args: List[str], typed: str) -> subprocess.CompletedProcess:
        """onboxctl with a terminal as its stdin (a pty), `typed` written to it."""
        import pty

        leader, follower = pty.openpty()
        try:
            p = subprocess.Popen([sys.executable, "-m", "controller", *args], env=env, stdin=follower,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
            os.write(leader, typed.encode())
            out, err = p.communicate(timeout=180)
        finally:
            os.close(follower)
            os.close(leader)
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if r.returncode != 0:
            raise AssertionError("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args), r.returncode, out, err))
        return r

    def step(name: str, t0: float) -> None:
        took[name] = time.monotonic() - t0

    def box_state(run: str) -> Dict:
        try:
            with open(os.path.join(netns_box.home, ".onbox", "runs", run, "state.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    with Started() as started:
        try:
            t = time.monotonic()
            ctl("box", "add", "gpu1", "--host", e["host"], "--user", "root", "--profile", "runpod",
                "--port", str(e["port"]), "--identity", e["identity"], "--python", py)
            step("box add", t)

            t = time.monotonic()
            r = ctl("push", "gpu1", "--code", str(code))
            step("push (a never-seen box)", t)
            known = os.path.join(env["ONBOX_CONFIG_DIR"], "known_hosts")
            assert os.path.getsize(known) > 0, "the box's host key was not recorded on first contact"

            t = time.monotonic()
            port = free_port()
            with open(str(tmp_path / "tracker.out"), "w") as out:  # the child keeps its own copy of the fd
                tracker = started.popen([sys.executable, "-m", "controller", "tracker", "serve", "--token-file",
                                         token, "--port", str(port), "--db", str(tmp_path / "tracker.db")],
                                        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            url = "http://127.0.0.1:%d" % port
            said = wait_for(lambda: (lambda s: s if "dashboard" in s else None)(_text(str(tmp_path / "tracker.out"))),
                            30, "the tracker's lines")
            assert "listening on %s" % url in said and "log in with the token in %s" % token in said, said
            step("tracker serve", t)

            t = time.monotonic()
            with open(token) as f:
                ctl("secrets", "push", "gpu1", "tracker", stdin=f.read())
            step("secrets push", t)

            run_line = ["run", "gpu1", "--durable", "/root/durable", "--tracker", url,
                        "--tracker-token-file", "/root/.onbox/secrets/tracker", "--heartbeat-interval", "5",
                        "--", py, "train.py"]
            t = time.monotonic()
            r = ctl(*run_line)
            step("run", t)
            m = re.search(r"started run (\S+)", r.stdout)
            assert m and "new run %s" % m.group(1) in r.stdout, r.stdout
            run = m.group(1)
            assert tracker.poll() is None

            env["ONBOX_TRACKER"] = url
            with open(token) as f:
                env["ONBOX_TRACKER_TOKEN"] = f.read().strip()
            t = time.monotonic()

            def row():
                rows = json.loads(ctl("status", "--json").stdout)["runs"]
                mine = [x for x in rows if x.get("run") == run and x.get("step")]
                return mine[0] if mine else None

            first = wait_for(row, 60, "the run's step in onboxctl status", 0.5)
            assert first["box"] == "gpu1"
            step("status shows its step", t)

            def seqs() -> List[int]:
                req = urllib.request.Request("%s/api/v1/runs/%s/heartbeats?after=-1&limit=1000" % (url, run),
                                             headers={"Authorization": "Bearer " + env["ONBOX_TRACKER_TOKEN"]})
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return sorted(b["seq"] for b in json.loads(resp.read())["heartbeats"])

            # a 60 s cut of the box's link; healed without any command typed here
            netns_box.netns.cut()
            try:
                time.sleep(CUT_S)
            finally:
                netns_box.netns.restore()
            t = time.monotonic()
            before = seqs()
            # every beat of the cut arrives (spooled on the box), and new ones after them: no gap in the seqs
            got = wait_for(lambda: (lambda q: q if len(q) >= len(before) + int(CUT_S / 5) else None)(seqs()), 120,
                           "the cut's beats after the heal", 0.5)
            assert got == list(range(got[0], got[0] + len(got))), "a gap in the beats: %s" % got
            step("beats of the 60 s cut arrive (no command)", t)

            # a preemption: SIGTERM to the agent, as the platform sends it; checkpoint, commit, exit 75
            st = box_state(run)
            t = time.monotonic()
            assert kill_exact(st["agent_pid"], st["agent_start_time"], signal.SIGTERM)
            wait_for(lambda: box_state(run).get("state") == "preempted", 60, "the run preempted", 0.2)
            step("preempted (checkpoint, commit)", t)

            # the same line again: the run is found and resumed
            t = time.monotonic()
            r = ctl(*run_line)
            step("the same run line again", t)
            m = re.search(r"resuming %s from step (\d+)" % re.escape(run), r.stdout)
            assert m, r.stdout
            resumed_at = int(m.group(1))
            trace = os.path.join(netns_box.home, ".onbox", "code", "code", "trace.jsonl")
            starts = wait_for(lambda: (lambda s: s if len(s) >= 2 else None)(
                [json.loads(x) for x in _text(trace).splitlines() if x.strip()]),
                60, "the trainer's second start")
            assert starts[-1]["start"] == resumed_at > 0, starts

            t = time.monotonic()
            r = ctl("stop", "gpu1", run, "--wait")
            assert "stopped after" in r.stdout and "newest durable checkpoint" in r.stdout, r.stdout
            step("stop --wait", t)

            t = time.monotonic()
            r = ctl("pull", "gpu1", run, str(tmp_path / "results"))
            assert "verified" in r.stdout and "OK" in r.stdout, r.stdout
            step("pull", t)

            t = time.monotonic()
            r = ctl_on_a_terminal(["down", "gpu1"], typed="gpu1\n")  # typing the box name back, as a person does
            assert "Gate passed: every run's newest checkpoint on gpu1 is pulled and verified." in r.stdout, r.stdout
            assert "terminate the pod" in r.stdout, r.stdout
            step("down", t)
        finally:
            print("\nthe README journey, step by step (a netns box, heartbeat 5 s):")
            for name, s in took.items():
                print("  %-45s %6.1f s" % (name, s))
            subprocess.run([*netns_box.netns.exec_prefix(), "true"], capture_output=True)
            stop_tunnel_supervisors(env["ONBOX_CONFIG_DIR"])
            close_masters(cm)
            shutil.rmtree(cm, ignore_errors=True)
            for name in os.listdir(os.path.join(netns_box.home, ".onbox", "runs")) \
                    if os.path.isdir(os.path.join(netns_box.home, ".onbox", "runs")) else []:
                st = box_state(name)
                for k in ("agent", "child"):
                    pid, start = st.get(k + "_pid"), st.get(k + "_start_time")
                    if isinstance(pid, int) and isinstance(start, int) and st.get("state") not in (
                            "done", "failed", "preempted", "stopped", "fenced"):
                        kill_exact(pid, start)
