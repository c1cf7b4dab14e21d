"""A real OpenSSH server on loopback, as a reusable pytest fixture.

    def test_x(sshd):
        subprocess.run(sshd.ssh_argv("echo hi"), ...)

`sshd` yields an SshHost: host, port, user, key (client private key path), known_hosts (in tmp), and
`ssh_argv(cmd)` / `base_argv()` helpers that keep everything out of ~/.ssh. The server runs in the foreground
(-D) from this fixture; teardown stops exactly its PID.
"""
from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import List

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@dataclasses.dataclass
class SshHost:
    host: str
    port: int
    user: str
    key: str  # client private key
    known_hosts: str
    workdir: str
    pid: int

    def base_argv(self) -> List[str]:
        """ssh with every option needed to reach this host and touch nothing of the user's ~/.ssh."""
        return ["ssh", "-p", str(self.port), "-i", self.key, "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=%s" % self.known_hosts,
                "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10", "-F", "/dev/null",
                "%s@%s" % (self.user, self.host)]

    def ssh_argv(self, cmd: str) -> List[str]:
        return [*self.base_argv(), cmd]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True, timeout=30,
                   stdin=subprocess.DEVNULL)


@pytest.fixture
def sshd(tmp_path_factory):
    if not os.path.exists(SSHD):
        pytest.skip("sshd is not installed (run `make sysdeps`)")
    d = str(tmp_path_factory.mktemp("sshd"))
    os.makedirs("/run/sshd", exist_ok=True)  # sshd refuses to start without its privilege-separation dir
    host_key, client_key = os.path.join(d, "host_key"), os.path.join(d, "client_key")
    _keygen(host_key)
    _keygen(client_key)
    auth = os.path.join(d, "authorized_keys")
    shutil.copyfile(client_key + ".pub", auth)
    port = _free_port()
    cfg = os.path.join(d, "sshd_config")
    with open(cfg, "w") as f:
        f.write("\n".join([
            "ListenAddress 127.0.0.1", "Port %d" % port, "HostKey %s" % host_key,
            "PidFile %s" % os.path.join(d, "sshd.pid"), "AuthorizedKeysFile %s" % auth,
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            "PermitRootLogin yes", "Subsystem sftp internal-sftp", "AcceptEnv PYTHONPATH ONBOX_*", "",
        ]))
    log = os.path.join(d, "sshd.log")
    proc = subprocess.Popen([SSHD, "-D", "-f", cfg, "-E", log], stdin=subprocess.DEVNULL)
    host = SshHost("127.0.0.1", port, getpass.getuser(), client_key, os.path.join(d, "known_hosts"), d, proc.pid)
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                with open(log) as f:
                    pytest.fail("sshd did not start: %s" % f.read()[-2000:])
            time.sleep(0.02)
    try:
        yield host
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
