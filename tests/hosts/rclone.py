"""A real `rclone serve sftp` on loopback: the object-store-style durable target for checkpoint tests.

rclone 1.60 (apt) serves a directory over SFTP with a user and password; the client side is a config-free remote
defined by RCLONE_CONFIG_<NAME>_* environment variables. The fixture starts exactly one server process and stops
exactly that PID (it can also stop and restart it mid-test to cut an upload).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Dict, Optional

import pytest

from tests.hosts import free_port, stop_child


class RcloneSftp:
    """`host`: the address it listens on (127.0.0.1; a network-namespace bridge's host address serves the boxes)."""

    def __init__(self, tmp: str, host: str = "127.0.0.1") -> None:
        self.tmp = tmp
        self.host = host
        self.root = os.path.join(tmp, "served")
        os.makedirs(self.root, exist_ok=True)
        self.port = free_port(host)
        self.key = os.path.join(tmp, "hostkey")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key], check=True, timeout=30)
        self.password = "onbox-test"
        self.name = "ONBOXSFTP%d" % os.getpid()
        obscured = subprocess.run(["rclone", "obscure", self.password], capture_output=True, text=True,
                                  check=True, timeout=30).stdout.strip()
        self.env: Dict[str, str] = {
            "RCLONE_CONFIG_%s_TYPE" % self.name: "sftp",
            "RCLONE_CONFIG_%s_HOST" % self.name: host,
            "RCLONE_CONFIG_%s_PORT" % self.name: str(self.port),
            "RCLONE_CONFIG_%s_USER" % self.name: "u",
            "RCLONE_CONFIG_%s_PASS" % self.name: obscured,
            "RCLONE_CONFIG": os.path.join(tmp, "rclone.conf"),  # an empty config: nothing from the user's
            "RCLONE_CACHE_DIR": os.path.join(tmp, "cache"),
        }
        self._obscured = obscured
        self.proc: Optional[subprocess.Popen] = None
        self.log = os.path.join(tmp, "serve.log")

    @property
    def remote(self) -> str:
        """The durable spec for onbox: `<name>:dur` (the served dir's `dur` subdir)."""
        return self.name.lower() + ":dur"

    def config_section(self) -> str:
        """The remote as an rclone.conf section: what a box keeps in ~/.config/rclone/rclone.conf (its ssh
        sessions carry none of this machine's RCLONE_CONFIG_* variables)."""
        return "[%s]\ntype = sftp\nhost = %s\nport = %d\nuser = u\npass = %s\n" % (
            self.name.lower(), self.host, self.port, self._obscured)

    @property
    def durable_root(self) -> str:
        return os.path.join(self.root, "dur")

    def start(self, timeout: float = 20.0) -> None:
        env = dict(os.environ, **self.env)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["rclone", "serve", "sftp", self.root, "--addr", "%s:%d" % (self.host, self.port), "--user", "u",
                 "--pass", self.password, "--key", self.key, "-v"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log, encoding="utf-8", errors="replace") as f:
                    raise RuntimeError("rclone serve sftp exited: %s" % f.read()[-2000:])
            try:
                with socket.create_connection((self.host, self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("rclone serve sftp not listening after %.0f s" % timeout)

    def unreachable(self) -> str:
        """The remote with nothing answering: the server stopped."""
        self.stop()
        return self.remote

    def stop(self) -> None:
        stop_child(self.proc)
        self.proc = None


@pytest.fixture
def rclone_sftp(tmp_path, monkeypatch):
    """A running `rclone serve sftp` on 127.0.0.1 and the environment that defines its remote."""
    if shutil.which("rclone") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("rclone/ssh-keygen not installed: run `make sysdeps` (build/sysdeps.sh)")
    server = RcloneSftp(str(tmp_path / "rclone"))
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sftp", "s3"])
def rclone_remote(request):
    """The durable remote of the checkpoint suite's rclone cases, once per backend: `rclone serve sftp` (renames and
    directories; Debian's rclone 1.60 the client) and `rclone serve s3` (objects, no renames; rclone 1.75.2 the
    client: tests/hosts/s3.py). Both give .remote, .durable_root (its files on this machine), .env, .unreachable()."""
    return request.getfixturevalue({"sftp": "rclone_sftp", "s3": "s3"}[request.param])
