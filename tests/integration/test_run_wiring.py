"""`onbox run` wired to its subsystems, with real processes: the documented flags (tracker, token, heartbeat and
checkpoint options), the agent's secrets kept from the child (U34), hook errors refused in the foreground before
anything is created or detached, and the final commit when a run ends without a preemption."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from tests.integration.supervisor_helpers import onbox, state
from tests.polling import wait_for
from tests.processes import pids_with_home

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("cleanup")]
PY = sys.executable

ENV_PROBE = ("import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w')); "
             "print('iter 1: loss 2.5000, time 10.00ms, mfu 1.00%')")


def test_tracker_flags_authenticate_while_the_child_never_sees_the_token(onbox_home, tmp_path, tracker):
    probe, hb_file = tmp_path / "env.json", tmp_path / "beats" / "hb.jsonl"
    r = onbox(onbox_home, "run", "--foreground", "--name", "tok", "--restart", "never", "--tracker", tracker.url,
              "--heartbeat-interval", "0.05", "--heartbeat-file", str(hb_file), "--", PY, "-c", ENV_PROBE,
              str(probe), env_extra={"ONBOX_TRACKER_TOKEN": tracker.token, "SOME_USER_VAR": "kept"})
    assert r.returncode == 0, r.stderr
    child_env = json.loads(probe.read_text())
    assert "ONBOX_TRACKER_TOKEN" not in child_env  # U34: the agent's secret stays with the agent
    assert tracker.token not in json.dumps(child_env)
    assert child_env["SOME_USER_VAR"] == "kept" and child_env["ONBOX_RUN"] == "tok"
    # ... while the agent itself authenticated with it: the tracker (which requires the token) took the beats
    beats = wait_for(lambda: tracker.all_heartbeats("tok"), timeout=30, what="beats accepted by the tracker")
    assert beats[-1]["state"] == "done" and beats[-1]["interval_s"] == 0.05
    assert [json.loads(line)["seq"] for line in hb_file.read_text().splitlines()] == [b["seq"] for b in beats]
    # nothing the run leaves on disk carries the token
    run_dir = onbox_home / "runs" / "tok"
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert tracker.token.encode() not in path.read_bytes(), path
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["tracker"] == tracker.url and cfg["heartbeat_interval"] == 0.05
    assert cfg["heartbeat_file"] == str(hb_file) and cfg["tracker_token_file"] is None


def test_token_file_and_checkpoint_options_reach_the_run(onbox_home, tmp_path, tracker):
    probe, durable = tmp_path / "env.json", tmp_path / "durable"
    os.makedirs(durable)
    r = onbox(onbox_home, "run", "--foreground", "--name", "opts", "--restart", "never", "--tracker", tracker.url,
              "--tracker-token-file", tracker.token_file, "--heartbeat-interval", "0.05", "--durable", str(durable),
              "--sync-interval", "7", "--settle-seconds", "0.5", "--keep-last", "2", "--keep-best", "eval_loss:max",
              "--keep-every", "100", "--prune-local", "--final-sync-timeout", "30", "--ping-url",
              "http://127.0.0.1:9/ping", "--", PY, "-c", ENV_PROBE, str(probe))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: tracker.all_heartbeats("opts"), timeout=30, what="beats sent with the file's token")
    cfg = json.loads((onbox_home / "runs" / "opts" / "config.json").read_text())
    assert {k: cfg[k] for k in ("tracker_token_file", "durable", "sync_interval", "settle_seconds", "keep_last",
                                "keep_best_metric", "keep_best_mode", "keep_every_steps", "prune_local",
                                "final_sync_timeout", "ping_url")} == {
        "tracker_token_file": tracker.token_file, "durable": str(durable), "sync_interval": 7.0,
        "settle_seconds": 0.5, "keep_last": 2, "keep_best_metric": "eval_loss", "keep_best_mode": "max",
        "keep_every_steps": 100, "prune_local": True, "final_sync_timeout": 30.0, "ping_url": "http://127.0.0.1:9/ping"}


def _not_a_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return str(blocker / "sub")


@pytest.mark.parametrize("case", ["bad-tracker-url", "bad-port", "missing-token-file", "no-token", "durable",
                                  "heartbeat-file", "ckpt-dir", "keep-best", "keep-every", "rclone-missing",
                                  "token-as-env-flag"])
def test_a_run_the_hooks_would_refuse_is_refused_before_detaching(onbox_home, tmp_path, case):
    """Refused in the foreground: one clear line (+ hint), exit 2 or 3, no run directory, no agent left."""
    blocked = _not_a_dir(tmp_path)
    args, code, words, env = {
        "bad-tracker-url": (["--tracker", "ftp://10.0.0.5"], 2, "http(s) URL", {}),
        "bad-port": (["--tracker", "http://10.0.0.5:notaport"], 2, "--tracker", {}),
        "missing-token-file": (["--tracker", "http://127.0.0.1:9", "--tracker-token-file",
                                str(tmp_path / "nope")], 2, "cannot read the tracker token file", {}),
        "no-token": (["--tracker", "http://127.0.0.1:9"], 2, "needs a token", {}),
        "durable": (["--durable", blocked], 3, "durable target", {}),
        "heartbeat-file": (["--heartbeat-file", os.path.join(blocked, "hb.jsonl")], 3, "heartbeat file", {}),
        "ckpt-dir": (["--ckpt-dir", blocked], 3, "checkpoint dir", {}),
        "keep-best": (["--keep-best", "eval_loss:sideways"], 2, "--keep-best", {}),
        "keep-every": (["--keep-every", "0"], 2, "keep_every_steps", {}),
        "rclone-missing": (["--durable", "remote:bucket"], 3, "rclone is not installed", {"PATH": "/nonexistent"}),
        "token-as-env-flag": (["--env", "ONBOX_TRACKER_TOKEN=s3cret"], 2, "the agent's secret", {}),
    }[case]
    r = onbox(onbox_home, "run", "--name", "refused", *args, "--", PY, "-c", "print('never')", env_extra=env)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    first = r.stderr.splitlines()[0]
    assert first.startswith("onbox: ") and words in first, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == "" and "s3cret" not in r.stderr
    assert not (onbox_home / "runs" / "refused").exists()
    assert pids_with_home(onbox_home) == []  # nothing was detached


TRAINER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, %(repo)r)
    from tests.checkpoint_files import write_safetensors, write_torch_zip
    ck = os.environ["ONBOX_CKPT_DIR"]
    if sys.argv[1] == "pt":
        write_torch_zip(os.path.join(ck, "step_40.pt"))
    else:  # a Hugging Face style dir: its JSON file carries no integrity structure, so it must settle first
        d = os.path.join(ck, "checkpoint-40")
        write_safetensors(os.path.join(d, "model.safetensors"))
        open(os.path.join(d, "trainer_state.json"), "w").write('{"global_step": 40}')
    print("saved; exiting", flush=True)
    sys.exit(int(sys.argv[2]))
""")


