"""A real S3 API on loopback: `rclone serve s3` from rclone 1.75.2 (build/out/rclone-venv, `make rclone-venv`, which
`make test` and `make bench` depend on).

    def test_x(s3):           # the session's server, a bucket of this test's own, its remote in the environment
        s3.remote             # "onboxs3:<bucket>/dur": what --durable takes (a remote configured as for R2)
        s3.durable_root       # where that remote's objects lie as files on this machine: read them, damage them
        s3.env                # what an agent started by the test needs (already in os.environ for the test)

Why `rclone serve s3` and not moto's server: its objects are plain files under one directory (<root>/<bucket>/
<key>), so a test reads what landed, damages it on purpose and sees what a killed upload left behind; moto keeps
everything in memory. Where onbox cares it is S3: an object appears whole when its PUT or its multipart upload
completes, listings are flat, a directory move is a copy and a delete per object, a missing key's `rclone cat`
prints nothing and exits 0, an abandoned multipart upload stays open (a hidden `.rclone_temp_multipart_*` file
beside where the object would be) until it is aborted, and a wrong secret gets 403. `--dir-cache-time 1ms` makes it
see at once what a test changes on its disk (not 0s: with that, rclone 1.75.2's server spins a core once it holds
directories, and every call slows down to seconds). `--etag-hash ""`: no MD5 of each object at every listing (S3
stores its ETags; this server would hash a 2 GiB checkpoint again each time it lists it).

The client onbox runs here is the same rclone 1.75.2, put first on PATH (a directory holding only that binary):
Debian's rclone 1.60 (what `make sysdeps` installs, and the sftp tests' client) fails every S3 call while
AWS_CA_BUNDLE is set, as it is on these machines, and a user installing rclone today gets a 1.7x release.
test_ckpt_s3.py checks that onbox names that trap when it meets it. Without the venv the fixtures skip, saying how
to build it, except in CI (CI=true), where that is a failure.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from typing import Dict, Optional, Sequence

import pytest

from tests.conftest import REPO_ROOT
from tests.hosts import free_port, log_tail, require_built, stop_child

VENV = os.path.join(REPO_ROOT, "build", "out", "rclone-venv")
STAMP = os.path.join(VENV, ".installed")
RCLONE = os.path.join(VENV, "bin", "rclone")
REMOTE = "onboxs3"


def unavailable_reason() -> Optional[str]:
    if not os.path.exists(STAMP) or not os.access(RCLONE, os.X_OK):
        return "no rclone 1.75 venv at %s (the S3 API server): build it with `make rclone-venv` (make test does)" % VENV
    return None


class S3Server:
    """`rclone serve s3 DIR` on 127.0.0.1 with one access key; each top-level directory of DIR is a bucket."""

    def __init__(self, workdir: str, extra_args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.extra_args = list(extra_args)
        self.root = os.path.join(workdir, "served")
        os.makedirs(self.root, exist_ok=True)
        self.log_path = os.path.join(workdir, "serve-s3.log")
        self.access_key = "onbox-test"
        self.secret = uuid.uuid4().hex
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        # a directory holding only rclone 1.75.2: first on PATH, it is the client onbox runs (not the venv's bin,
        # whose python would shadow the test's)
        self.bin = os.path.join(workdir, "bin")
        os.makedirs(self.bin, exist_ok=True)
        if not os.path.lexists(os.path.join(self.bin, "rclone")):
            os.symlink(RCLONE, os.path.join(self.bin, "rclone"))
        self.config = os.path.join(workdir, "rclone.conf")  # empty: nothing from this machine's user config
        open(self.config, "a").close()

    @property
    def endpoint(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self, timeout: float = 20.0) -> "S3Server":
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.port = self.port or free_port()
        argv = [RCLONE, "serve", "s3", self.root, "--addr", "127.0.0.1:%d" % self.port,
                "--auth-key", "%s,%s" % (self.access_key, self.secret), "--dir-cache-time", "1ms",
                "--poll-interval", "0", "--etag-hash", "", "--config", self.config, *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("rclone serve s3 exited with %s:\n%s" % (self.proc.returncode, self.log()))
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("rclone serve s3 not listening after %.0f s:\n%s" % (timeout, self.log()))

    def stop(self) -> None:
        stop_child(self.proc)

    def log(self) -> str:
        return log_tail(self.log_path)

    def remote_env(self, name: str = REMOTE, endpoint: Optional[str] = None, **options: str) -> Dict[str, str]:
        """A remote configured by environment variables, as a user sets one up for Cloudflare R2 (provider,
        endpoint, access key, secret); `options`: more of the remote's settings (upload_cutoff="5M", ...)."""
        prefix = "RCLONE_CONFIG_%s_" % name.upper()
        env = {prefix + "TYPE": "s3", prefix + "PROVIDER": "Other", prefix + "ENDPOINT": endpoint or self.endpoint,
               prefix + "ACCESS_KEY_ID": self.access_key, prefix + "SECRET_ACCESS_KEY": self.secret,
               prefix + "REGION": "us-east-1"}
        env.update({prefix + k.upper(): v for k, v in options.items()})
        return env


class S3Bucket:
    """What a test gets: the shared server, a bucket of its own, and its remote (defined in os.environ)."""

    def __init__(self, server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server = server
        self.bucket = bucket
        self.monkeypatch = monkeypatch
        os.makedirs(os.path.join(server.root, bucket))  # a bucket the user made beforehand (R2's dashboard)
        self.env: Dict[str, str] = dict(server.remote_env(), RCLONE_CONFIG=server.config,
                                        PATH=server.bin + os.pathsep + os.environ.get("PATH", ""))

    @property
    def remote(self) -> str:
        return "%s:%s/dur" % (REMOTE, self.bucket)

    def remote_with(self, name: str, **options: str) -> str:
        """This bucket through another remote of the same server with more settings (upload_cutoff="5M", ...),
        defined in this test's environment."""
        for k, v in self.server.remote_env(name, **options).items():
            self.monkeypatch.setenv(k, v)
            self.env[k] = v
        return "%s:%s/dur" % (name, self.bucket)

    def unreachable(self) -> str:
        """This bucket through a remote whose endpoint nothing listens on (the shared server keeps running)."""
        dead = "http://127.0.0.1:%d" % free_port()
        for k, v in self.server.remote_env("onboxs3dead", endpoint=dead).items():
            self.monkeypatch.setenv(k, v)
            self.env[k] = v
        return "onboxs3dead:%s/dur" % self.bucket

    @property
    def durable_root(self) -> str:
        return os.path.join(self.server.root, self.bucket, "dur")

    def rclone(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """rclone 1.75.2 with this bucket's remote, e.g. to ask the server what `onbox` cannot see."""
        return subprocess.run([RCLONE, *args], env=dict(os.environ, **self.env), capture_output=True, text=True,
                              timeout=timeout)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One `rclone serve s3` per test session (and xdist worker): every test gets a bucket of its own in it."""
    require_built(unavailable_reason())
    server = S3Server(str(tmp_path_factory.mktemp("s3"))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket on the session's S3 server, its remote and rclone 1.75.2 in this test's environment."""
    b = S3Bucket(s3_server, "t-" + uuid.uuid4().hex[:16], monkeypatch)
    for k, v in b.env.items():
        monkeypatch.setenv(k, v)
    return b
