"""ONBOX_HOME on a real full filesystem (a size-limited tmpfs): a start on a full disk is refused with exit 3 and
leaves nothing behind; a disk that fills during the run does not end the supervision (the child is still signalled
and stopped, the beats on another disk say what is wrong) and the final state is written once space returns."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest

from onbox.proc import is_alive, start_time
from tests.hosts.tmpfs import tmpfs
from tests.integration.supervisor_helpers import env_for, events, onbox, state
from tests.polling import wait_for
from tests.processes import Started, kill_exact

pytestmark = pytest.mark.integration
PY = sys.executable

# A quiet child (output would hit the full disk): TERM ends it, whatever disposition it inherited.
QUIET = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(300)
""")


def fill(directory):
    """Append to a file until the filesystem refuses (ENOSPC); returns its path. Called again to top the disk up:
    the agent frees pages of its own (a delivered beat leaves the spool) and would use them."""
    path = os.path.join(directory, "fill")
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return path


@pytest.mark.root
def test_a_start_on_a_full_onbox_home_is_refused_with_exit_3_and_leaves_nothing(tmp_path):
    with tmpfs(tmp_path / "home", size="1m") as home:
        fill(home)
        r = onbox(home, "run", "--name", "x", "--ckpt-dir", str(tmp_path / "ck"), "--", "true")
        assert r.returncode == 3, r.stderr
        assert "Traceback" not in r.stderr
        message, hint = r.stderr.splitlines()[-2:]
        assert message.startswith("onbox: ONBOX_HOME %s is full" % home), r.stderr
        assert hint.startswith("hint: free space"), r.stderr
        assert os.listdir(home) == ["fill"]  # no runs/, no runs/x/lock, no half run dir


# `onbox run` with a disk that fills between the up-front check and the writes: the re-launch record is refused.
FILLS_ON_THE_WAY = textwrap.dedent("""
    import errno, os, sys
    from onbox.supervisor.rundir import RunDir

    def refuse(self, config):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.config_path)

    RunDir.write_config = refuse
    from onbox.cli import main
    main(sys.argv[1:])
""")