@pytest.mark.parametrize("kind,exit_code,run_exit", [("pt", 0, 0), ("hf", 0, 0), ("pt", 4, 1)])
def test_the_checkpoint_written_right_before_a_normal_exit_is_committed(onbox_home, tmp_path, kind, exit_code,
                                                                         run_exit):
    """The periodic commit is far off (sync interval 1 h): only the final commit at the end can make it durable,
    on success and on a failure that will not be restarted alike."""
    from tests.conftest import REPO_ROOT

    durable = tmp_path / "durable"
    r = onbox(onbox_home, "run", "--foreground", "--name", "fin", "--restart", "never", "--durable", str(durable),
              "--sync-interval", "3600", "--settle-seconds", "0.3", "--", PY, "-c", TRAINER % {"repo": REPO_ROOT},
              kind, str(exit_code))
    assert r.returncode == run_exit, r.stderr
    name = "step_40.pt" if kind == "pt" else "checkpoint-40"
    manifest = json.loads((durable / "fin" / "checkpoints" / name / "MANIFEST.json").read_text())
    assert manifest["step"] == 40
    index = json.loads((durable / "fin" / "checkpoints_index.json").read_text())
    assert [c["name"] for c in index["checkpoints"]] == [name]
    doc = state(onbox_home, "fin")
    assert doc["state"] == ("done" if run_exit == 0 else "failed")
    finals = [e for e in _events(onbox_home, "fin") if e["type"] == "final_checkpoint"]
    assert len(finals) == 1 and finals[0]["summary"]["status"] == "committed"
    verify = onbox(onbox_home, "verify", str(durable / "fin" / "checkpoints" / name))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _events(home, name):
    from tests.integration.supervisor_helpers import events

    return events(home, name)


BROKEN_HOOKS = textwrap.dedent("""
    import sys
    from onbox import subsystems
    from onbox.errors import UnfitError

    def broken(ctx):  # what preflight() cannot foresee: the hooks fail inside the detached agent
        raise UnfitError("the durable mount went away", hint="remount it")

    subsystems.make_hooks = broken
    from onbox.cli import main
    main(sys.argv[1:])
""")


def test_a_hook_failing_inside_the_detached_agent_still_reaches_the_user(onbox_home):
    import subprocess

    from tests.integration.supervisor_helpers import env_for

    r = subprocess.run([PY, "-c", BROKEN_HOOKS, "run", "--name", "late", "--", PY, "-c", "print('never')"],
                       env=env_for(onbox_home), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert [ln for ln in r.stderr.splitlines() if "no --ckpt-dir" not in ln] == [
        "onbox: run late failed to start: the durable mount went away", "hint: remount it"]
    assert not (onbox_home / "runs" / "late").exists()  # the refused launch left nothing behind
    wait_for(lambda: not pids_with_home(onbox_home), timeout=10, what="the agent gone")


def test_a_start_refused_by_a_live_lease_is_said_refused_nothing_started(onbox_home, tmp_path):
    """Exit 2 from inside the agent is a refusal (here the run's lease, held by a live agent on another box, a second
    ONBOX_HOME on the same durable target): the box's own words say nothing was started (not "failed to start",
    which reads as if a start was tried and broke); a start that did fail inside the agent keeps its words (above)."""
    durable = str(tmp_path / "durable")
    other = tmp_path / "other-box"
    cmd = ["--durable", durable, "--", PY, "-c", "import time; time.sleep(60)"]
    first = onbox(onbox_home, "run", "--name", "twice", *cmd)
    assert first.returncode == 0, first.stderr
    try:
        again = onbox(other, "run", "--name", "twice", *cmd)
        lines = [ln for ln in again.stderr.splitlines() if "no --ckpt-dir" not in ln]
        assert again.returncode == 2, again.stderr
        assert lines[0].startswith("onbox: run twice refused, nothing started: ") and "lease" in lines[0], lines
        assert state(onbox_home, "twice").get("state") == "running"  # the live run untouched
        assert not (other / "runs" / "twice").exists()  # the refused start left nothing behind
    finally:
        onbox(onbox_home, "stop", "twice", "--timeout", "20")
    wait_for(lambda: not pids_with_home(onbox_home), timeout=20, what="the agent gone")
