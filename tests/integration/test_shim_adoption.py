"""An attempt's exit status outlives its agent: the child runs under a per-attempt keeper (onbox/supervisor/shim.py)
that waits for it and writes its exit status to the run dir, so an agent that re-adopts the run after being
SIGKILLed records the real exit instead of `unknown`.

Each test kills only what it started (the agent and the keeper by pid AND start time, read from state.json) and
polls with a bound. The trainer waits for a flag file and exits with the code written in it."""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import pytest

from tests.conftest import default_sigint
from tests.integration.supervisor_helpers import events, onbox, state
from tests.polling import wait_for
from tests.processes import kill_exact, pid_alive, start_ticks

pytestmark = pytest.mark.integration
PY = sys.executable

# Prints "child-up <attempt>", then waits for the flag file; exits with the code written in it.
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
    tmp = flag.with_name(flag.name + ".tmp")
    tmp.write_text(str(code))
    os.replace(tmp, flag)


def _child_up(home, name, attempt=0):
    try:
        printed = "child-up %d" % attempt in (home / "runs" / name / "output.log").read_text()
    except OSError:
        return False
    doc = state(home, name)
    return printed and doc.get("state") == "running" and doc.get("attempt") == attempt and bool(doc.get("child_pid"))


def _launch(home, name, flag):
    r = onbox(home, "run", "--name", name, "--json", "--", PY, "-c", LOOPER, str(flag))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _kill_agent(home, name):
    """SIGKILL the run's agent (by the pid and start time state.json records); the child lives on."""
    doc = state(home, name)
    assert kill_exact(doc["agent_pid"], doc["agent_start_time"], signal.SIGKILL)
    wait_for(lambda: not pid_alive(doc["agent_pid"]), what="the agent gone")
    assert pid_alive(doc["child_pid"]), "the child must outlive its agent"
    return doc


def _keeper(doc):
    """The attempt's keeper as state.json records it: (pid, start time)."""
    keeper = doc["attempts"][-1].get("keeper")
    assert keeper and keeper.get("pid"), "attempt %s has no keeper recorded: %s" % (doc["attempt"], doc["attempts"][-1])
    return keeper["pid"], keeper["start_time"]


def _attempt_lines(home, name):
    text = (home / "runs" / name / "output.log").read_text()
    return [line for line in text.splitlines() if line.startswith("child-up")]


def test_a_trainer_that_exits_0_while_its_agent_is_dead_ends_done_on_relaunch_with_no_extra_attempt(
        onbox_home, tmp_path, cleanup):
    flag = tmp_path / "flag"
    info = _launch(onbox_home, "orph0", flag)
    wait_for(lambda: _child_up(onbox_home, "orph0"), what="child up")
    doc = _kill_agent(onbox_home, "orph0")
    _set_flag(flag, 0)  # the trainer finishes while no agent watches it
    wait_for(lambda: not pid_alive(info["pid"]), what="the orphaned child to finish")
    r = onbox(onbox_home, "run", "--name", "orph0", "--json", "--", PY, "-c", LOOPER, str(flag))
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["adopted"] is True and again["pid"] == info["pid"]
    wait_for(lambda: state(onbox_home, "orph0").get("state") == "done", what="the run done")
    final = state(onbox_home, "orph0")
    assert len(final["attempts"]) == 1, final["attempts"]  # no second attempt: nothing ran twice
    assert final["attempts"][0]["exit"]["code"] == 0 and final["attempts"][0]["exit"]["classification"] == "success"
    assert final["last_exit"]["code"] == 0 and final["restarts"] == doc["restarts"]
    adopted = [e for e in events(onbox_home, "orph0") if e["type"] == "adopted"]
    assert adopted and adopted[-1]["pid"] == info["pid"] and adopted[-1]["ended"] is True
    assert _attempt_lines(onbox_home, "orph0") == ["child-up 0"]


def test_a_trainer_that_exits_3_while_its_agent_is_dead_is_a_failure_the_restart_policy_restarts(
        onbox_home, tmp_path, cleanup):
    flag = tmp_path / "flag"
    info = _launch(onbox_home, "orph3", flag)
    wait_for(lambda: _child_up(onbox_home, "orph3"), what="child up")
    _kill_agent(onbox_home, "orph3")
    _set_flag(flag, 3)
    wait_for(lambda: not pid_alive(info["pid"]), what="the orphaned child to fail")
    r = onbox(onbox_home, "adopt", "orph3", "--json")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: _child_up(onbox_home, "orph3", attempt=1), what="the restart after the recorded failure")
    doc = state(onbox_home, "orph3")
    first = doc["attempts"][0]["exit"]
    assert first["code"] == 3 and first["classification"] == "failed", first
    assert doc["restarts"] == 1
    _set_flag(flag, 0)
    wait_for(lambda: state(onbox_home, "orph3").get("state") == "done", what="the restarted attempt done")
    assert [a["exit"]["code"] for a in state(onbox_home, "orph3")["attempts"]] == [3, 0]


def test_a_trainer_adopted_alive_that_then_exits_0_ends_done_without_another_attempt(onbox_home, tmp_path, cleanup):
    flag = tmp_path / "flag"
    info = _launch(onbox_home, "alive0", flag)
    wait_for(lambda: _child_up(onbox_home, "alive0"), what="child up")
    _kill_agent(onbox_home, "alive0")
    again = json.loads(onbox(onbox_home, "run", "--name", "alive0", "--json", "--", PY, "-c", LOOPER,
                             str(flag)).stdout)
    assert again["adopted"] is True and again["pid"] == info["pid"]
    _set_flag(flag, 0)  # ends while the relaunched agent supervises it (it is not that agent's child)
    wait_for(lambda: state(onbox_home, "alive0").get("state") == "done", what="the run done")
    doc = state(onbox_home, "alive0")
    assert len(doc["attempts"]) == 1 and doc["attempts"][0]["exit"]["classification"] == "success"
    adopted = [e for e in events(onbox_home, "alive0") if e["type"] == "adopted"]
    assert adopted and adopted[-1]["ended"] is False


