"""A real tracker process (`onboxctl tracker serve`) for tests: start, kill, restart — always by PID.

    def test_x(tracker):              # started on 127.0.0.1, any free port, a fresh DB and token
        tracker.post([...]); tracker.kill(); tracker.start()   # same port and DB after a restart

`TrackerProcess(..., host="10.200.7.1")` serves on another address (e.g. the host side of a netns veth pair).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import pytest

from tests.conftest import subprocess_env
from tests.hosts import log_tail

TOKEN = "test-token-0123456789"


class TrackerProcess:
    def __init__(self, workdir: str, host: str = "127.0.0.1", token: str = TOKEN, public_read: bool = False,
                 extra_args: Optional[List[str]] = None) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.host = host
        self.token = token
        self.public_read = public_read
        self.extra_args = list(extra_args or [])
        self.db = os.path.join(workdir, "tracker.db")
        self.token_file = os.path.join(workdir, "token")
        with open(self.token_file, "w") as f:
            f.write(token + "\n")
        os.chmod(self.token_file, 0o600)
        self.ready_file = os.path.join(workdir, "ready.json")
        self.log_path = os.path.join(workdir, "tracker.log")
        self.port = 0  # chosen by the first start, kept by restarts
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return "http://%s:%d" % (self.host, self.port)

    def start(self, timeout: float = 30.0) -> "TrackerProcess":
        assert self.proc is None or self.proc.poll() is not None, "already running"
        if os.path.exists(self.ready_file):
            os.unlink(self.ready_file)
        argv = [sys.executable, "-m", "controller", "tracker", "serve", "--db", self.db, "--host", self.host,
                "--port", str(self.port), "--token-file", self.token_file, "--ready-file", self.ready_file]
        if self.public_read:
            argv.append("--public-read")
        argv += self.extra_args
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("tracker exited with %s:\n%s" % (self.proc.returncode, self.log()))
            try:
                with open(self.ready_file) as f:
                    ready = json.load(f)
                self.port = int(ready["port"])
                return self
            except (OSError, ValueError, KeyError):
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("tracker not ready after %.0f s:\n%s" % (timeout, self.log()))

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Signal exactly our tracker process and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def log(self) -> str:
        return log_tail(self.log_path)

    # -- client helpers (bounded by timeouts)
    def headers(self) -> Dict[str, str]:
        return {"Authorization": "Bearer " + self.token}

    def post(self, beats: List[Dict[str, Any]], timeout: float = 10.0) -> Any:
        import requests

        return requests.post(self.url + "/api/v1/heartbeats", json={"heartbeats": beats}, headers=self.headers(),
                             timeout=timeout)

    def runs(self, timeout: float = 10.0) -> List[Dict[str, Any]]:
        import requests

        r = requests.get(self.url + "/api/v1/runs", headers=self.headers(), timeout=timeout)
        r.raise_for_status()
        return r.json()["runs"]

    def all_heartbeats(self, run: str, page: int = 500, timeout: float = 10.0) -> List[Dict[str, Any]]:
        import requests

        out: List[Dict[str, Any]] = []
        after = -1
        for _ in range(10000):
            r = requests.get(self.url + "/api/v1/runs/%s/heartbeats" % run, params={"after": after, "limit": page},
                             headers=self.headers(), timeout=timeout)
            if r.status_code == 404:
                return out
            r.raise_for_status()
            beats = r.json()["heartbeats"]
            out += beats
            if len(beats) < page:
                return out
            after = beats[-1]["seq"]
        return out


@pytest.fixture
def tracker(tmp_path):
    """A running tracker on loopback with a fresh database; stopped (by PID) at teardown."""
    t = TrackerProcess(str(tmp_path / "tracker"))
    t.start()
    try:
        yield t
    finally:
        t.stop()
