"""A private Docker daemon for the container tests, with a local image that runs Python (no registry).

    def test_x(docker_daemon, docker_env):   # one dockerd per test session (and xdist worker)
        docker_daemon.image                  # tag of the local Python image (build/python_image.py, imported)
        docker_daemon.cli(["ps", "-q"])      # the docker CLI against this daemon
        docker_env                           # DOCKER_HOST (and DOCKER_CONFIG) set in os.environ for the test

The daemon is Debian's `dockerd` (docker.io, installed by build/sysdeps.sh), started in the foreground with
everything under one short temp dir (unix socket paths are limited to 108 bytes): `--data-root`, `--exec-root`,
`--pidfile`, `-H unix://<dir>/docker.sock`, the overlay2 storage driver or vfs where overlay2 fails. It never
touches the host's network: `--iptables=false --ip6tables=false --bridge=none`, and the tests run their containers
with `--network none`. It starts its own containerd under the exec root; the teardown removes the daemon's
containers, TERMs exactly the dockerd it started (KILL after a bounded wait) and that containerd by pid and start
time if it outlived dockerd, unmounts what is still mounted under the temp dir, and removes it.

Skipped, saying why, only where the daemon cannot run: no dockerd installed, not root, dockerd refusing to start
with either storage driver, or the Debian Python packages the image is made of missing.
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
from typing import Dict, List, Optional

import pytest

from tests.conftest import REPO_ROOT
from tests.processes import kill_exact, pid_alive, start_ticks

DRIVERS = ("overlay2", "vfs")
READY_S = 30.0  # dockerd answers in ~0.3 s here; the bound is for a loaded machine
STOP_S = 20.0
CLI_S = 60.0


def dockerd_path() -> Optional[str]:
    found = shutil.which("dockerd")
    if found:
        return found
    return "/usr/sbin/dockerd" if os.access("/usr/sbin/dockerd", os.X_OK) else None


class DockerDaemon:
    """One dockerd under `root`; `start()` tries each storage driver, `stop()` leaves nothing behind."""

    def __init__(self, root: str, dockerd: str) -> None:
        self.root = root
        self.dockerd = dockerd
        self.sock = os.path.join(root, "docker.sock")
        self.host = "unix://" + self.sock
        self.data_root = os.path.join(root, "data")
        self.exec_root = os.path.join(root, "exec")
        self.log_path = os.path.join(root, "dockerd.log")
        self.proc: Optional[subprocess.Popen] = None
        self.driver = ""
        self.image = ""
        self.containerd: Optional[tuple] = None  # (pid, start ticks) of the containerd this dockerd started
        self.env: Dict[str, str] = {"DOCKER_HOST": self.host, "DOCKER_CONFIG": os.path.join(root, "cli")}

    # -- clients
    def cli(self, args: List[str], timeout: float = CLI_S, check: bool = True) -> "subprocess.CompletedProcess[str]":
        """`docker ARGS` against this daemon (the first docker CLI on PATH, as the agent finds it)."""
        env = dict(os.environ, **self.env)
        cp = subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=timeout)
        if check and cp.returncode != 0:
            raise AssertionError("docker %s failed (%d): %s" % (" ".join(args), cp.returncode, cp.stderr.strip()))
        return cp

    def inspect(self, ref: str) -> Optional[dict]:
        """`docker inspect REF` as a dict, None when the daemon has no such container."""
        cp = self.cli(["inspect", "--type", "container", ref], check=False)
        return json.loads(cp.stdout)[0] if cp.returncode == 0 else None

    def containers(self, *filters: str, running_only: bool = False) -> List[str]:
        """Ids of the daemon's containers matching each `--filter` (e.g. "label=onbox.run=r1")."""
        args = ["ps", "-q", "--no-trunc"] + ([] if running_only else ["-a"])
        for f in filters:
            args += ["--filter", f]
        return self.cli(args).stdout.split()

    def events(self, since: float, ref: str) -> List[dict]:
        """The daemon's events for one container since `since` (epoch seconds), up to now: what was asked of it
        (kill with its signal, stop, die with its exit code, destroy)."""
        cp = self.cli(["events", "--since", "%.3f" % since, "--until", "%.3f" % time.time(), "--filter",
                       "container=%s" % ref, "--format", "{{json .}}"])
        return [json.loads(line) for line in cp.stdout.splitlines() if line.strip()]

    # -- lifecycle
    def start(self) -> Optional[str]:
        """Start the daemon; None when it runs, else why it would not (each driver's last log line)."""
        why = []
        for driver in DRIVERS:
            problem = self._start(driver)
            if problem is None:
                self.driver = driver
                return None
            why.append("%s: %s" % (driver, problem))
        return "; ".join(why)

    def _start(self, driver: str) -> Optional[str]:
        for d in (self.data_root, self.exec_root):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, mode=0o700)
        argv = [self.dockerd, "--storage-driver=%s" % driver, "--iptables=false", "--ip6tables=false",
                "--bridge=none", "--data-root", self.data_root, "--exec-root", self.exec_root,
                "--pidfile", os.path.join(self.root, "dockerd.pid"), "-H", self.host]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.root)
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                problem = "dockerd exited %s: %s" % (self.proc.returncode, self._last_error())
                self.proc = None
                return problem
            if os.path.exists(self.sock) and self.cli(["version", "--format", "{{.Server.Version}}"],
                                                      timeout=10, check=False).returncode == 0:
                self._note_containerd()
                return None
            time.sleep(0.05)
        self._stop_daemon()
        return "not ready after %.0f s: %s" % (READY_S, self._last_error())

    def _note_containerd(self) -> None:
        try:
            with open(os.path.join(self.exec_root, "containerd", "containerd.pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return  # started later, or an external containerd: nothing of ours to stop
        ticks = start_ticks(pid)
        if ticks is not None:
            self.containerd = (pid, ticks)

    def _last_error(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [x for x in f.read().splitlines() if x.strip()]
        except OSError:
            return "no log"
        errors = [x for x in lines if "level=error" in x or "level=fatal" in x] or lines
        return errors[-1][-300:] if errors else "no log"

    def load_image(self) -> Optional[str]:
        """Import the cached Python image (building it first when its recipe or inputs changed); None when done,
        else why it could not be built."""
        cp = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "build", "python_image.py")],
                            capture_output=True, text=True, timeout=300)
        if cp.returncode == 3:
            return cp.stderr.strip()
        if cp.returncode != 0:
            raise AssertionError("build/python_image.py failed (%d): %s" % (cp.returncode, cp.stderr[-2000:]))
        doc = json.loads(cp.stdout)
        self.cli(["import", "--change", "ENV PATH=%s" % doc["path_env"], doc["tar"], doc["tag"]], timeout=300)
        self.image = doc["tag"]
        return None

    def remove_containers(self) -> None:
        """Every container of this daemon (all started by the tests that use it), removed by force."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            ids = self.cli(["ps", "-aq"], timeout=30, check=False).stdout.split()
            if ids:
                self.cli(["rm", "--force", *ids], timeout=60, check=False)
        except subprocess.TimeoutExpired as e:
            print("docker fixture: removing containers timed out: %s" % e, file=sys.stderr)

    def stop(self) -> None:
        self.remove_containers()
        self._stop_daemon()
        if self.containerd is not None:  # dockerd stops its containerd; should it not have, this one is ours
            pid, ticks = self.containerd
            if kill_exact(pid, ticks, signal.SIGTERM):
                deadline = time.monotonic() + STOP_S
                while pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                kill_exact(pid, ticks, signal.SIGKILL)
        self._unmount_under_root()
        shutil.rmtree(self.root, ignore_errors=True)

    def _stop_daemon(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)  # our own child, not yet reaped: its pid cannot belong to another process
        try:
            p.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=STOP_S)

    def _unmount_under_root(self) -> None:
        """A daemon that died without cleaning up leaves its mounts (overlay, shm) under the temp dir: unmount
        them, deepest first, so removing the dir never walks into a mounted filesystem."""
        mine = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].replace("\\040", " ")
                if point == self.root or point.startswith(self.root + "/"):
                    mine.append(point)
        for point in sorted(mine, key=len, reverse=True):
            subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def docker_daemon():
    """A running private dockerd with the local Python image imported (module docstring)."""
    dockerd = dockerd_path()
    if dockerd is None:
        pytest.skip("no dockerd (Debian's docker.io is not installed): run `bash build/sysdeps.sh`")
    if os.geteuid() != 0:
        pytest.skip("the private dockerd needs root (it mounts filesystems and creates cgroups)")
    # short: containerd's sockets live under the exec root, and a unix socket path has at most 107 bytes
    root = tempfile.mkdtemp(prefix="onbox-dockerd-", dir="/tmp" if os.path.isdir("/tmp") else None)
    daemon = DockerDaemon(root, dockerd)
    try:
        problem = daemon.start()
        if problem is not None:
            pytest.skip("dockerd refuses to start here (%s)" % problem)
        problem = daemon.load_image()
        if problem is not None:
            pytest.skip("no local Python image for the daemon: %s" % problem)
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def docker_env(docker_daemon, monkeypatch):
    """DOCKER_HOST (and a private DOCKER_CONFIG) in this test's environment: every docker CLI the test or the
    agent under test runs talks to the private daemon."""
    for k, v in docker_daemon.env.items():
        monkeypatch.setenv(k, v)
    yield dict(docker_daemon.env)
    docker_daemon.remove_containers()  # what a failing test left: the next test starts with none
