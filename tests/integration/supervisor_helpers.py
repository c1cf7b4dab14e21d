"""Shared helpers for the supervisor's real-process tests: fast knobs, the CLI in a subprocess, bounded polls."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from tests.conftest import subprocess_env

# Every time knob shrunk to milliseconds (RunConfig fields through ONBOX_* variables).
FAST = {
    "ONBOX_TICK_INTERVAL": "0.05",
    "ONBOX_BACKOFF_INITIAL": "0.05",
    "ONBOX_BACKOFF_MAX": "0.2",
    "ONBOX_TERM_TIMEOUT": "0.5",
    "ONBOX_SYNC_RESERVE": "0",
    "ONBOX_NOTICE_SOURCE": "none",
    "ONBOX_NOTICE_INTERVAL": "0.05",
}


def env_for(home: Any, **extra: str) -> Dict[str, str]:
    env = subprocess_env({"ONBOX_HOME": str(home), **FAST})
    env.update(extra)
    return env


def onbox(home: Any, *args: str, timeout: float = 60, env_extra: Optional[Dict[str, str]] = None,
          cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onbox", *args], env=env_for(home, **(env_extra or {})),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)


def state(home: Any, name: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(str(home), "runs", name, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def events(home: Any, name: str) -> List[Dict[str, Any]]:
    path = os.path.join(str(home), "runs", name, "events.jsonl")
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def pid_alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def kill_if_alive(pid: Optional[int], sig: int = 9) -> None:
    if pid and pid_alive(pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def pids_with_home(home: Any) -> List[int]:
    """Every process whose environment carries ONBOX_HOME=<home> (this test's unique tmp dir): the agents and
    children a test started, found even when its state file was never written (e.g. a launch still on its way
    through ssh when the test failed)."""
    needle = ("ONBOX_HOME=%s" % home).encode()
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


def kill_test_processes(home: Any, settle: float = 0.5) -> None:
    """SIGKILL (by PID) what this test started under its ONBOX_HOME; look again after `settle` for late ones."""
    deadline = time.monotonic() + settle
    while True:
        for pid in pids_with_home(home):
            kill_if_alive(pid)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)


class Started:
    """Processes a test started, each remembered by pid AND start time when first seen: teardown signals exactly
    those (never a pid that another process got since, never a session or group)."""

    def __init__(self) -> None:
        self.refs: List[Any] = []

    def add(self, pid: Optional[int], start: Optional[int] = None) -> None:
        from onbox.proc import start_time

        start = start if start is not None else (start_time(pid) if pid else None)
        if pid and start is not None and (pid, start) not in self.refs:
            self.refs.append((pid, start))

    def add_home(self, home: Any) -> None:
        """Every live process whose environment carries ONBOX_HOME=<home> (the agents and children of this test)."""
        for pid in pids_with_home(home):
            self.add(pid)

    def kill(self) -> None:
        import signal

        from onbox.proc import is_alive

        for pid, start in self.refs:
            if is_alive(pid, start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
