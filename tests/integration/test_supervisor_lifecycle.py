"""The lifecycle with real processes: restarts with backoff, crash loops, exit classification, orphan clearing."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from tests.integration.supervisor_helpers import events, onbox, state
from tests.processes import pid_alive

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("cleanup")]
PY = sys.executable


def test_detached_run_returns_at_once_and_the_child_sees_the_contract(onbox_home, tmp_path):
    probe = tmp_path / "env.json"
    code = ("import json,os,sys; json.dump({k: v for k, v in os.environ.items() if k.startswith(('ONBOX_', "
            "'PYTHONUNBUFFERED', 'FOO'))}, open(%r, 'w')); print('argv', sys.argv[1:])" % str(probe))
    r = onbox(onbox_home, "run", "--name", "c1", "--env", "FOO=bar", "--json", "--", PY, "-c", code)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["run"] == "c1" and info["pid"] > 0 and info["run_dir"].endswith("runs/c1")
    from tests.polling import wait_for

    summary = onbox_home / "runs" / "c1" / "training_status.md"
    # the writer's contract: training_status.md is written before state.json, so once state.json says done the
    # summary already does (it used to be written after, and a reader in between saw "running" under load)
    at_done = wait_for(lambda: state(onbox_home, "c1").get("state") == "done" and summary.read_text(),
                       what="run c1 done")
    assert "state: **done**" in at_done
    env = json.loads(probe.read_text())
    run_dir = str(onbox_home / "runs" / "c1")
    assert env["ONBOX_RUN"] == "c1"
    assert env["ONBOX_RESTART_COUNT"] == "0" and env["ONBOX_RESUME_FROM"] == ""
    assert env["ONBOX_METRICS_FILE"] == os.path.join(run_dir, "metrics.jsonl")
    assert env["ONBOX_PREEMPT_FILE"] == os.path.join(run_dir, "PREEMPTED")
    assert env["ONBOX_CKPT_DIR"] == os.path.join(run_dir, "checkpoints")
    assert env["PYTHONUNBUFFERED"] == "1" and env["FOO"] == "bar"
    doc = state(onbox_home, "c1")
    assert doc["attempts"][0]["exit"]["classification"] == "success"
    # the state.json contract other subsystems read (heartbeats, reaper, controller)
    assert {"run", "state", "attempt", "child_pid", "child_start_time", "agent_pid", "started_at", "updated_at",
            "restarts", "attempts", "last_exit", "preemption", "ckpt_dir", "run_dir"} <= set(doc)
    assert {"n", "pid", "sid", "pgid", "start_time", "started_at", "ended_at", "exit"} <= set(doc["attempts"][0])
    assert {"code", "signal", "classification", "message"} <= set(doc["attempts"][0]["exit"])
    assert doc["attempts"][0]["sid"] == doc["attempts"][0]["pid"] == info["pid"]  # its own session and group
    st = wait_for(lambda: _status_if_agent_gone(onbox_home, "c1"), what="the agent to exit")
    assert st["state"] == "done"
    cfg = json.loads((onbox_home / "runs" / "c1" / "config.json").read_text())
    assert cfg["command"][0] == PY and cfg["env"] == {"FOO": "bar"}
    assert "state: **done**" in (onbox_home / "runs" / "c1" / "training_status.md").read_text()


def _status_if_agent_gone(home, name):
    st = json.loads(onbox(home, "status", name, "--json").stdout)
    return st if st["agent_alive"] is False else None


def test_crash_restart_with_backoff_then_success(onbox_home, tmp_path):
    counter = tmp_path / "count"
    script = textwrap.dedent("""
        import os, sys
        p = %r
        n = int(open(p).read()) if os.path.exists(p) else 0
        open(p, "w").write(str(n + 1))
        print("attempt", os.environ["ONBOX_RESTART_COUNT"])
        sys.exit(0 if n >= 2 else 1)
    """ % str(counter))
    r = onbox(onbox_home, "run", "--foreground", "--name", "rs", "--", PY, "-c", script,
              env_extra={"ONBOX_CRASH_LOOP_THRESHOLD": "0", "ONBOX_BACKOFF_INITIAL": "0.1",
                         "ONBOX_BACKOFF_MAX": "10"})
    assert r.returncode == 0, r.stderr
    doc = state(onbox_home, "rs")
    assert doc["state"] == "done" and doc["restarts"] == 2 and len(doc["attempts"]) == 3
    assert [a["exit"]["classification"] for a in doc["attempts"]] == ["failed", "failed", "success"]
    delays = [e["delay"] for e in events(onbox_home, "rs") if e["type"] == "state" and e["new"] == "backoff"]
    assert delays == [0.1, 0.2]  # exponential
    log = (onbox_home / "runs" / "rs" / "output.log").read_text()
    assert "attempt 0" in log and "attempt 2" in log


def test_crash_loop_stops_as_failed_with_the_class_and_what_to_do(onbox_home):
    oom = "import sys; print('step 1'); sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory. " \
          "Tried to allocate 2.00 GiB\\n'); sys.exit(1)"
    r = onbox(onbox_home, "run", "--foreground", "--name", "loop", "--", PY, "-c", oom,
              env_extra={"ONBOX_CRASH_LOOP_THRESHOLD": "3", "ONBOX_MAX_RESTARTS": "10"})
    assert r.returncode == 1
    doc = state(onbox_home, "loop")
    assert doc["state"] == "failed" and len(doc["attempts"]) == 3
    assert doc["last_exit"]["classification"] == "cuda_oom"
    assert "crash loop" in doc["message"] and "fit-it ladder" in doc["message"]
    st = onbox(onbox_home, "status", "loop")
    assert "cuda_oom" in st.stdout and "crash loop" in st.stdout


def test_killed_by_signal_is_named_and_never_policy_stops(onbox_home):
    r = onbox(onbox_home, "run", "--foreground", "--restart", "never", "--name", "sig", "--",
              PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert r.returncode == 1
    last = state(onbox_home, "sig")["last_exit"]
    assert last["classification"] == "signal" and last["signal"] == 9
    assert "Signal 9 (SIGKILL)" in last["message"]


def test_orphan_ignoring_sigterm_is_gone_before_the_next_attempt(onbox_home, tmp_path):
    pidfile, verdict = tmp_path / "orphan.pid", tmp_path / "verdict"
    script = textwrap.dedent("""
        import os, signal, subprocess, sys, time
        pidfile, verdict = %r, %r
        if os.environ["ONBOX_RESTART_COUNT"] == "0":
            # a DataLoader-like worker that ignores SIGTERM and outlives its parent
            subprocess.Popen([sys.executable, "-c", "import signal, time, os; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "open(%%r, 'w').write(str(os.getpid())); time.sleep(120)" %% pidfile])
            while not os.path.exists(pidfile) or not open(pidfile).read():
                time.sleep(0.01)
            sys.exit(1)
        pid = int(open(pidfile).read())
        try:
            st = open("/proc/%%d/stat" %% pid).read().rpartition(")")[2].split()[0]
        except OSError:
            st = "gone"
        open(verdict, "w").write(st)
    """ % (str(pidfile), str(verdict)))
    r = onbox(onbox_home, "run", "--foreground", "--name", "orph", "--", PY, "-c", script,
              env_extra={"ONBOX_TERM_TIMEOUT": "0.3"})
    assert r.returncode == 0, r.stderr
    assert verdict.read_text() == "gone"
    kills = [e for e in events(onbox_home, "orph") if e["type"] == "attempt_leftovers_stopped"]
    assert kills and int(pidfile.read_text()) in kills[0]["pids"]
    assert not pid_alive(int(pidfile.read_text()))


def _memory_cgroup_base():
    """(our memory cgroup dir, version) when a memory controller is writable here, else None."""
    try:
        rows = [line.strip().split(":", 2) for line in _read("/proc/self/cgroup").splitlines()]
    except OSError:
        return None
    for _hier, ctrls, path in rows:
        if "memory" in ctrls.split(","):
            d = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
            if os.path.isfile(os.path.join(d, "memory.limit_in_bytes")) and os.access(d, os.W_OK):
                return d, 1
    for hier, _ctrls, path in rows:
        if hier == "0":
            d = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            try:
                if "memory" in _read(os.path.join(d, "cgroup.controllers")).split() and os.access(d, os.W_OK):
                    return d, 2
            except OSError:
                pass
    return None


@pytest.mark.root
def test_host_oom_in_a_memory_limited_cgroup_is_classified_host_oom(onbox_home, tmp_path):
    base = _memory_cgroup_base() if os.geteuid() == 0 else None
    if base is None:
        pytest.skip("no writable memory cgroup controller here (needs root and cgroup v1 memory or v2 memory)")
    parent, version = base
    cg = os.path.join(parent, "onbox-oomtest-%d" % os.getpid())
    os.mkdir(cg)
    try:
        if version == 1:
            _write(os.path.join(cg, "memory.limit_in_bytes"), str(160 * 1024 * 1024))
        else:
            _write(os.path.join(cg, "memory.max"), str(160 * 1024 * 1024))
            _write(os.path.join(cg, "memory.swap.max"), "0")
        hog = "import time; x = bytearray(600 * 1024 * 1024); time.sleep(5)"
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cg, PY, "-m", "onbox", "run",
                "--foreground", "--restart", "never", "--name", "oom", "--", PY, "-c", hog]
        import subprocess

        from tests.integration.supervisor_helpers import env_for

        r = subprocess.run(argv, env=env_for(onbox_home), capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        last = state(onbox_home, "oom")["last_exit"]
        assert last["classification"] == "host_oom", last
        assert "oom_kill" in last["message"]
    finally:
        import time

        for _ in range(200):
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.05)


def _read(path):
    with open(path) as f:
        return f.read()


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def test_output_log_is_bounded_by_rotation_and_relative_paths_are_kept(onbox_home, tmp_path):
    chatty = ("import time\nfor i in range(6):\n    print(('x' * 99 + '\\n') * 40, end='', flush=True)\n"
              "    time.sleep(0.15)\nprint('last line')")
    from tests.polling import wait_for

    # detached: the agent runs from "/", so a relative --ckpt-dir must have been resolved where it was typed
    r = onbox(onbox_home, "run", "--name", "rot", "--ckpt-dir", "ck", "--", PY, "-c", chatty,
              env_extra={"ONBOX_LOG_MAX_BYTES": "5000", "ONBOX_LOG_BACKUPS": "2"}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: state(onbox_home, "rot").get("state") == "done", what="run rot done")
    run_dir = onbox_home / "runs" / "rot"
    assert (run_dir / "output.log.1").exists() and not (run_dir / "output.log.3").exists()
    assert os.path.getsize(run_dir / "output.log") <= 5000 + 4000 + 200  # one burst past the bound at most
    assert any(e["type"] == "log_rotated" for e in events(onbox_home, "rot"))
    assert "last line" in onbox(onbox_home, "logs", "rot", "-n", "5").stdout
    assert state(onbox_home, "rot")["ckpt_dir"] == str(tmp_path / "ck")
