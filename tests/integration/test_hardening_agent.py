"""Issue 12, the agent's side, with the real `onbox` CLI and real processes: what a bad record, a dying thread, a
corrupt state file, a stuck agent, an unrecognised trainer, a committed checkpoint, a secret and a shared box
must each produce. (The one-line refusals of bad input are the table in test_bad_inputs_onbox.py.)"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.integration.supervisor_helpers import events, onbox, state
from tests.polling import wait_for
from tests.processes import Started, signal_own

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("cleanup")]
PY = sys.executable
SLEEPER = "import time\nfor _ in range(6000): time.sleep(0.01)"


def run_dir(home, name):
    return home / "runs" / name


def write_run(home, name, config, state_text=None):
    d = run_dir(home, name)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(dict({"name": name, "command": ["true"]}, **config)))
    if state_text is not None:
        (d / "state.json").write_text(state_text)
    return d


def heartbeats(path):
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def alert_codes(path):
    return {a["code"] for b in heartbeats(path) for a in b.get("alerts") or []}


def stop(home, name):
    r = onbox(home, "stop", name, "--grace", "2")
    assert r.returncode == 0, r.stderr
    return r


# ---- 1. an uncatchable signal ------------------------------------------------------------------------------------
def test_a_record_with_an_uncatchable_signal_is_refused_and_the_flag_overrides_it(onbox_home):
    """An older onbox took `--preempt-signal KILL` and left this record; every relaunch crashed in the agent."""
    d = write_run(onbox_home, "old", {"command": [PY, "-c", "print('hi')"], "preempt_signal": "KILL",
                                      "restart": "never"})
    r = onbox(onbox_home, "run", "--name", "old")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    first, hint = r.stderr.splitlines()[:2]
    assert first == "onbox: --preempt-signal: SIGKILL cannot be caught, so the agent could never act on it"
    assert "re-launch record %s" % (d / "config.json") in hint and "command line overrides" in hint
    assert sorted(os.listdir(d)) == ["config.json"]  # refused before anything was created
    r = onbox(onbox_home, "run", "--foreground", "--name", "old", "--preempt-signal", "USR2")
    assert r.returncode == 0, r.stderr
    assert state(onbox_home, "old")["state"] == "done"
    assert json.loads((d / "config.json").read_text())["preempt_signal"] == "USR2"


# ---- 2. a background thread that dies ---------------------------------------------------------------------------
def test_a_dead_metadata_poller_is_an_event_an_alert_and_a_status_line(onbox_home, tmp_path,
                                                                       garbage_metadata_server):
    hb = tmp_path / "hb.jsonl"
    r = onbox(onbox_home, "run", "--name", "md", "--notice-source", "aws", "--metadata-url", garbage_metadata_server,
              "--heartbeat-file", str(hb), "--heartbeat-interval", "0.1", "--", PY, "-c", SLEEPER)
    assert r.returncode == 0, r.stderr
    died = wait_for(lambda: [e for e in events(onbox_home, "md") if e["type"] == "thread_died"], 20,
                    "the poller's death in events.jsonl")
    assert died[0]["thread"] == "onbox-metadata" and "BadStatusLine" in died[0]["error"], died
    warning = wait_for(lambda: state(onbox_home, "md").get("warnings"), 10, "the warning in state.json")[0]
    assert warning["code"] == "thread_died" and warning["severity"] == "critical"
    assert warning["message"].startswith("cloud preemption notices (aws metadata) stopped")
    s = onbox(onbox_home, "status", "md")
    assert s.returncode == 0, s.stderr
    line = [x for x in s.stdout.splitlines() if "WARNING" in x]
    assert line and "cloud preemption notices (aws metadata) stopped" in line[0] and "kill -KILL" in line[0], s.stdout
    summary = (run_dir(onbox_home, "md") / "training_status.md").read_text()
    assert "## Warnings" in summary and "onbox-metadata" in summary
    wait_for(lambda: "thread_died" in alert_codes(hb), 10, "the thread_died alert in a heartbeat")
    assert state(onbox_home, "md")["state"] == "running"  # the job itself is untouched
    stop(onbox_home, "md")


def test_an_unanswering_auto_probe_stays_silent(onbox_home, tmp_path, garbage_metadata_server):
    """notice_source=auto probing something that answers garbage: not this provider; no alarm (by design)."""
    r = onbox(onbox_home, "run", "--foreground", "--name", "auto", "--notice-source", "auto", "--metadata-url",
              garbage_metadata_server, "--", PY, "-c", "import time; time.sleep(1)")
    assert r.returncode == 0, r.stderr
    assert not [e for e in events(onbox_home, "auto") if e["type"] == "thread_died"]


# ---- 3. a stop request with a grace that is not a number ------------------------------------------------------
def test_a_hand_written_stop_request_with_nan_grace_still_stops_with_the_final_commit(onbox_home):
    r = onbox(onbox_home, "run", "--name", "nan", "--grace", "5", "--", PY, "-c", SLEEPER)
    assert r.returncode == 0, r.stderr
    (run_dir(onbox_home, "nan") / "stop.request").write_text('{"grace": NaN}')  # `onbox stop` refuses nan
    wait_for(lambda: state(onbox_home, "nan").get("state") == "stopped", 20, "the run to stop")
    kinds = [e["type"] for e in events(onbox_home, "nan")]
    assert "stop_grace_ignored" in kinds and "final_checkpoint" in kinds, kinds


# ---- 4. corrupt state, unusable home -------------------------------------------------------------------------
def test_status_prints_every_run_and_names_the_corrupt_one_with_the_way_out(onbox_home):
    write_run(onbox_home, "good", {}, json.dumps({"run": "good", "state": "done", "attempt": 0, "restarts": 0}))
    bad = write_run(onbox_home, "bad", {}, '{"run": "bad", "state": "runn')
    r = onbox(onbox_home, "status")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stdout.splitlines()[0].startswith("bad: CORRUPT — %s is corrupt: not valid JSON" % (bad / "state.json"))
    assert any(x.startswith("good: done") for x in r.stdout.splitlines()), r.stdout
    first, hint = r.stderr.splitlines()[:2]
    assert first.startswith("onbox: run bad: %s is corrupt" % (bad / "state.json"))
    assert "mv %s %s.corrupt" % (bad / "state.json", bad / "state.json") in hint and "onbox run --name bad" in hint
    r = onbox(onbox_home, "status", "--json")
    assert r.returncode == 2 and {d["run"]: d["state"] for d in json.loads(r.stdout)} == {"bad": "corrupt",
                                                                                         "good": "done"}
    r = onbox(onbox_home, "ls")
    assert r.returncode == 0 and "corrupt" in r.stdout


# ---- 5. `onbox stop` that runs out of time -------------------------------------------------------------------
def test_stop_that_times_out_exits_1_and_leaves_the_request(onbox_home, tmp_path):
    d = write_run(onbox_home, "stuck", {}, json.dumps({"run": "stuck", "state": "running", "attempt": 0}))
    # an "agent" that holds the run's lock and never acts on the request
    with Started() as started:
        holder = started.popen([PY, "-c", textwrap.dedent("""
            import fcntl, os, sys, time
            fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("locked", flush=True)
            time.sleep(60)
        """), str(d / "lock")], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        r = onbox(onbox_home, "stop", "stuck", "--timeout", "0.5")
        assert r.returncode == 1, (r.returncode, r.stderr)
        first, hint = r.stderr.splitlines()[:2]
        assert first == "onbox: run stuck did not stop within 0.5 s" and "stop request stays" in hint
        assert (d / "stop.request").exists()
    with open(d / "lock") as f:  # the lock is free again: the holder is gone
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ---- 6. metrics ------------------------------------------------------------------------------------------------
PRINTER = textwrap.dedent("""
    import sys, time
    print(sys.argv[1], flush=True)
    for _ in range(6000):
        time.sleep(0.01)
