"""`make demo`: the whole onbox story on this one machine, no account, no cloud, in under three minutes.

A "rented box" is a real OpenSSH server on loopback whose /root is a private directory (tests/hosts/sshd_box.py),
so everything goes through the same path as a real rental: ssh, rsync, the zipapp run by the box's python.

    1. build onbox.pyz                       6. the box is preempted (SIGTERM): checkpoint, commit, exit 75
    2. start the embedded tracker            7. a relaunch resumes from the committed checkpoint
    3. add the box, push the pyz + code      8. onboxctl status while it finishes
    4. push the tracker token via stdin      9. the teardown gate refuses, pull + verify, the gate allows
    5. launch the example trainer (returns at once) and watch `onboxctl status`

Everything it creates lives under .demo/ and every process it starts is stopped by PID at the end.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from controller.boxes.inventory import Inventory  # noqa: E402
from controller.boxes.ssh import Ssh, SshSettings  # noqa: E402
from tests.hosts.sshd_box import (  # noqa: E402
    SshdBox,
    close_masters,
    dev_pyz,
    have_sshd,
    stop_tunnel_supervisors,
)

PY = sys.executable
WORK = os.path.join(REPO, ".demo")
RUN = "charlm-demo"
BOLD, DIM, RESET = ("\x1b[1m", "\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else ("", "", "")
T0 = time.monotonic()


def read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError:  # being written
        return None


def say(title: str, why: str = "") -> None:
    print("\n%s[%5.1fs] == %s%s" % (BOLD, time.monotonic() - T0, title, RESET), flush=True)
    if why:
        print("%s%s%s" % (DIM, why, RESET), flush=True)


class Demo:
    def __init__(self) -> None:
        shutil.rmtree(WORK, ignore_errors=True)
        os.makedirs(WORK)
        self.control = tempfile.mkdtemp(prefix="od", dir="/tmp")  # short: ControlPath sockets are length-limited
        self.env = dict(os.environ, ONBOX_CONFIG_DIR=os.path.join(WORK, "config"), ONBOX_SSH_CONTROL_DIR=self.control,
                        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
        for k in list(self.env):
            if k.startswith("ONBOX_") and k not in ("ONBOX_CONFIG_DIR", "ONBOX_SSH_CONTROL_DIR"):
                del self.env[k]
        self.box: Optional[SshdBox] = None
        self.tracker: Optional[subprocess.Popen] = None
        self.tracker_url = ""
        self.ssh = Ssh(SshSettings(control_dir=self.control))

    # -- helpers -------------------------------------------------------------------------------------------
    def onboxctl(self, *args: str, check: bool = True, stdin: Optional[str] = None, show: bool = True,
                 timeout: float = 120) -> subprocess.CompletedProcess:
        shown = " ".join(shlex.quote(a) for a in args)
        if show:
            print("%s$ onboxctl %s%s%s" % (BOLD, shown, " < " + stdin if stdin else "", RESET), flush=True)
        with open(stdin, "rb") if stdin else open(os.devnull, "rb") as fin:
            r = subprocess.run([PY, "-m", "controller", *args], env=self.env, stdin=fin, capture_output=True,
                               text=True, timeout=timeout)
        if show:
            for line in (r.stdout + r.stderr).rstrip().splitlines():
                print("  " + line)
        if check and r.returncode != 0:
            raise SystemExit("demo: `onboxctl %s` failed (exit %d)" % (shown, r.returncode))
        return r

    def wait(self, what: str, cond: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            time.sleep(interval)
        raise SystemExit("demo: gave up waiting for %s after %.0f s" % (what, timeout))

    def tracker_run(self) -> Dict[str, Any]:
        r = self.onboxctl("status", "--json", show=False, check=False)
        try:
            for row in json.loads(r.stdout)["runs"]:
                if row["run"] == RUN:
                    return row
        except (ValueError, KeyError):
            pass
        return {}

    def box_state(self) -> Dict[str, Any]:
        assert self.box is not None
        r = self.ssh.run(self.target(), [PY, ".onbox/onbox.pyz", "status", RUN, "--json"], check=False, timeout=30)
        try:
            return json.loads(r.text)
        except ValueError:
            return {}

    def target(self) -> Any:
        return Inventory(self.env["ONBOX_CONFIG_DIR"]).resolve("demo").target()

    # -- the story ------------------------------------------------------------------------------------------
    def build(self) -> str:
        say("1. Build onbox.pyz", "One file that runs on any box with python3: no pip, no internet, no root.")
        builder = os.path.join(REPO, "build", "zipapp.py")
        out = os.path.join(REPO, "dist", "onbox.pyz")
        if os.path.exists(builder):
            r = subprocess.run([PY, builder, "--out", os.path.join(REPO, "dist")], cwd=REPO, capture_output=True,
                               text=True, timeout=600)
            if r.returncode != 0:
                raise SystemExit("demo: the zipapp build failed:\n" + r.stdout[-2000:] + r.stderr[-2000:])
            for line in (r.stdout + r.stderr).splitlines():
                if line.startswith("zipapp: built"):
                    print("  " + line)
        else:
            os.makedirs(os.path.dirname(out), exist_ok=True)
            dev_pyz(out)
            print("  (shiv builder not in this checkout: a plain zipapp of onbox/ was built)")
        print("  %s: %d bytes" % (os.path.relpath(out, REPO), os.path.getsize(out)))
        return out

    def start_tracker(self) -> None:
        say("2. Start the embedded tracker", "Agents push heartbeats to it; `onboxctl status` reads it. "
            "The token lives in a file, never on a command line (U34).")
        token = os.path.join(WORK, "tracker.token")
        with open(token, "w") as f:
            f.write(os.urandom(16).hex() + "\n")
        os.chmod(token, 0o600)
        ready = os.path.join(WORK, "tracker.ready")
        with open(os.path.join(WORK, "tracker.log"), "wb") as log:  # the child keeps its own copy of the fd
            self.tracker = subprocess.Popen([PY, "-m", "controller", "tracker", "serve", "--db",
                                             os.path.join(WORK, "tracker.db"), "--host", "127.0.0.1", "--port", "0",
                                             "--token-file", token, "--ready-file", ready],
                                            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        info = self.wait("the tracker", lambda: os.path.exists(ready) and read_json(ready), 30, 0.1)
        self.tracker_url = "http://127.0.0.1:%d" % info["port"]
        self.env["ONBOX_TRACKER"] = self.tracker_url
        with open(token) as f:
            self.env["ONBOX_TRACKER_TOKEN"] = f.read().strip()
        print("  tracker at %s (pid %d)" % (self.tracker_url, self.tracker.pid))

    def start_box(self) -> None:
        say("3. A rented box", "A real sshd on 127.0.0.1 whose /root is %s/box/home — the box's own disk."
            % os.path.relpath(WORK, REPO))
        self.box = SshdBox(os.path.join(WORK, "box")).start()
        e = self.box.inventory_entry()
        args = ["box", "add", "demo", "--host", e["host"], "--port", str(e["port"]), "--user", "root",
                "--identity", e["identity"], "--python", PY, "--profile", "runpod"]
        for o in e["options"]:
            args += ["--ssh-option", o]
        self.onboxctl(*args)

    def push(self, pyz: str) -> None:
        say("4. Push the agent and the code, then the tracker token via stdin",
            "onbox.pyz is copied only when its hash differs; the code dir honours .gitignore; both are verified "
            "ON the box afterwards (U42). The secret flows stdin -> ssh -> a 0600 file (U34).")
        proj = os.path.join(WORK, "project")
        os.makedirs(proj)
        shutil.copy(os.path.join(REPO, "onbox", "examples", "charlm.py"), proj)
        with open(os.path.join(proj, ".gitignore"), "w") as f:
            f.write("checkpoints/\n__pycache__/\n")
        self.onboxctl("push", "demo", "--code", proj, "--pyz", pyz)
        self.onboxctl("secrets", "push", "demo", "tracker", stdin=os.path.join(WORK, "tracker.token"))

    def launch(self, first: bool) -> None:
        args = ["run", "demo", "--name", RUN, "--durable", "/root/durable", "--tracker", self.tracker_url,
                "--tracker-token-file", "/root/.onbox/secrets/tracker", "--heartbeat-interval", "1",
                "--sync-interval", "1", "--set", "settle_seconds=1", "--max-restarts", "0",
                "--", PY, "charlm.py", "--steps", "400", "--ckpt-every", "40", "--log-every", "10",
                "--step-delay", "0.05", "--threads", "1"]
        t = time.monotonic()
        self.onboxctl(*args)
        print("  (returned in %.1f s; the job runs on, detached from this ssh session)" % (time.monotonic() - t))

    def watch(self) -> None:
        say("5. Launch the example trainer and watch it",
            "A tiny char-level transformer (onbox/examples/charlm.py): full-state checkpoints written atomically, "
            "committed to the durable dir by the agent.")
        self.launch(first=True)
        row = self.wait("a committed checkpoint and step >= 120",
                        lambda: (lambda r: r if r.get("checkpoint") and (r.get("step") or 0) >= 120 else None)(
                            self.tracker_run()), 90)
        self.onboxctl("status")
        return row

    def preempt(self) -> None:
        say("6. The box is preempted", "The platform sends SIGTERM (spot reclaim). The agent forwards it, the "
            "trainer checkpoints, the agent commits that checkpoint to durable storage and exits 75.")
        st = self.box_state()
        pid = st.get("agent_pid")
        print("  kill -TERM %s   (the agent of %s, at step %s)" % (pid, RUN, (self.tracker_run() or {}).get("step")))
        self.ssh.run(self.target(), ["kill", "-TERM", str(pid)], timeout=30)
        st = self.wait("the run to end as preempted", lambda: (lambda s: s if s.get("state") in
                                                                ("preempted", "stopped", "failed", "done") else None)(
            self.box_state()), 60)
        print("  state: %s, last exit: %s" % (st.get("state"), json.dumps(st.get("last_exit"))[:160]))
        from controller.results.pull import newest, remote_run

        box = Inventory(self.env["ONBOX_CONFIG_DIR"]).resolve("demo")
        top = newest(remote_run(self.ssh, box, RUN)["checkpoints"])
        print("  newest committed checkpoint in /root/durable/%s: %s (step %s)" % (
            RUN, top.name if top else None, top.step if top else None))

    def resume(self) -> None:
        say("7. Relaunch: it resumes from the committed checkpoint",
            "The same `onboxctl run`; the agent finds the newest verified checkpoint and hands it to the trainer "
            "as ONBOX_RESUME_FROM. On a replacement box it would restore it from durable storage first.")
        self.launch(first=False)
        line = self.wait("the trainer's resume line", lambda: next(
            (ln for ln in self.onboxctl("logs", "demo", RUN, "-n", "400", show=False, check=False).stdout.splitlines()
             if '"resumed"' in ln), None), 60)
        print("  log: %s" % line.strip())

    def finish(self) -> None:
        say("8. onboxctl status while it finishes")
        self.wait("the run to finish", lambda: self.box_state().get("state") in ("done", "failed"), 120, 1.0)
        self.wait("the final heartbeat", lambda: self.tracker_run().get("state") in ("done", "failed"), 30)
        self.onboxctl("status")

    def gate(self) -> None:
        say("9. Teardown gate: pull, verify, and only then tear down",
            "The Iron Law: the box may go only when every run's newest durable checkpoint is home and verified.")
        self.onboxctl("down", "demo", "--yes", check=False)
        self.onboxctl("pull", "demo", RUN, os.path.join(WORK, "pulled"), "--latest")
        self.onboxctl("down", "demo", "--yes")

    def cleanup(self) -> None:
        stop_tunnel_supervisors(self.env["ONBOX_CONFIG_DIR"])  # `onboxctl down` stopped it; if the demo got there
        close_masters(self.control)  # the ssh master connections onboxctl kept for speed
        if self.tracker is not None and self.tracker.poll() is None:
            self.tracker.send_signal(signal.SIGTERM)
            try:
                self.tracker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.tracker.kill()
        if self.box is not None:
            # the run's agent lives in the box; it has finished, but stop anything left of this run by its PID
            self.box.stop()
        shutil.rmtree(self.control, ignore_errors=True)


def main(argv: List[str]) -> int:
    if not have_sshd():
        print("demo: needs OpenSSH server, client and rsync: run `make sysdeps`", file=sys.stderr)
        return 3
    if os.geteuid() != 0:
        print("demo: needs root (the box's private /root is a mount namespace)", file=sys.stderr)
        return 3
    import importlib.util

    def absent(mod: str) -> bool:
        try:
            return importlib.util.find_spec(mod) is None
        except ModuleNotFoundError:
            return True

    missing = [m for m in ("onbox.supervisor.loop", "onbox.checkpoints.hook", "onbox.heartbeat.hook",
                           "controller.tracker.app", "torch") if absent(m)]
    if missing:
        print("demo: this checkout lacks %s (subsystems still being merged?)" % ", ".join(missing), file=sys.stderr)
        return 3
    d = Demo()
    try:
        pyz = d.build()
        d.start_tracker()
        d.start_box()
        d.push(pyz)
        d.watch()
        d.preempt()
        d.resume()
        d.finish()
        d.gate()
    finally:
        d.cleanup()
    say("Done in %.0f s. Everything the demo made is under %s/." % (time.monotonic() - T0, os.path.relpath(WORK, REPO)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
