"""Real services for tests, one module each (loaded as pytest plugins by tests/conftest.py), and what they share:
a free loopback port, the skip (or CI failure) when a service's own install is missing, the stop of a server a
fixture started, the tail of its log."""
from __future__ import annotations

import os
import socket
import subprocess
from typing import Optional

import pytest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def require_built(reason: Optional[str]) -> None:
    """`reason`: why a service's own install (a venv `make` builds) is missing, None when it is there. Skip
    (visibly) without it; in CI (CI=true) that is a failure: CI must have built it."""
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason)


def stop_child(proc: Optional["subprocess.Popen[bytes]"], timeout: float = 10.0) -> None:
    """TERM, then KILL after `timeout`, to a server this fixture started (its Popen: the pid cannot have been
    reused while it is unreaped)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def log_tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""
