"""The sweep, continued (issue 30): the agent's command line fed what a careless shell or a hostile disk hands it.

Rows as in test_bad_inputs_onbox.py, checked by the same function (exit code, one line, no traceback, nothing
left behind, no process left): a path option whose value is an option or nothing (`--durable $UNSET -- cmd` is
`--durable -- cmd`: the path was `<cwd>/--` and every commit went to the local disk), and a checkpoint or durable
dir inside a system directory. Beside them, the values that must still pass, and the cases a row cannot hold: a
read-only ONBOX_HOME (exit 3, naming it), `onbox stop` on a full ONBOX_HOME (the trainer stopped: said so, and what
could not be recorded), and names from storage or the trainer printed by `onbox checkpoints` and `onbox status`
(control characters shown as escapes, never a forged line; --json keeps them exact).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from onbox.proc import is_alive, start_time
from tests.hosts.tmpfs import tmpfs
from tests.integration.supervisor_helpers import env_for, onbox, state
from tests.integration.test_bad_inputs_onbox import CMD, Link, Row, row
from tests.integration.test_bad_inputs_onbox import test_bad_input_is_refused_cleanly as refused_cleanly
from tests.polling import wait_for
from tests.processes import Started

pytestmark = pytest.mark.integration
PY = sys.executable
RUN = ["run", "--name", "x"]
PATH_FLAGS = ["--ckpt-dir", "--durable", "--workdir", "--run-file", "--env-file", "--tracker-token-file",
              "--heartbeat-file", "--mlflow-token-file", "--node-group"]

ROWS = [  # item 12: a path option's value that is an option, or nothing (an unset variable)
    *(row("run%s-dashdash" % flag, [*RUN, flag, *CMD], 2, "%s needs a value: got '--'" % flag)
      for flag in PATH_FLAGS),
    row("run-f-dashdash", [*RUN, "-f", *CMD], 2, "--run-file needs a value: got '--'"),
    row("run-ckpt-dir-eats-durable", [*RUN, "--ckpt-dir", "--durable", "{tmp}/dur", *CMD], 2,
        "--ckpt-dir needs a value: got '--durable' (an unset variable?)"),
    row("run-durable-empty", [*RUN, "--durable", "", *CMD], 2, "--durable needs a value: got ''"),
    row("run-durable-equals-empty", [*RUN, "--durable=", *CMD], 2, "--durable needs a value: got ''"),
    row("run-durable-blank", [*RUN, "--durable", "  ", *CMD], 2, "--durable needs a value"),
    row("run-ckpt-dir-dash-x", [*RUN, "--ckpt-dir", "-x", *CMD], 2, "--ckpt-dir needs a value: got '-x'"),
    row("run-env-file-second-empty", [*RUN, "--env-file", "{tmp}/a.env", "--env-file", "", *CMD], 2,
        "--env-file needs a value", files={"a.env": "A=1\n"}),
    row("run-workdir-empty", [*RUN, "--workdir", "", *CMD], 2, "--workdir needs a value"),
    row("run-node-group-empty", [*RUN, "--node-group", "", *CMD], 2, "--node-group needs a value"),
    row("queue-add-durable-dashdash", ["queue", "add", "--durable", *CMD], 2, "--durable needs a value: got '--'"),
    row("queue-add-ckpt-dir-empty", ["queue", "add", "--ckpt-dir", "", *CMD], 2, "--ckpt-dir needs a value"),
    row("sync-durable-dashdash", ["sync", "r", "--durable", "--"], 2, "--durable needs a value: got '--'",
        run={}),
    row("sync-ckpt-dir-empty", ["sync", "r", "--ckpt-dir", ""], 2, "--ckpt-dir needs a value", run={}),
    row("checkpoints-durable-empty", ["checkpoints", "r", "--durable", ""], 2, "--durable needs a value", run={}),
    row("sbatch-durable-empty", ["sbatch", "--print", "--durable", "", *CMD], 2, "--durable needs a value"),
    row("sbatch-run-file-eats-option", ["sbatch", "--print", "-f", "--grace", "5", *CMD], 2,
        "--run-file needs a value: got '--grace'"),
    row("sbatch-output-empty", ["sbatch", "--print", "--output", "", *CMD], 2, "--output needs a value"),
    row("audit-durable-dashdash", ["audit", "--durable", "--"], 2, "--durable needs a value: got '--'"),
    row("audit-ckpt-dir-empty", ["audit", "--ckpt-dir", ""], 2, "--ckpt-dir needs a value"),
    row("profiles-show-profile-file-empty", ["profiles", "show", "local", "--profile-file", ""], 2,
        "--profile-file needs a value"),
    row("init-directory-empty", ["init", "plain", ""], 2, "DIRECTORY needs a value"),
]
ROWS += [  # item 14: a checkpoint or durable dir inside a system directory (`/` was the only one refused below)
    row("run-ckpt-dir-usr-share", [*RUN, "--ckpt-dir", "/usr/share", *CMD], 2, "inside the system directory /usr"),
    row("run-ckpt-dir-etc-new", [*RUN, "--ckpt-dir", "/etc/onbox-ckpt-never", *CMD], 2,
        "inside the system directory /etc"),
    row("run-ckpt-dir-opt", [*RUN, "--ckpt-dir", "/opt", *CMD], 2, "system directory"),
    row("run-ckpt-dir-var-lib", [*RUN, "--ckpt-dir", "/var/lib/onbox-ckpt-never", *CMD], 2,
        "inside the system directory /var"),
    row("run-ckpt-dir-link-to-usr-share", [*RUN, "--ckpt-dir", "{tmp}/out", *CMD], 2, "(/usr/share, symlinks",
        files={"out": Link("/usr/share")}),
    row("run-ckpt-dir-boot-sub", [*RUN, "--ckpt-dir", "/boot/onbox-ckpt-never", *CMD], 2, "system directory"),
    row("run-durable-root", [*RUN, "--durable", "/", *CMD], 2, "--durable / is the root of the filesystem"),
    row("run-durable-usr-share", [*RUN, "--durable", "/usr/share/onbox-sweep-never", *CMD], 2,
        "--durable /usr/share/onbox-sweep-never is inside the system directory /usr"),
    row("run-durable-etc", [*RUN, "--durable", "/etc", *CMD], 2, "--durable /etc is a system directory"),
    row("run-durable-link-to-root", [*RUN, "--durable", "{tmp}/d", *CMD], 2, "--durable",
        files={"d": Link("/")}),
    row("run-env-durable-var-lib", [*RUN, *CMD], 2, "--durable", env={"ONBOX_DURABLE": "/var/lib/onbox-never"}),
    row("run-file-ckpt-dir-usr-share", [*RUN, "-f", "{tmp}/run.toml", *CMD], 2, "--ckpt-dir",
        files={"run.toml": "[run]\nckpt_dir = '/usr/share'\n"}),
    row("relaunch-record-durable-usr", ["run", "--name", "r"], 2, "--durable", run={"durable": "/usr/lib/onbox"}),
    row("sync-durable-usr-share", ["sync", "r", "--durable", "/usr/share/onbox-sweep-never"], 2,
        "inside the system directory /usr", run={}),
]


@pytest.mark.parametrize("case", ROWS, ids=[r.id for r in ROWS])
def test_bad_cli_input_is_refused_cleanly(case: Row, tmp_path):
    refused_cleanly(case, tmp_path)


# The false-positive side: values that look odd but are paths, and the places platforms keep their disks.
LEGIT = [
    ["--durable", "{tmp}/-odd-but-relative-no"],  # absolute, with a dash inside: a path
    ["--durable", "./-x"],  # the documented way to give a path that starts with a dash
    ["--durable", "remote:bucket/-x"],  # an rclone remote
    ["--ckpt-dir", "{tmp}/ck", "--durable", "{tmp}/dur"],
    ["--ckpt-dir", "/var/tmp/onbox-sweep-legit/ck"],  # FHS: temp files kept across reboots, per-user writable
    ["--ckpt-dir", "/dev/shm/onbox-sweep-legit"],  # RAM-backed scratch some trainers save to
    ["--durable", "/var/tmp/onbox-sweep-legit/dur"],
]


@pytest.mark.parametrize("args", LEGIT, ids=["dash-inside", "dot-slash-dash", "remote-dash", "tmp", "var-tmp",
                                             "dev-shm", "var-tmp-durable"])
def test_a_legit_path_value_is_still_accepted(args, tmp_path, onbox_home):
    """`onbox queue add` runs every check `onbox run` does and starts nothing: exit 0 is the path accepted."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "remote:" in argv[-1] and shutil.which("rclone") is None:
        pytest.skip("rclone is not installed here: a remote --durable needs it")
    r = onbox(onbox_home, "queue", "add", "--name", "legit", *argv, "--", "true", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr


def test_node_group_from_stdin_is_still_a_dash(tmp_path, onbox_home):
    """`--node-group -` (what onboxctl run --nodes sends) is the one value that may be a dash: it reaches the
    group reader (which refuses this empty stdin for its own reason), never the "needs a value" refusal."""
    r = subprocess.run([PY, "-m", "onbox", "run", "--name", "x", "--node-group", "-", *CMD],
                       env=env_for(onbox_home), capture_output=True, text=True, timeout=60, input="")
    assert r.returncode == 2 and "needs a value" not in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.root
def test_a_read_only_onbox_home_is_an_unfit_environment(tmp_path):
    """A read-only ONBOX_HOME is exit 3 (the environment is unfit), naming it and the fix, for every command that
    writes there; `onbox stop` of a run whose lock file it cannot create says so (it raised a traceback)."""
    with tmpfs(tmp_path / "home", size="1m") as home:
        os.makedirs(os.path.join(home, "runs", "r"))
        with open(os.path.join(home, "runs", "r", "config.json"), "w") as f:
            json.dump({"name": "r", "command": ["true"]}, f)
        with open(os.path.join(home, "runs", "r", "state.json"), "w") as f:
            json.dump({"run": "r", "state": "running", "attempt": 0, "child_pid": None, "agent_pid": None}, f)
        subprocess.run(["mount", "-o", "remount,ro", home], check=True, timeout=30)
        for argv in (["run", "--name", "x", "--", "true"], ["queue", "add", "--name", "x", "--", "true"],
                     ["stop", "r"]):
            r = onbox(home, *argv, cwd=str(tmp_path))
            assert "Traceback" not in r.stderr, r.stderr
            assert r.returncode == 3, (argv, r.stderr)
            lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("onbox: warning:")]
            assert lines[0].startswith("onbox: ") and home in lines[0] and "read-only" in lines[0], r.stderr
            assert lines[1].startswith("hint: ") and "ONBOX_HOME" in lines[1], r.stderr