def test_a_disk_that_fills_during_the_start_refuses_it_with_exit_3_and_leaves_nothing(onbox_home, tmp_path):
    r = subprocess.run([PY, "-c", FILLS_ON_THE_WAY, "run", "--name", "y", "--ckpt-dir", str(tmp_path / "ck"), "--",
                        "true"], env=env_for(onbox_home), capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 3, r.stderr
    assert r.stderr.splitlines()[0] == ("onbox: ONBOX_HOME %s is full (ENOSPC writing config.json): run y not "
                                        "started, nothing was created" % onbox_home)
    assert r.stderr.splitlines()[1].startswith("hint: free space there")
    assert os.listdir(onbox_home) == []  # no runs/, no lock, no half run dir


def beat_alert_codes(path):
    try:
        with open(path) as f:
            beats = [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []
    return [{a["code"] for a in b.get("alerts") or []} for b in beats]


@pytest.mark.root
def test_a_home_that_fills_during_the_run_keeps_the_child_supervised_and_stoppable(tmp_path):
    beats = tmp_path / "beats.jsonl"  # on another disk, like a durable dir
    with tmpfs(tmp_path / "home", size="8m") as home:
        started = Started(home)
        try:
            r = onbox(home, "run", "--name", "x", "--ckpt-dir", str(tmp_path / "ck"), "--heartbeat-file",
                      str(beats), "--heartbeat-interval", "0.1", "--json", "--", PY, "-c", QUIET)
            assert r.returncode == 0, r.stderr
            info = json.loads(r.stdout)
            agent, child = (info["agent_pid"], start_time(info["agent_pid"])), (info["pid"], start_time(info["pid"]))
            started.add(*agent)
            started.add(*child)
            filler = fill(home)
            # the agent goes on: its beats (another disk) say that the run dir refuses writes
            wait_for(lambda: fill(home) and any("run_dir_unwritable" in codes for codes in beat_alert_codes(beats)),
                     timeout=30, what="a beat with the run_dir_unwritable alert")
            fill(home)
            assert is_alive(*agent) and is_alive(*child)
            s = onbox(home, "status", "x")
            assert s.returncode == 0 and "Traceback" not in s.stderr
            assert "ONBOX_HOME's filesystem %s is full" % home in s.stdout, s.stdout
            stop = subprocess.Popen([PY, "-m", "onbox", "stop", "x", "--timeout", "60"], env=env_for(home),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            try:
                wait_for(lambda: not is_alive(*child), timeout=30, what="the child stopped by `onbox stop`")
                # the run ended, the disk is still full: the agent holds the final state until it can write it
                assert is_alive(*agent)
                assert state(home, "x")["state"] == "running"
                os.unlink(filler)
                out, err = stop.communicate(timeout=60)
            finally:
                if stop.poll() is None:
                    stop.kill()
                    stop.wait()
            assert stop.returncode == 0, err
            assert "x: stopped" in out.splitlines() and "Traceback" not in err  # then why nothing is committed
            assert "cannot write" in err  # said why the stop went by signal
            wait_for(lambda: not is_alive(*agent), timeout=30, what="the agent's exit")
            doc = state(home, "x")
            assert doc["state"] == "stopped" and doc["degraded"] is None
            assert doc["last_exit"]["classification"] == "stopped"
            assert not [w for w in doc["warnings"] if w["code"] == "run_dir_unwritable"]
            types = [e["type"] for e in events(home, "x")]
            assert types.index("run_dir_unwritable") < types.index("run_dir_writable")
            new_states = [e["new"] for e in events(home, "x") if e["type"] == "state"]
            assert new_states == ["running", "stopping", "stopped"]  # the held events, written in order
            with open(os.path.join(home, "runs", "x", "agent.log")) as f:
                log = f.read()
            assert "Traceback" not in log and "cannot write" in log
        finally:
            started.stop()


@pytest.mark.root
def test_the_run_lock_still_tells_a_live_agent_on_a_home_remounted_read_only(tmp_path):
    """`onbox stop` and `onbox run` learn whether an agent lives from its flock: a read-only disk must not make
    that a traceback (flock needs no write access)."""
    from onbox.supervisor.detach import RunLock

    with tmpfs(tmp_path / "home", size="1m") as home:
        path = os.path.join(home, "lock")
        open(path, "w").close()
        subprocess.run(["mount", "-o", "remount,ro", home], check=True, timeout=30)
        held = RunLock(path)
        assert held.acquire()
        try:
            assert not RunLock(path).acquire()
        finally:
            held.release()
        assert RunLock(path).acquire()


@pytest.mark.root
def test_a_live_child_is_adopted_on_a_full_home_and_the_new_agent_is_found_and_stopped(tmp_path):
    """A dead agent's child must not stay unsupervised because the disk is full: `onbox run --name x` adopts it
    (the new agent cannot record itself in state.json: status and stop find it by the run's lock)."""

    with tmpfs(tmp_path / "home", size="8m") as home:
        started = Started(home)
        try:
            r = onbox(home, "run", "--name", "x", "--ckpt-dir", str(tmp_path / "ck"), "--json", "--", PY, "-c",
                      QUIET)
            assert r.returncode == 0, r.stderr
            info = json.loads(r.stdout)
            old_agent, child = (info["agent_pid"], start_time(info["agent_pid"])), (info["pid"], start_time(info["pid"]))
            started.add(*old_agent)
            started.add(*child)
            assert kill_exact(*old_agent)  # this test's own agent, by pid and start time
            wait_for(lambda: not is_alive(*old_agent), what="the first agent gone")
            fill(home)
            r = onbox(home, "run", "--name", "x")
            assert r.returncode == 0 and r.stdout.startswith("adopted x "), r.stderr
            started.add_home(home)
            fill(home)
            s = onbox(home, "status", "x")
            assert "agent alive" in s.stdout.splitlines()[0] and "is full" in s.stdout, s.stdout
            stop = subprocess.Popen([PY, "-m", "onbox", "stop", "x", "--timeout", "60"], env=env_for(home),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            try:
                wait_for(lambda: not is_alive(*child), timeout=30, what="the adopted child stopped")
                os.unlink(os.path.join(home, "fill"))
                out, err = stop.communicate(timeout=60)
            finally:
                if stop.poll() is None:
                    stop.kill()
                    stop.wait()
            assert stop.returncode == 0 and "x: stopped" in out.splitlines(), err
            assert "Traceback" not in err and state(home, "x")["state"] == "stopped"
        finally:
            started.stop()
