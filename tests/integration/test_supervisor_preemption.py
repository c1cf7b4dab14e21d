"""Preemption with real signals and a fake metadata service on loopback: checkpoint signal forwarded, exit 75."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.integration.supervisor_helpers import (
    env_for,
    events,
    state,
)
from tests.polling import wait_for
from tests.processes import Started, signal_own

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("cleanup")]
PY = sys.executable


# A trainer that checkpoints on SIGTERM: writes a marker naming the signal, then exits 0.
TRAINER = textwrap.dedent("""
    import os, signal, sys, time
    marker = sys.argv[1]
    def on_term(signum, frame):
        open(marker, "w").write("got %d preempt_file=%s" % (signum, os.path.exists(os.environ["ONBOX_PREEMPT_FILE"])))
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("child-" + "up", flush=True)
    for _ in range(6000):
        time.sleep(0.01)
    sys.exit(3)
""")


def _start_foreground(started, home, name, marker, *opts, env_extra=None, argv_prefix=()):
    argv = [*argv_prefix, PY, "-m", "onbox", "run", "--foreground", "--name", name, *opts, "--",
            PY, "-c", TRAINER, str(marker)]
    return started.popen(argv, env=env_for(home, **(env_extra or {})), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def _running(home, name):
    doc = state(home, name)
    return doc if doc.get("state") == "running" and _child_ready(home, name) else None


def _child_ready(home, name):
    try:
        return "child-up" in (home / "runs" / name / "output.log").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("sig", ["TERM", "USR1", "INT"])
def test_signal_to_the_agent_becomes_checkpoint_then_exit_75(onbox_home, tmp_path, sig):
    marker = tmp_path / "marker"
    with Started() as started:
        p = _start_foreground(started, onbox_home, "pre", marker, "--grace", "20")
        wait_for(lambda: _running(onbox_home, "pre"), what="child running")
        p.send_signal(getattr(signal, "SIG" + sig))
        _out, err = p.communicate(timeout=30)
        assert p.returncode == 75, err
        assert marker.read_text() == "got %d preempt_file=True" % signal.SIGTERM
        doc = state(onbox_home, "pre")
        assert doc["state"] == "preempted" and doc["preemption"]["source"] == "signal:SIG" + sig
        assert doc["last_exit"]["classification"] == "preempted"
        types = [e["type"] for e in events(onbox_home, "pre")]
        assert types.index("preemption_notice") < types.index("signal_forwarded") < types.index("final_checkpoint")


def test_child_ignoring_the_checkpoint_signal_is_killed_at_the_deadline(onbox_home, tmp_path):
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('child-' + 'up', flush=True); " \
               "time.sleep(60)"
    with Started() as started:
        p = started.popen([PY, "-m", "onbox", "run", "--foreground", "--name", "stub", "--grace", "0.5", "--",
                           PY, "-c", stubborn], env=env_for(onbox_home), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
        wait_for(lambda: _running(onbox_home, "stub"), what="child running")
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        assert p.returncode == 75
        doc = state(onbox_home, "stub")
        assert doc["last_exit"]["signal"] == signal.SIGKILL
        kills = [e for e in events(onbox_home, "stub") if e["type"] == "escalated" and e["signal"] == "SIGKILL"]
        assert len(kills) == 1


@pytest.mark.root
def test_agent_as_pid1_forwards_sigterm_reaps_and_exits_75(onbox_home, tmp_path):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a fresh PID namespace")
    marker = tmp_path / "marker"
    # the trainer leaves short-lived orphans behind: as PID 1 the agent must reap them (no zombie piles up)
    argv = ["unshare", "--pid", "--fork", "--mount-proc", PY, "-m", "onbox", "run", "--foreground", "--name",
            "pid1", "--grace", "20", "--", "sh", "-c", '(sleep 0.2 &); (sleep 0.3 &); exec "$@"', "sh",
            PY, "-c", TRAINER, str(marker)]
    with Started() as started:
        p = started.popen(argv, env=env_for(onbox_home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: _running(onbox_home, "pid1"), what="child running")
        agent = state(onbox_home, "pid1")["agent_pid"]
        assert agent == 1  # the agent sees itself as PID 1 in the new namespace
        host_agent = wait_for(lambda: _children_of(p.pid), what="the agent's host pid")[0]
        child = state(onbox_home, "pid1")["attempts"][0]["pid"]  # as seen inside the namespace
        # the orphaned sleeps were reparented to the agent; once they end it reaps them: only the child remains
        wait_for(lambda: _children_of(host_agent) and not _zombie_children(host_agent)
                 and len(_children_of(host_agent)) == 1, timeout=20, what="orphans reaped by PID 1")
        assert child > 1
        signal_own(onbox_home, host_agent, signal.SIGTERM)
        _out, err = p.communicate(timeout=30)
        assert p.returncode == 75, err
        assert marker.read_text().startswith("got %d" % signal.SIGTERM)
        assert state(onbox_home, "pid1")["state"] == "preempted"


def _zombie_children(pid):
    out = []
    for c in _children_of(pid):
        try:
            with open("/proc/%d/stat" % c) as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    out.append(c)
        except OSError:
            pass
    return out


def _children_of(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_cloud_notice_from_the_metadata_service_triggers_the_preemption_path(onbox_home, tmp_path,
                                                                               metadata_server, provider):
    metadata_server.provider = provider
    marker = tmp_path / "marker"
    with Started() as started:
        p = _start_foreground(started, onbox_home, "cloud", marker, "--notice-source", "auto",
                              "--metadata-url", metadata_server.url)
        wait_for(lambda: _running(onbox_home, "cloud"), what="child running")
        wait_for(lambda: len(metadata_server.requests) >= 4, what="the agent polling the metadata service")
        metadata_server.preempt(lead=30)
        _out, err = p.communicate(timeout=30)
        assert p.returncode == 75, err
        assert marker.read_text().startswith("got %d" % signal.SIGTERM)
        doc = state(onbox_home, "cloud")
        assert doc["preemption"]["source"] == provider
        # the notice's own lead time bounds the deadline (about 30 s from now, not the 30 s default by accident)
        assert 20 < doc["preemption"]["deadline"] - doc["preemption"]["received_at"] <= 31
        if provider == "aws":  # IMDSv2: every metadata GET carried a token from PUT /latest/api/token
            gets = [r for r in metadata_server.requests if r[0] == "GET"]
            puts = [r for r in metadata_server.requests if r[0] == "PUT"]
            assert len(puts) < len(gets)  # the token is reused, not fetched before every poll
            assert gets and all(r[2].get("x-aws-ec2-metadata-token", "").startswith("tok-") for r in gets)


def test_a_metadata_answer_nested_100000_deep_is_said_once_and_a_later_real_notice_still_preempts(
        onbox_home, tmp_path, metadata_server):
    """Issue 19: a spoofed or broken metadata service answering a document nested 100,000 deep once ended the
    poller in a RecursionError (three polls later, notices were off); now it is no notice, said once, and
    polling goes on."""
    metadata_server.provider = "azure"  # Azure's answer IS the notice list: an unreadable one holds no notice
    metadata_server.answer = b"[" * 100_000 + b"]" * 100_000
    marker = tmp_path / "marker"
    with Started() as started:
        p = _start_foreground(started, onbox_home, "deep", marker, "--notice-source", "azure",
                              "--metadata-url", metadata_server.url)
        wait_for(lambda: _running(onbox_home, "deep"), what="child running")
        seen = len(metadata_server.requests)
        wait_for(lambda: len(metadata_server.requests) >= seen + 10, what="the poller asking on after deep answers")
        metadata_server.answer = None
        metadata_server.preempt(lead=30)
        _out, err = p.communicate(timeout=30)
        assert p.returncode == 75, err
        assert marker.read_text().startswith("got %d" % signal.SIGTERM)
        assert state(onbox_home, "deep")["preemption"]["source"] == "azure"
        assert err.count("azure scheduled events answer unreadable: it nests more than 64 levels deep") == 1, err
        assert "RecursionError" not in err and "poller died" not in err, err
        assert not [e for e in events(onbox_home, "deep") if e["type"] == "thread_died"]


def test_absent_metadata_service_costs_nothing(onbox_home):
    import socket

    with socket.socket() as s:  # a loopback port with nothing listening: connection refused at once
        s.bind(("127.0.0.1", 0))
        dead = "http://127.0.0.1:%d" % s.getsockname()[1]
    r = subprocess.run([PY, "-m", "onbox", "run", "--foreground", "--name", "nometa", "--notice-source", "auto",
                        "--metadata-url", dead, "--", PY, "-c", "import time; time.sleep(0.3)"],
                       env=env_for(onbox_home), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "no cloud metadata service answered" in r.stderr
    assert state(onbox_home, "nometa")["state"] == "done"
