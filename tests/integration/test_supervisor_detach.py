"""Detach, SSH survival, agent death and re-adoption, the per-run lock, stop/logs, bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT
from tests.integration.supervisor_helpers import (
    FAST,
    events,
    onbox,
    state,
)
from tests.polling import wait_for
from tests.processes import Started, pid_alive, signal_own

pytestmark = pytest.mark.integration
PY = sys.executable

# Runs until a file appears; exits with the code written in it. Prints a heartbeat line.
LOOPER = textwrap.dedent("""
    import os, sys, time
    flag = sys.argv[1]
    print("child-" + "up", os.environ["ONBOX_RESTART_COUNT"], flush=True)
    for _ in range(60000):
        if os.path.exists(flag):
            code = int(open(flag).read() or 0)
            os.unlink(flag)
            sys.exit(code)
        time.sleep(0.01)
""")


def _set_flag(flag, code):
    """Tell LOOPER to exit with `code`; atomically, so it never reads a half-written (empty) file."""
    tmp = flag.with_name(flag.name + ".tmp")
    tmp.write_text(str(code))
    os.replace(tmp, flag)


def _child_up(home, name, attempt=0):
    """The child of `attempt` printed its first line AND the agent recorded it in state.json. The child can print
    before the agent writes the state that names it (spawn, then the RUNNING transition): a test that read
    state.json on the output line alone sometimes found no child_pid under load."""
    try:
        printed = "child-up %d" % attempt in (home / "runs" / name / "output.log").read_text()
    except OSError:
        return False
    doc = state(home, name)
    return printed and doc.get("state") == "running" and doc.get("attempt") == attempt and bool(doc.get("child_pid"))


def test_job_survives_its_ssh_session_killed_with_sigkill(onbox_home, tmp_path, sshd, cleanup):
    flag = tmp_path / "flag"
    env = " ".join("%s=%s" % kv for kv in {**FAST, "ONBOX_HOME": str(onbox_home), "PYTHONPATH": REPO_ROOT}.items())
    # `cat` holds the session open like an interactive login would, and ends by itself (EOF) once the
    # connection is gone: nothing of the session lingers after the test
    remote = "cd %s && env %s %s -m onbox run --name viassh -- %s -c %s %s; cat" % (
        REPO_ROOT, env, PY, PY, _sq(LOOPER), flag)
    with Started() as started:
        ssh = started.popen(sshd.ssh_argv(remote), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
        wait_for(lambda: _child_up(onbox_home, "viassh"), timeout=60, what="the job started over ssh")
        first = state(onbox_home, "viassh")
        ssh.kill()  # kill -9 the ssh client: the session is torn down under the job
        ssh.wait(timeout=10)
    # sshd closes the session (its `sleep` gets SIGHUP); poll that the job is still running meanwhile
    wait_for(lambda: not any(_sessions_of_sshd(sshd.pid)), timeout=20, what="sshd session gone")
    assert pid_alive(first["child_pid"]) and pid_alive(first["agent_pid"])
    # ... and still supervised: a crash is noticed and restarted by the same agent
    _set_flag(flag, 3)
    wait_for(lambda: _child_up(onbox_home, "viassh", attempt=1), what="restart after the crash")
    doc = state(onbox_home, "viassh")
    assert doc["agent_pid"] == first["agent_pid"] and doc["attempts"][0]["exit"]["code"] == 3
    r = onbox(onbox_home, "stop", "viassh", "--grace", "5")
    assert r.returncode == 0, r.stderr
    assert state(onbox_home, "viassh")["state"] == "stopped"


def test_plain_ssh_launch_returns_at_once(onbox_home, tmp_path, sshd, cleanup):
    env = " ".join("%s=%s" % kv for kv in {**FAST, "ONBOX_HOME": str(onbox_home), "PYTHONPATH": REPO_ROOT}.items())
    remote = "cd %s && env %s %s -m onbox run --name quick -- sleep 30" % (REPO_ROOT, env, PY)
    r = subprocess.run(sshd.ssh_argv(remote), capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    name, run_dir, pid = r.stdout.split()[1:4]
    assert name == "quick" and run_dir == str(onbox_home / "runs" / "quick") and pid_alive(int(pid))


def _sessions_of_sshd(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _sq(text):
    return "'" + text.replace("'", "'\\''") + "'"


def test_agent_sigkilled_then_readopted_and_second_launch_refused(onbox_home, tmp_path, cleanup):
    flag = tmp_path / "flag"
    r = onbox(onbox_home, "run", "--name", "adopt", "--json", "--", PY, "-c", LOOPER, str(flag))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    wait_for(lambda: _child_up(onbox_home, "adopt"), what="child up")
    # a second launch of the same run while it lives is refused
    again = onbox(onbox_home, "run", "--name", "adopt", "--", PY, "-c", LOOPER, str(flag))
    assert again.returncode == 2 and "already running" in again.stderr
    signal_own(onbox_home, info["agent_pid"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(info["agent_pid"]), what="agent gone")
    assert pid_alive(info["pid"])  # the child outlives its agent
    st = onbox(onbox_home, "status", "adopt", "--json")
    assert json.loads(st.stdout)["agent_alive"] is False
    # starting the same run again re-adopts instead of launching a second child
    r2 = onbox(onbox_home, "run", "--name", "adopt", "--json", "--", PY, "-c", LOOPER, str(flag))
    assert r2.returncode == 0, r2.stderr
    info2 = json.loads(r2.stdout)
    assert info2["adopted"] is True and info2["pid"] == info["pid"] and info2["agent_pid"] != info["agent_pid"]
    assert len(state(onbox_home, "adopt")["attempts"]) == 1
    # supervision continues: the adopted child's exit is seen (its keeper reports it: exit 3, not `unknown`) and
    # restarted by the restart policy
    _set_flag(flag, 3)
    wait_for(lambda: _child_up(onbox_home, "adopt", attempt=1), what="restart of the adopted run")
    first = state(onbox_home, "adopt")["attempts"][0]["exit"]
    assert first["classification"] == "failed" and first["code"] == 3, first
    assert any(e["type"] == "adopted" for e in events(onbox_home, "adopt"))
    r3 = onbox(onbox_home, "stop", "adopt", "--grace", "5", "--json")
    assert r3.returncode == 0 and json.loads(r3.stdout)["state"] == "stopped"


def test_recycled_pid_is_not_adopted(onbox_home, tmp_path, cleanup):
    r = onbox(onbox_home, "run", "--foreground", "--name", "recyc", "--", PY, "-c", "pass")
    assert r.returncode == 0
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        path = onbox_home / "runs" / "recyc" / "state.json"
        doc = json.loads(path.read_text())
        # the recorded child pid now belongs to someone else: same pid, different start time
        doc.update(state="running", child_pid=bystander.pid, child_start_time=1)
        path.write_text(json.dumps(doc))
        r2 = onbox(onbox_home, "adopt", "recyc")
        assert r2.returncode == 2 and "no live child" in r2.stderr
        assert bystander.poll() is None  # untouched
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


def test_stop_of_an_orphaned_child_without_agent(onbox_home, tmp_path, cleanup):
    flag = tmp_path / "flag"
    r = onbox(onbox_home, "run", "--name", "orphstop", "--json", "--", PY, "-c", LOOPER, str(flag))
    info = json.loads(r.stdout)
    wait_for(lambda: _child_up(onbox_home, "orphstop"), what="child up")
    signal_own(onbox_home, info["agent_pid"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(info["agent_pid"]), what="agent gone")
    r2 = onbox(onbox_home, "stop", "orphstop", "--grace", "2", "--no-wait", "--json")  # no agent: stopped here
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["outcome"] == "stopped" and json.loads(r2.stdout)["state"] == "stopped"
    wait_for(lambda: not pid_alive(info["pid"]), what="child stopped")
    assert state(onbox_home, "orphstop")["state"] == "stopped"


def test_stop_no_wait_returns_once_the_agent_has_it_and_json_says_what_was_done(onbox_home, tmp_path, cleanup):
    """`onbox stop --no-wait --json` (what `onboxctl stop` asks over ssh): outcome `asked` with the grace and the
    wait the agent would have used, exit 0 at once; the agent stops the run on its own; a second stop says
    `already_ended` in the same document."""
    flag = tmp_path / "flag"
    r = onbox(onbox_home, "run", "--name", "nw", "--grace", "7", "--json", "--", PY, "-c", LOOPER, str(flag))
    info = json.loads(r.stdout)
    wait_for(lambda: _child_up(onbox_home, "nw"), what="child up")
    r = onbox(onbox_home, "stop", "nw", "--no-wait", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "onbox.stop/1" and doc["outcome"] == "asked" and doc["run"] == "nw"
    assert doc["grace"] == 7 and doc["wait_s"] == 37 and doc["state"] in ("running", "stopping"), doc
    wait_for(lambda: state(onbox_home, "nw").get("state") == "stopped" and not pid_alive(info["pid"]),
             what="the agent stopping the run")
    r = onbox(onbox_home, "stop", "nw", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["outcome"] == "already_ended"
    assert json.loads(r.stdout)["state"] == "stopped"
    r = onbox(onbox_home, "stop", "nw", "--no-wait")
    assert r.returncode == 0 and r.stdout.strip() == "nw is already stopped"


def test_logs_and_ls(onbox_home, cleanup):
    r = onbox(onbox_home, "run", "--foreground", "--name", "lg", "--", PY, "-c",
              "print('\\n'.join('line %d' % i for i in range(10)))")
    assert r.returncode == 0
    out = onbox(onbox_home, "logs", "lg", "-n", "3").stdout.splitlines()
    assert out[:2] == ["line 8", "line 9"] and "attempt 0 ended" in out[-1]
    follow = onbox(onbox_home, "logs", "lg", "-f", "-n", "1", timeout=30)
    assert follow.returncode == 0
    ls = json.loads(onbox(onbox_home, "ls", "--json").stdout)
    assert [x["run"] for x in ls] == ["lg"] and ls[0]["state"] == "done"


@pytest.mark.parametrize("args, message", [
    ((), "no command to run"),
    (("--", "/nonexistent/train.sh"), "no such executable"),
    (("--", "no-such-program-xyz"), "not found on PATH"),
    (("--checkpoint-signal", "SIGBOGUS", "--", "true"), "unknown signal"),
    (("--preempt-signal", "NOPE", "--", "true"), "unknown signal"),
    (("--env", "NOEQUALS", "--", "true"), "KEY=VAL"),
])
def test_bad_input_exits_2_and_creates_nothing(onbox_home, args, message, cleanup):
    r = onbox(onbox_home, "run", "--name", "bad", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (onbox_home / "runs").exists()


def test_malformed_run_file_and_unwritable_home(onbox_home, tmp_path, cleanup):
    bad = tmp_path / "run.toml"
    bad.write_text("[run\nrestart = \n")
    r = onbox(onbox_home, "run", "-f", str(bad), "--", "true")
    assert r.returncode == 2 and "not valid TOML" in r.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[run]\nrestrat = 'always'\n")
    r = onbox(onbox_home, "run", "-f", str(unknown), "--", "true")
    assert r.returncode == 2 and "unknown key" in r.stderr
    assert not (onbox_home / "runs").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = onbox(blocker / "home", "run", "--name", "x", "--", "true")
    assert r.returncode == 2 and "not writable" in r.stderr


def test_profile_defaults_sit_below_the_command_line(onbox_home, cleanup):
    r = onbox(onbox_home, "run", "--foreground", "--profile", "runpod", "--name", "prof", "--", "true")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((onbox_home / "runs" / "prof" / "config.json").read_text())
    assert cfg["profile"] == "runpod" and cfg["grace"] == 5.0  # runpod: SIGTERM, SIGKILL ~5 s later
    r = onbox(onbox_home, "run", "--foreground", "--profile", "runpod", "--grace", "3", "--name", "prof2", "--",
              "true")
    assert r.returncode == 0
    assert json.loads((onbox_home / "runs" / "prof2" / "config.json").read_text())["grace"] == 3.0
    bad = onbox(onbox_home, "run", "--profile", "no-such-platform", "--name", "prof3", "--", "true")
    assert bad.returncode == 2 and not (onbox_home / "runs" / "prof3").exists()


def test_run_by_name_alone_relaunches_from_the_record(onbox_home, tmp_path, cleanup):
    script = "import os; print('count', os.environ['ONBOX_RESTART_COUNT'], os.environ['FOO'])"
    r = onbox(onbox_home, "run", "--foreground", "--name", "again", "--env", "FOO=1", "--", PY, "-c", script)
    assert r.returncode == 0, r.stderr
    r = onbox(onbox_home, "run", "--foreground", "--name", "again", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = state(onbox_home, "again")
    assert len(doc["attempts"]) == 2 and doc["state"] == "done"
    log = (onbox_home / "runs" / "again" / "output.log").read_text()
    assert "count 0 1" in log and "count 1 1" in log
    missing = onbox(onbox_home, "run", "--name", "never-ran")
    assert missing.returncode == 2 and "no command" in missing.stderr