""")


def test_the_common_step_loss_shape_is_recognised(onbox_home):
    r = onbox(onbox_home, "run", "--name", "plain", "--", PY, "-c", PRINTER, "Step 10/1000 | loss 0.5 | lr 3e-4")
    assert r.returncode == 0, r.stderr
    prog = wait_for(lambda: json.loads((run_dir(onbox_home, "plain") / "progress.json").read_text())
                    if (run_dir(onbox_home, "plain") / "progress.json").exists() else None, 20, "progress.json")
    assert (prog["step"], prog["loss"], prog["lr"]) == (10, 0.5, 3e-4)
    s = onbox(onbox_home, "status", "plain")
    assert "progress: step 10, loss 0.5" in s.stdout, s.stdout
    stop(onbox_home, "plain")


def test_output_without_metrics_is_said_once_with_the_flag_and_a_regex_fixes_it(onbox_home, tmp_path):
    hb = tmp_path / "hb.jsonl"
    env = {"ONBOX_METRICS_HINT_MINUTES": "0.005"}  # 0.3 s
    r = onbox(onbox_home, "run", "--name", "odd", "--heartbeat-file", str(hb), "--heartbeat-interval", "0.05",
              "--", PY, "-c", PRINTER, "objective=0.25 after 10 updates", env_extra=env)
    assert r.returncode == 0, r.stderr
    hinted = wait_for(lambda: [e for e in events(onbox_home, "odd") if e["type"] == "metrics_unrecognised"], 20,
                      "the metrics hint")
    assert "--metrics-regex" in hinted[0]["hint"]
    wait_for(lambda: "no_metrics" in alert_codes(hb), 10, "the no_metrics alert in a heartbeat")
    s = onbox(onbox_home, "status", "odd")
    assert [x for x in s.stdout.splitlines() if x.strip().startswith("warning: the job has printed 1 lines")
            and "--metrics-regex" in x], s.stdout
    beats = len(heartbeats(hb))
    wait_for(lambda: len(heartbeats(hb)) >= beats + 5, 10, "five more beats")
    assert len([e for e in events(onbox_home, "odd") if e["type"] == "metrics_unrecognised"]) == 1  # once
    stop(onbox_home, "odd")

    r = onbox(onbox_home, "run", "--name", "fixed", "--metrics-regex",
              r"objective=(?P<loss>[\d.]+) after (?P<step>\d+) updates", "--", PY, "-c", PRINTER,
              "objective=0.25 after 10 updates", env_extra=env)
    assert r.returncode == 0, r.stderr
    path = run_dir(onbox_home, "fixed") / "progress.json"
    prog = wait_for(lambda: path.exists() and json.loads(path.read_text()), 20, "progress.json")
    assert (prog["step"], prog["loss"]) == (10, 0.25)
    assert json.loads((run_dir(onbox_home, "fixed") / "config.json").read_text())["metrics_regex"] == [
        r"objective=(?P<loss>[\d.]+) after (?P<step>\d+) updates"]
    stop(onbox_home, "fixed")
    assert not [e for e in events(onbox_home, "fixed") if e["type"] == "metrics_unrecognised"]


# ---- 7. training_status.md says what is true ----------------------------------------------------------------
CHECKPOINTER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, %(repo)r)
    from tests.checkpoint_files import write_torch_zip
    ck = os.environ["ONBOX_CKPT_DIR"]
    for step in (10, 20, 30):
        write_torch_zip(os.path.join(ck, "step_%%d.pt" %% step))
        print("step %%d loss %%.2f" %% (step, 3.0 / step), flush=True)
        time.sleep(0.3)
    for _ in range(6000):
        time.sleep(0.01)
""")


