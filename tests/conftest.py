"""Shared fixtures. Service fixtures (sshd, Slurm, tracker, MLflow, rclone, an S3 API, network namespaces, a Docker
daemon) live in tests/hosts/ and are loaded as plugins so any test can ask for them."""
from __future__ import annotations

import os
import signal

import pytest

pytest_plugins: list = ["tests.hosts.sshd", "tests.hosts.metadata", "tests.hosts.gpu_holders", "tests.hosts.rclone",
                        "tests.hosts.tracker", "tests.hosts.netns", "tests.hosts.sshd_box", "tests.hosts.slurm",
                        "tests.hosts.mlflow", "tests.hosts.docker", "tests.hosts.s3"]


@pytest.fixture
def onbox_home(tmp_path, monkeypatch):
    """An isolated $ONBOX_HOME for one test."""
    home = tmp_path / "onbox-home"
    home.mkdir()
    monkeypatch.setenv("ONBOX_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def _no_user_onbox_env(monkeypatch):
    """Keep the developer's own ONBOX_* settings out of tests."""
    for key in list(os.environ):
        if key.startswith("ONBOX_"):
            monkeypatch.delenv(key, raising=False)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_sigint() -> None:
    """preexec_fn for a child that a test interrupts with SIGINT (Ctrl-C): the disposition the test relies on.
    An ignored SIGINT survives exec, and a runner started in the background (CI, `nohup`, a shell's `cmd &`,
    `trap '' INT`) passes it ignored to every test's children: the interrupt would then do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def subprocess_env(extra=None):
    """Environment for child processes that run this checkout's code (not an installed copy)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONBOX_")}
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


@pytest.fixture
def onbox_argv():
    """argv prefix that runs this checkout's `onbox` CLI in a subprocess: [python, -m, onbox]."""
    import sys

    return [sys.executable, "-m", "onbox"]


# -- the two tiers -------------------------------------------------------------------------------------------------
# `make test` runs every test not marked slow and must stay near ten minutes on two cores; `make test-slow` runs the
# slow tier (CI runs both). A test that takes longer than this outside the slow tier is named at the end of the run,
# so the fast tier cannot grow slow unnoticed.
FAST_TIER_BUDGET_S = 15.0
_over_budget: list = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > FAST_TIER_BUDGET_S and "slow" not in report.keywords:
        _over_budget.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _over_budget:
        terminalreporter.section("tests over %.0f s outside the slow tier (mark them slow)" % FAST_TIER_BUDGET_S)
        for duration, nodeid in sorted(_over_budget, reverse=True):
            terminalreporter.write_line("%6.1fs %s" % (duration, nodeid))
