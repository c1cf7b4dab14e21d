"""Fixtures for the integration tests (real processes). Helpers they call live in supervisor_helpers (the CLI in a
subprocess, state and events) and tests/processes.py (processes by pid and start time)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.processes import kill_test_processes


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