def test_the_summary_follows_commits_and_progress_and_tells_the_truth_after_a_preemption(onbox_home, tmp_path):
    from tests.conftest import REPO_ROOT

    durable = tmp_path / "durable"
    durable.mkdir()
    r = onbox(onbox_home, "run", "--name", "ck", "--durable", str(durable), "--sync-interval", "0.1",
              "--settle-seconds", "0.2", "--keep-last", "10", "--", PY, "-c", CHECKPOINTER % {"repo": REPO_ROOT})
    assert r.returncode == 0, r.stderr
    md = run_dir(onbox_home, "ck") / "training_status.md"
    wait_for(lambda: "step_30.pt (step 30)" in md.read_text() and "progress: step 30" in md.read_text(), 30,
             "training_status.md to show the committed step 30 while the run stays in one state")
    text = md.read_text()
    assert "no checkpoint yet" not in text and "no checkpoint on durable storage" not in text, text
    assert "- durable: step_30.pt (step 30)" in text and "- state: **running**" in text
    assert [e["new"] for e in events(onbox_home, "ck") if e["type"] == "state"] == ["running"]  # no state change

    agent = state(onbox_home, "ck")["agent_pid"]
    signal_own(onbox_home, agent, signal.SIGUSR1)  # the scheduler's warning, to the agent this test started
    wait_for(lambda: state(onbox_home, "ck").get("state") == "preempted", 20, "the preemption")
    wait_for(lambda: "relaunch with" in state(onbox_home, "ck").get("message", ""), 10, "the final message")
    text = md.read_text()
    assert "- next: nothing restarts it by itself: relaunch with `onbox run --name ck`" in text, text
    assert "it resumes from the newest checkpoint" in text
    assert "restart/requeue is expected" not in text and "the run restarts" not in text
    s = onbox(onbox_home, "status", "ck")
    assert "preempted (signal:SIGUSR1); relaunch with `onbox run --name ck`" in s.stdout, s.stdout


