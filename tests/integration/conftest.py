"""Fixtures for the integration tests (real processes). Helpers they call live in supervisor_helpers (the CLI in a
subprocess, state and events) and tests/processes.py (processes by pid and start time)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.processes import kill_test_processes

ZIPAPP_BUILD_TIMEOUT = 600


@pytest.fixture
def cleanup(onbox_home):
    """Kill (by pid and start time) every agent and child this test left alive under its ONBOX_HOME, whatever the
    test did."""
    yield
    kill_test_processes(onbox_home)


@pytest.fixture
def cert(tmp_path):
    """A self-signed certificate for 127.0.0.1 and localhost: (cert.pem, key.pem) paths."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl missing")
    key, crt = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", crt, "-days", "2", "-subj", "/CN=onbox-test-tracker",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True,
                   timeout=60)
    return crt, key


def build_zipapps(out, cache):
    """dist/onbox.pyz and dist/onbox-aarch64.pyz, built by build/zipapp.py into `out`."""
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "build", "zipapp.py"), "--out", str(out),
                        "--cache", str(cache)], capture_output=True, text=True, timeout=ZIPAPP_BUILD_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture(scope="session")
def wheel_cache():
    # The repository's wheel cache (build/out): downloaded once, then every build is offline.
    return os.path.join(REPO_ROOT, "build", "out")


@pytest.fixture(scope="session")
def dist(tmp_path_factory, wheel_cache):
    """Both pyz files, built once per session (per xdist worker) for every test that runs them."""
    return build_zipapps(tmp_path_factory.mktemp("dist"), wheel_cache)
