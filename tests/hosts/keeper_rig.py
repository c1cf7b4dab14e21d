"""The controller side of a keeper scenario over real ssh boxes (tests/hosts/sshd_box.py): a config dir, an ssh control
dir, a durable dir every box shares (a mounted durable target), the trace of tests/integration/keep_trainer.py, and
what it started. Shared by tests/integration/test_keeper_ssh.py and tests/bench/bench_keeper.py.

Everything it signals is its own, by PID and start time (tests/processes.py): the keepers it started, and the agent
and trainer of its run as the box's state.json names them.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Optional

from tests.checkpoint_files import committed_steps
from tests.conftest import REPO_ROOT, subprocess_env
from tests.hosts.sshd_box import BridgeNet, close_masters
from tests.processes import Started, kill_exact

RUN = "kp"
TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "keep_trainer.py")
PHASES = ("detected", "declared_lost", "box_chosen", "pushed", "relaunched", "first_new_step")

# ssh settings that make a test's dead box read as dead within seconds (the defaults take tens of seconds)
FAST_SSH = {"ONBOX_SSH_CONNECT_TIMEOUT": "3", "ONBOX_SSH_ALIVE_INTERVAL": "1", "ONBOX_SSH_ALIVE_COUNT": "2"}
FAST_KEEP = ("--interval", "0.3", "--probe-timeout", "5")


class Rig:
    """One scenario's controller side. `fast` (the tests): short ssh timeouts and a keeper that passes every 0.3 s
    with 5 s probes; without it (the benchmark) onboxctl's defaults."""

    def __init__(self, tmp: Any, pyz: str, run: str = RUN, fast: bool = True) -> None:
        self.tmp = pathlib.Path(tmp)
        self.pyz = pyz
        self.run = run
        self.fast = fast
        self.cm = tempfile.mkdtemp(prefix="ok", dir="/tmp")  # short: unix socket paths are limited to ~104 bytes
        self.cfg = str(self.tmp / "cfg")
        self.durable = str(self.tmp / "durable")
        self.trace = str(self.tmp / "trace.jsonl")
        os.makedirs(self.durable)
        self.durable_spec = self.durable  # what --durable says (an rclone remote where storage is cut too)
        self.env = subprocess_env(dict({"ONBOX_CONFIG_DIR": self.cfg, "ONBOX_SSH_CONTROL_DIR": self.cm,
                                        "ONBOX_PYZ": pyz}, **(FAST_SSH if fast else {})))
        self.started = Started()
        self.boxes: Dict[str, Any] = {}

    def ctl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "controller", *args], env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError("onboxctl %s exited %d:\n%s\n%s" % (" ".join(args[:4]), r.returncode, r.stdout,
                                                                     r.stderr))
        return r

    def wrapper(self, name: str, slow_run: float = 0.0, marker: Optional[str] = None) -> str:
        """A `python` for a box that takes `slow_run` seconds before an `onbox run` starts (a slow box), marking each
        such start in `marker`."""
        path = str(self.tmp / ("py-" + name))
        lines = ["#!/bin/sh"]
        if marker:
            lines.append('[ "$2" = run ] && { echo run >> %s; sleep %s; }' % (marker, slow_run))
        lines.append('exec %s "$@"' % sys.executable)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    def add(self, name: str, box: Any, pool: Optional[str] = None, python: Optional[str] = None) -> None:
        e = box.inventory_entry()
        argv = ["box", "add", name, "--host", e["host"], "--port", str(e["port"]), "--user", "root",
                "--identity", e["identity"], "--python", python or sys.executable]
        for o in e["options"]:
            argv += ["--ssh-option", o]
        self.ctl(*argv, *(["--pool", pool] if pool else []))
        self.boxes[name] = box

    def run_argv(self, box: str, *extra: str, heartbeat: float = 1.0, lost_after: Optional[str] = "3s",
                 step_interval: float = 0.05, save_every: int = 5, first_step: bool = False) -> List[str]:
        """`onboxctl run BOX ...` of the rig's run (`lost_after` None: the keeper's default for the heartbeat);
        several boxes, space-separated, with "--nodes" in `extra`: a group."""
        return ["run", *box.split(), "--name", self.run, "--durable", self.durable_spec, "--recover", "pool:p", "--workdir",
                str(self.tmp), "--heartbeat-interval", "%g" % heartbeat, "--sync-interval", "0.3", "--set",
                "settle_seconds=0.3", "--set", "notice_source=none", "--max-restarts", "0",
                *(["--lost-after", lost_after] if lost_after else []), "--backoff", "0.5s", "--max-at-risk", "1h",
                *extra, "--", sys.executable, TRAINER, "--steps", "100000", "--interval", "%g" % step_interval,
                "--save-every", str(save_every), "--trace", self.trace, *(["--trace-first-step"] if first_step else [])]

    def launch(self, box: str, *extra: str, **kw: Any) -> None:
        self.ctl(*self.run_argv(box, *extra, **kw))

    def keeper(self, *args: str) -> subprocess.Popen:
        with open(str(self.tmp / "keep.out"), "ab") as out:  # the child keeps its own copy of the fd
            return self.started.popen([sys.executable, "-m", "controller", "keep", *(FAST_KEEP if self.fast else ()),
                                       "--json", *args], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def record(self) -> Dict[str, Any]:
        try:
            with open(os.path.join(self.cfg, "runs", self.run, "recovery.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def recovered(self) -> Optional[Dict[str, Any]]:
        """The keeper's record once its newest recovery saw the first new step (None before)."""
        rec = self.record()
        last = (rec.get("history") or [None])[-1]
        return rec if last and "first_new_step" in last["phases"] else None

    def _trace(self) -> List[Dict[str, Any]]:
        try:
            with open(self.trace) as f:
                return [json.loads(x) for x in f if x.strip()]
        except OSError:
            return []

    def starts(self) -> List[Dict[str, Any]]:
        """The trainer's starts: box, the step it started from, the checkpoint it resumed, its time."""
        return [x for x in self._trace() if "start" in x]

    def first_steps(self) -> List[Dict[str, Any]]:
        """Each start's first trained step and its time (launched with `first_step=True`)."""
        return [x for x in self._trace() if "first_step" in x]

    def run_on(self, name: str) -> str:
        """The run's name on box `name`: the rig's run, or `<run>.node<N>` where the box is node N of a group."""
        runs = os.path.join(self.boxes[name].home, ".onbox", "runs")
        nodes = sorted(n for n in (os.listdir(runs) if os.path.isdir(runs) else []) if n.startswith(self.run + ".node"))
        return nodes[0] if nodes else self.run

    def state(self, name: str) -> Dict[str, Any]:
        try:
            with open(os.path.join(self.boxes[name].home, ".onbox", "runs", self.run_on(name), "state.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def events(self, name: str) -> List[Dict[str, Any]]:
        """The agent's events.jsonl of the run on box `name`."""
        try:
            with open(os.path.join(self.boxes[name].home, ".onbox", "runs", self.run_on(name), "events.jsonl")) as f:
                return [json.loads(x) for x in f if x.strip()]
        except OSError:
            return []

    def committed(self) -> List[int]:
        return committed_steps(self.durable, self.run)

    def durable_files(self) -> List[str]:
        return sorted(os.path.relpath(os.path.join(dp, f), self.durable) for dp, _, fs in os.walk(self.durable)
                      for f in fs)

    def kill_run(self, name: str, sig: int = signal.SIGKILL) -> None:
        """The agent and the trainer of the run on box `name`, each by PID and start time (never a recycled PID)."""
        st = self.state(name)
        for pid_key, start_key in (("agent_pid", "agent_start_time"), ("child_pid", "child_start_time")):
            pid, start = st.get(pid_key), st.get(start_key)
            if isinstance(pid, int) and isinstance(start, int):
                kill_exact(pid, start, sig)
            if sig != signal.SIGKILL:
                return  # a preemption: the agent alone gets the signal, it stops its trainer itself

    def kill_box(self, name: str, cut: bool = False) -> None:
        """Box `name` dies: its run killed, its sshd stopped (and the sessions it serves). `cut`: its link goes down
        first, so it answers nothing at all (a connection times out instead of being refused) and no word of the
        dying sshd reaches anyone, as with a box that lost power."""
        if cut:
            subprocess.run(["ip", "-n", self.boxes[name].netns.ns, "link", "set", BridgeNet.IFNAME, "down"],
                           check=True, timeout=30)
        self.kill_run(name)
        self.boxes[name].stop()

    def close(self) -> None:
        self.started.stop()  # the keepers
        for name in self.boxes:
            st = self.state(name)
            if st.get("state") not in ("done", "failed", "preempted", "stopped", "fenced"):
                self.kill_run(name)
        close_masters(self.cm)
        shutil.rmtree(self.cm, ignore_errors=True)

    def took_over(self, name: str) -> bool:
        """Whether the agent on box `name` took the run's lease over from an earlier holder (its `lease_taken` event
        names the lease it superseded)."""
        return any(e.get("type") == "lease_taken" and (e.get("previous") or {}).get("epoch") is not None
                   for e in self.events(name))

    @contextlib.contextmanager
    def named(self, run: str) -> Iterator["Rig"]:
        """The rig's helpers about run `run` for a while (a second run in the same config dir)."""
        was, self.run = self.run, run
        try:
            yield self
        finally:
            self.run = was

    def newest_step(self, name: str) -> int:
        """The newest step the run's trainer on box `name` printed (its output log), 0 before the first."""
        log = os.path.join(self.boxes[name].home, ".onbox", "runs", self.run_on(name), "output.log")
        step = 0
        try:
            with open(log, errors="replace") as f:
                lines = f.readlines()[-50:]
        except OSError:
            return 0
        for line in lines:
            try:
                step = max(step, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError, TypeError):
                continue
        return step

    def provision_marker(self) -> str:
        """A provision command that notes each call in a file and fails (for tests where none may be called): its
        path; the file is `<path>.called`."""
        path = str(self.tmp / "new-box.sh")
        with open(path, "w") as f:
            f.write("#!/bin/sh\necho \"$ONBOX_PROVISION_KEY\" >> %s.called\necho 'no capacity' >&2\nexit 1\n" % path)
        os.chmod(path, 0o755)
        return path