# ---- 8. secrets ----------------------------------------------------------------------------------------------
ENV_PROBE = textwrap.dedent("""
    import json, os, sys, time
    json.dump(dict(os.environ), open(sys.argv[1] + ".tmp", "w")); os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    print("probed", flush=True)
    for _ in range(6000):
        time.sleep(0.01)
""")


def test_secrets_reach_the_child_only(onbox_home, tmp_path):
    secrets = onbox_home / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "HF_TOKEN").write_text("hf_FIRST_s3cr3t\n")
    (secrets / "HF_TOKEN").chmod(0o600)
    env_file = tmp_path / "job.env"
    env_file.write_text("# the job's keys\nWANDB_API_KEY=wandb_S3CRET_value\nexport PLAIN='x y'\n")
    env_file.chmod(0o600)
    probe = tmp_path / "env.json"
    r = onbox(onbox_home, "run", "--name", "sec", "--secret", "HF_TOKEN", "--env-file", str(env_file),
              "--env", "VISIBLE=1", "--ckpt-dir", str(tmp_path / "ck"), "--", PY, "-c", ENV_PROBE, str(probe))
    assert r.returncode == 0 and r.stderr == "", r.stderr  # nothing to warn about
    child = wait_for(lambda: probe.exists() and json.loads(probe.read_text()), 20, "the child's environment")
    assert child["HF_TOKEN"] == "hf_FIRST_s3cr3t" and child["WANDB_API_KEY"] == "wandb_S3CRET_value"
    assert child["PLAIN"] == "x y" and child["VISIBLE"] == "1"
    agent = state(onbox_home, "sec")["agent_pid"]
    with open("/proc/%d/cmdline" % agent, "rb") as f:
        cmdline = f.read()
    with open("/proc/%d/environ" % agent, "rb") as f:
        agent_env = f.read()
    assert b"--secret\0HF_TOKEN" in cmdline  # the name is there, the value is not
    for value in (b"hf_FIRST_s3cr3t", b"wandb_S3CRET_value"):
        assert value not in cmdline and value not in agent_env
    cfg = json.loads((run_dir(onbox_home, "sec") / "config.json").read_text())
    assert cfg["secrets"] == ["HF_TOKEN"] and cfg["env_files"] == [str(env_file)] and cfg["env"] == {"VISIBLE": "1"}
    stop(onbox_home, "sec")
    for path in run_dir(onbox_home, "sec").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"hf_FIRST_s3cr3t" not in data and b"wandb_S3CRET_value" not in data, path

    (secrets / "HF_TOKEN").write_text("hf_SECOND_s3cr3t")  # rotated: the relaunch reads it again, by name
    probe.unlink()
    r = onbox(onbox_home, "run", "--name", "sec")
    assert r.returncode == 0, r.stderr
    child = wait_for(lambda: probe.exists() and json.loads(probe.read_text()), 20, "the relaunched child")
    assert child["HF_TOKEN"] == "hf_SECOND_s3cr3t"
    stop(onbox_home, "sec")


