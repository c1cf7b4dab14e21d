"""Fixtures for the integration tests (real processes). Helpers they call live in supervisor_helpers (the CLI in a
subprocess, state and events) and tests/processes.py (processes by pid and start time)."""
from __future__ import annotations

import pytest

from tests.processes import kill_test_processes


@pytest.fixture
def cleanup(onbox_home):
    """Kill (by pid and start time) every agent and child this test left alive under its ONBOX_HOME, whatever the
    test did."""
    yield
    kill_test_processes(onbox_home)