QUIET = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(300)
""")


def _fill(directory):
    path = os.path.join(directory, "fill")
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return path


@pytest.mark.root
def test_stop_on_a_full_onbox_home_says_the_trainer_stopped_and_what_was_not_recorded(tmp_path):
    """The trainer stops at once; the agent cannot record it (ONBOX_HOME is full) and holds the final state. `onbox
    stop --wait` said "did not stop within N s" (exit 1): it says the trainer stopped, that the final state is not
    recorded and why (exit 3: the environment keeps it from being recorded), and the run ends `stopped` once there
    is space again."""
    with tmpfs(tmp_path / "home", size="8m") as home:
        started = Started(home)
        try:
            r = onbox(home, "run", "--name", "x", "--ckpt-dir", str(tmp_path / "ck"), "--json", "--", PY, "-c", QUIET)
            assert r.returncode == 0, r.stderr
            info = json.loads(r.stdout)
            agent, child = (info["agent_pid"], start_time(info["agent_pid"])), (info["pid"], start_time(info["pid"]))
            started.add(*agent)
            started.add(*child)
            wait_for(lambda: state(home, "x").get("state") == "running", timeout=30, what="the run's state")
            filler = _fill(home)
            # the whole --wait passes (the disk stays full): long enough for the trainer's stop on a busy machine
            stop = subprocess.Popen([PY, "-m", "onbox", "stop", "x", "--timeout", "6"], env=env_for(home),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                wait_for(lambda: not is_alive(*child), timeout=30, what="the trainer stopped by `onbox stop`")
                _out, err = stop.communicate(timeout=60)
            finally:
                if stop.poll() is None:
                    stop.kill()
                    stop.wait()
            assert "Traceback" not in err
            assert stop.returncode == 3, err
            lines = [ln for ln in err.splitlines() if not ln.startswith("onbox: warning:")]
            assert lines[0].startswith("onbox: run x: its trainer has stopped"), err
            assert "final state is not recorded" in lines[0] and "%s is full" % home in lines[0], err
            assert "did not stop" not in err
            assert lines[1].startswith("hint: free space"), err
            os.unlink(filler)
            wait_for(lambda: not is_alive(*agent), timeout=30, what="the agent's exit once there is space")
            assert state(home, "x")["state"] == "stopped"
        finally:
            started.stop()


HOSTILE = "step_2.pt\nx: stopped (attempt 0, agent alive)\x1b]0;PWNED\x07\x1b[2J"


def _hostile_run(tmp_path, home):
    """Run r with a local checkpoint, a committed one and recorded checkpoint/lease status, all named HOSTILE."""
    ck, dur = tmp_path / "ck", tmp_path / "dur"
    ck.mkdir()
    (ck / HOSTILE).write_bytes(b"x" * 10)
    committed = dur / "r" / "checkpoints" / HOSTILE
    committed.mkdir(parents=True)
    (committed / "MANIFEST.json").write_text(json.dumps({"schema": "onbox.manifest/1", "name": HOSTILE}))
    rd = home / "runs" / "r"
    rd.mkdir(parents=True)
    (rd / "config.json").write_text(json.dumps({"name": "r", "command": ["true"], "ckpt_dir": str(ck),
                                                "durable": str(dur)}))
    (rd / "state.json").write_text(json.dumps({"run": "r", "state": "failed", "attempt": 0, "restarts": 0,
                                               "agent_pid": None, "message": "ended: " + HOSTILE,
                                               "last_exit": {"classification": "error", "message": HOSTILE}}))
    (rd / "checkpoint_status.json").write_text(json.dumps({
        "latest_local": {"name": HOSTILE, "step": 2}, "latest_durable": {"name": HOSTILE, "step": 2},
        "last_sync": {"ok": False, "error": "commit of %s failed" % HOSTILE},
        "lease": {"epoch": 1, "holder": HOSTILE, "renewed_at": 1.0, "ttl": 60.0}}))


@pytest.mark.parametrize("argv", [["checkpoints", "r"], ["status", "r"], ["status"]], ids=["checkpoints", "status",
                                                                                          "status-all"])
def test_names_from_storage_and_the_trainer_cannot_forge_lines_or_drive_the_terminal(argv, tmp_path, onbox_home):
    _hostile_run(tmp_path, onbox_home)
    r = onbox(onbox_home, *argv)
    assert "Traceback" not in r.stderr and r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout, r.stdout
    assert not [ln for ln in r.stdout.splitlines() if ln.startswith("x: stopped")], r.stdout  # no forged line
    assert "step_2.pt\\x0ax: stopped" in r.stdout and "\\x1b]0;PWNED\\x07" in r.stdout, r.stdout
    j = onbox(onbox_home, *argv, "--json")
    assert j.returncode == 0, j.stderr
    assert HOSTILE in _strings(json.loads(j.stdout))  # exact in JSON


def _strings(doc):
    """Every string value in a JSON document."""
    if isinstance(doc, str):
        return {doc}
    items = doc.values() if isinstance(doc, dict) else doc if isinstance(doc, list) else []
    return set().union(*(_strings(v) for v in items)) if items else set()