def test_a_secret_looking_env_flag_and_loose_files_are_warned_about(onbox_home, tmp_path):
    token = tmp_path / "tracker-token"
    token.write_text("tok\n")
    token.chmod(0o644)
    r = onbox(onbox_home, "run", "--foreground", "--name", "warn", "--env", "HF_TOKEN=hf_visible_value",
              "--tracker", "http://127.0.0.1:9", "--tracker-token-file", str(token), "--heartbeat-interval", "60",
              "--ckpt-dir", str(tmp_path / "ck"), "--", PY, "-c", "0")
    assert r.returncode == 0, r.stderr
    warnings = [x for x in r.stderr.splitlines() if x.startswith("onbox: warning: ")]
    assert len(warnings) == 2, r.stderr
    assert warnings[0].startswith("onbox: warning: --env HF_TOKEN looks like a secret") and "--secret HF_TOKEN" in warnings[0]
    assert warnings[1] == "onbox: warning: the tracker token file %s is readable by everyone (mode 0644): " \
                          "`chmod 600 %s`" % (token, token)
    assert "hf_visible_value" not in r.stderr


# ---- 9. permissions --------------------------------------------------------------------------------------------
def test_run_dirs_are_0700_and_their_files_0600_also_after_an_older_agent(onbox_home, tmp_path):
    r = onbox(onbox_home, "run", "--name", "perm", "--heartbeat-file", str(tmp_path / "hb.jsonl"),
              "--", PY, "-c", "print('step 1 loss 2.0')")
    assert r.returncode == 0, r.stderr
    d = run_dir(onbox_home, "perm")
    done = wait_for(lambda: state(onbox_home, "perm").get("state") == "done" and state(onbox_home, "perm"), 20,
                    "the run to end")
    wait_for(lambda: not os.path.exists("/proc/%d" % done["agent_pid"]), 20, "the agent to exit")

    def loose():
        found = []
        for path in [d, *d.rglob("*")]:
            rel = path.relative_to(d).parts
            if rel[:1] == ("checkpoints",):  # the trainer's files, written with its own umask
                continue
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode != (0o700 if path.is_dir() else 0o600):
                found.append("%s %o" % (path, mode))
        return found

    names = {p.name for p in d.iterdir()}
    assert {"config.json", "state.json", "events.jsonl", "output.log", "agent.log", "lock", "training_status.md",
            "progress.json", "heartbeats"} <= names, names
    assert loose() == []
    assert stat.S_IMODE((onbox_home / "runs").stat().st_mode) == 0o700
    for path in [d, *d.rglob("*")]:  # what an older agent left behind
        if "checkpoints" not in path.parts:
            path.chmod(0o755 if path.is_dir() else 0o644)
    r = onbox(onbox_home, "run", "--foreground", "--name", "perm")
    assert r.returncode == 0, r.stderr
    assert loose() == []
