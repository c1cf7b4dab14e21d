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

from tests.hosts import free_port, require_built, stop_child


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


@pytest.fixture
def rclone_sftp_rcd(rclone_sftp, tmp_path, monkeypatch):
    """`rclone serve sftp` with rclone 1.75.2 the client (tests/hosts/s3.py's venv), whose calls go over one
    `rclone rcd` (Debian's 1.60 cannot serve rc on a unix socket: onbox makes a process per call with it)."""
    from tests.hosts.s3 import RCLONE, unavailable_reason

    require_built(unavailable_reason())
    bin_dir = tmp_path / "rclone-bin"  # only that binary: first on PATH, it is the client onbox runs
    bin_dir.mkdir()
    os.symlink(RCLONE, bin_dir / "rclone")
    rclone_sftp.env["PATH"] = "%s%s%s" % (bin_dir, os.pathsep, os.environ.get("PATH", ""))
    monkeypatch.setenv("PATH", rclone_sftp.env["PATH"])
    return rclone_sftp


@pytest.fixture
def s3_cli(s3, monkeypatch):
    """The S3 bucket with ONBOX_RCLONE_RCD=0: rclone 1.75.2 run as a process per call (the fallback's path)."""
    s3.env["ONBOX_RCLONE_RCD"] = "0"
    monkeypatch.setenv("ONBOX_RCLONE_RCD", "0")
    return s3


# which rclone runs the calls, and how: Debian's 1.60 a process per call (it has no rc on a unix socket), 1.75.2
# over one `rclone rcd`, or a process per call with ONBOX_RCLONE_RCD=0
CALLS = {"sftp": "cli", "s3": "rcd", "sftp-rcd": "rcd", "s3-cli": "cli"}


@pytest.fixture(params=["sftp", "s3", "sftp-rcd", "s3-cli"])
def rclone_remote(request):
    """The durable remote of the checkpoint suite's rclone cases, once per backend and way of calling rclone:
    `rclone serve sftp` (renames and directories) and `rclone serve s3` (objects, no renames: tests/hosts/s3.py),
    each with its calls over rclone rcd and as processes (CALLS). Each gives .remote, .durable_root (its files on
    this machine), .env, .unreachable(), and .calls ("rcd" or "cli")."""
    remote = request.getfixturevalue({"sftp": "rclone_sftp", "s3": "s3", "sftp-rcd": "rclone_sftp_rcd",
                                      "s3-cli": "s3_cli"}[request.param])
    remote.calls = CALLS[request.param]
    return remote


@pytest.fixture(params=["sftp", "s3"])
def rclone_backend(request):
    """The two backends with their default way of calling rclone (Debian's 1.60 over sftp: a process per call;
    1.75.2 over S3: one rclone rcd), for the slower agent-level cases."""
    return request.getfixturevalue({"sftp": "rclone_sftp", "s3": "s3"}[request.param])