def test_a_killed_keeper_leaves_the_exit_unknown_and_says_so(onbox_home, tmp_path, cleanup):
    flag = tmp_path / "flag"
    info = _launch(onbox_home, "nokeep", flag)
    wait_for(lambda: _child_up(onbox_home, "nokeep"), what="child up")
    doc = _kill_agent(onbox_home, "nokeep")
    keeper_pid, keeper_start = _keeper(doc)
    assert kill_exact(keeper_pid, keeper_start, signal.SIGKILL)  # the keeper too: nothing can wait for the child now
    wait_for(lambda: start_ticks(keeper_pid) != keeper_start or not pid_alive(keeper_pid), what="the keeper gone")
    assert pid_alive(info["pid"])  # the child outlives its keeper as well
    again = json.loads(onbox(onbox_home, "run", "--name", "nokeep", "--json", "--", PY, "-c", LOOPER,
                             str(flag)).stdout)
    assert again["adopted"] is True and again["pid"] == info["pid"]
    _set_flag(flag, 0)
    wait_for(lambda: _child_up(onbox_home, "nokeep", attempt=1), what="the restart after an unknown exit")
    first = state(onbox_home, "nokeep")["attempts"][0]["exit"]
    assert first["classification"] == "unknown" and first["code"] is None, first
    assert "keeper" in first["message"] and str(keeper_pid) in first["message"], first["message"]
    r = onbox(onbox_home, "stop", "nokeep", "--grace", "5")
    assert r.returncode == 0, r.stderr


def test_a_killed_keeper_under_a_live_agent_still_gives_the_exact_exit(onbox_home, tmp_path, cleanup):
    """The agent is a child subreaper: once the keeper is gone, its child is the agent's own to wait for."""
    flag = tmp_path / "flag"
    info = _launch(onbox_home, "agentkeeps", flag)
    wait_for(lambda: _child_up(onbox_home, "agentkeeps"), what="child up")
    keeper_pid, keeper_start = _keeper(state(onbox_home, "agentkeeps"))
    assert kill_exact(keeper_pid, keeper_start, signal.SIGKILL)
    wait_for(lambda: start_ticks(keeper_pid) != keeper_start or not pid_alive(keeper_pid), what="the keeper gone")
    _set_flag(flag, 5)
    wait_for(lambda: _child_up(onbox_home, "agentkeeps", attempt=1), what="the restart after exit 5")
    doc = state(onbox_home, "agentkeeps")
    assert doc["agent_pid"] == info["agent_pid"]
    assert doc["attempts"][0]["exit"]["code"] == 5 and doc["attempts"][0]["exit"]["classification"] == "failed"
    r = onbox(onbox_home, "stop", "agentkeeps", "--grace", "5")
    assert r.returncode == 0, r.stderr


# What the trainer sees of itself: its session and group, its signal masks, its open descriptors, its stdin.
SELF_REPORT = textwrap.dedent("""
    import json, os
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    fds = sorted(int(x) for x in os.listdir("/proc/self/fd"))
    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "ppid": os.getppid(),
                      "blk": status["SigBlk"].strip(), "ign": status["SigIgn"].strip(),
                      "cgt": status["SigCgt"].strip(), "fds": fds, "stdin": os.readlink("/proc/self/fd/0"),
                      "run": os.environ.get("ONBOX_RUN")}), flush=True)
""")


def test_the_keeper_changes_nothing_the_trainer_sees(onbox_home, tmp_path, cleanup):
    """The child still leads its own session and group (the agent signals that group), blocks nothing, ignores and
    catches what a child started directly would, holds only stdin/stdout/stderr, reads /dev/null; its parent is the
    keeper, which sits in a session of its own (never in the child's, which the agent's stops sweep)."""
    import subprocess

    r = onbox(onbox_home, "run", "--foreground", "--name", "sees", "--", PY, "-c", SELF_REPORT)
    assert r.returncode == 0, r.stderr
    line = next(x for x in (onbox_home / "runs" / "sees" / "output.log").read_text().splitlines()
                if x.startswith("{"))
    seen = json.loads(line)
    # the same interpreter started directly, as subprocess starts a child (restore_signals), with SIGINT at its
    # default as the agent gives every attempt: the reference (a runner started with SIGINT ignored, as CI's
    # background job is, would otherwise pass the ignore on to it and not to the trainer)
    ref = json.loads(subprocess.run([PY, "-c", SELF_REPORT], capture_output=True, text=True, timeout=60,
                                    stdin=subprocess.DEVNULL, preexec_fn=default_sigint).stdout)
    assert seen["sid"] == seen["pgid"] == seen["pid"]
    assert (seen["blk"], seen["ign"], seen["cgt"]) == (ref["blk"], ref["ign"], ref["cgt"])
    assert seen["fds"][:3] == [0, 1, 2] and len(seen["fds"]) == 4  # 0-2 and the one listing /proc/self/fd
    assert seen["stdin"] == "/dev/null" and seen["run"] == "sees"
    doc = state(onbox_home, "sees")
    keeper = doc["attempts"][0]["keeper"]
    assert seen["ppid"] == keeper["pid"] and doc["attempts"][0]["exit"]["code"] == 0
