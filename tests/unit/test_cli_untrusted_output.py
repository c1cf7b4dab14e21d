"""What the agent's commands print in text mode carries names and text from outside (checkpoint names from durable
storage or the trainer's dir, a lease holder, the trainer's last words): each shows control characters as escapes,
so that none forges a line or drives the terminal, while --json keeps every byte (issue 30.11). And what `onbox
stop` says when its wait runs out is what happened (issue 30.14)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import onbox.commands.checkpoints as ckpt_cmd
import onbox.commands.runs as runs_cmd
import onbox.launch.stopping as stopping_lib
from onbox.clikit import report_error
from onbox.errors import JobFailed, UnfitError, UsageError
from onbox.queue.render import render_queue
from onbox.supervisor.rundir import RunDir

EVIL = "ck\nr: done (attempt 9, restarts 0, child -, agent alive)\x1b]0;PWNED\x07\x9b2J\r"


def _run(home, tmp_path, **state):
    rd = home / "runs" / "r"
    rd.mkdir(parents=True)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / EVIL).write_bytes(b"x")
    (rd / "config.json").write_text(json.dumps({"name": "r", "command": ["true"], "ckpt_dir": str(ck)}))
    (rd / "state.json").write_text(json.dumps(dict({"run": "r", "state": "failed", "attempt": 0, "agent_pid": None,
                                                    "message": EVIL, "warnings": [{"message": EVIL, "hint": EVIL}],
                                                    "last_exit": {"classification": EVIL, "message": EVIL}},
                                                   **state)))
    (rd / "checkpoint_status.json").write_text(json.dumps({
        "latest_local": {"name": EVIL, "step": 1}, "latest_durable": {"name": EVIL, "step": 1},
        "last_sync": {"ok": False, "error": EVIL}, "unreadable": {"name": EVIL, "problem": EVIL},
        "lease": {"epoch": 1, "holder": EVIL, "ttl": 60.0}}))
    (rd / "progress.json").write_text(json.dumps({"step": EVIL, "loss": EVIL}))


def _clean(text):
    assert not any(c in text for c in "\x1b\x07\x9b\r"), repr(text)
    assert not [ln for ln in text.splitlines() if ln.startswith("r: done")], text


@pytest.mark.parametrize("command,args", [(runs_cmd.status, []), (runs_cmd.status, ["r"]), (ckpt_cmd.checkpoints, ["r"])])
def test_text_output_shows_control_characters_as_escapes(command, args, onbox_home, tmp_path):
    _run(onbox_home, tmp_path)
    r = CliRunner().invoke(command, args)
    assert r.exit_code == 0, r.output
    _clean(r.output)


def test_status_says_every_field_that_came_from_outside_escaped(onbox_home, tmp_path):
    _run(onbox_home, tmp_path)
    out = CliRunner().invoke(runs_cmd.status, ["r"]).output
    shown = "ck\\x0ar: done (attempt 9, restarts 0, child -, agent alive)\\x1b]0;PWNED\\x07\\x9b2J\\x0d"
    for label in ("progress: step ", "lease: epoch 1 held by ", "checkpoint: newest local ", "last exit: ",
                  "warning: "):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(label))
        assert shown in line, (label, line)


@pytest.mark.parametrize("command,args", [(runs_cmd.status, ["r", "--json"]), (ckpt_cmd.checkpoints, ["r", "--json"])])
def test_json_output_keeps_the_names_exact(command, args, onbox_home, tmp_path):
    _run(onbox_home, tmp_path)
    doc = json.loads(CliRunner().invoke(command, args).output)
    text = json.dumps(doc, ensure_ascii=False)
    assert json.dumps(EVIL, ensure_ascii=False)[1:-1] in text


def test_queue_text_shows_an_entry_message_escaped():
    text = render_queue({"runner": {}, "entries": [{"id": 1, "state": "failed", "name": "q1", "command": [EVIL],
                                                    "message": EVIL}]})
    _clean(text)
    assert text.count("\n") == 4  # the head, the column line, the entry, its message


def test_an_error_message_carries_no_terminal_escape(capsys):
    assert report_error("onbox", UsageError("bad %s" % EVIL, hint=EVIL)) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b]0;PWNED" in err


# -- `onbox stop` when its wait runs out ---------------------------------------------------------------------------
@pytest.fixture
def stopping(onbox_home, monkeypatch):
    """Run r, running (its state.json says so), with a child pid and start time."""
    rd = RunDir(str(onbox_home / "runs" / "r"))
    (onbox_home / "runs" / "r").mkdir(parents=True)
    state = {"run": "r", "state": "running", "child_pid": 4242, "child_start_time": 77, "agent_pid": 4241}
    return rd, state


def _outcome(monkeypatch, rd, state, child_start, disk):
    monkeypatch.setattr("onbox.proc.ProcessSeam.start_time_of", lambda self, pid: child_start)
    monkeypatch.setattr("onbox.fsutil.space_problem", lambda path, *a, **k: disk)
    return stopping_lib.wait_ran_out(rd, state, 30.0, written=False)


def test_a_trainer_that_stopped_on_a_full_home_is_said_stopped_and_unrecorded(stopping, monkeypatch, onbox_home):
    e = _outcome(monkeypatch, *stopping, child_start=None, disk="full (0 KiB free)")
    assert isinstance(e, UnfitError)
    assert e.message.startswith("run r: its trainer has stopped (child 4242 ended), but its final state is not "
                                "recorded: ONBOX_HOME's filesystem %s is full (0 KiB free)" % onbox_home)
    assert e.hint.startswith("free space on ONBOX_HOME")


def test_on_a_read_only_home_the_fix_is_to_remount(stopping, monkeypatch):
    e = _outcome(monkeypatch, *stopping, child_start=None, disk="read-only")
    assert isinstance(e, UnfitError) and "is read-only" in e.message and "read-write" in e.hint


def test_a_trainer_that_stopped_with_the_agent_still_committing_is_said_so(stopping, monkeypatch):
    e = _outcome(monkeypatch, *stopping, child_start=None, disk=None)
    assert isinstance(e, JobFailed) and "its trainer has stopped" in e.message and "still finishing" in e.message


@pytest.mark.parametrize("disk", [None, "full (0 KiB free)"])
def test_a_trainer_still_running_did_not_stop(stopping, monkeypatch, disk):
    e = _outcome(monkeypatch, *stopping, child_start=77, disk=disk)  # the same process: still there
    assert isinstance(e, JobFailed) and e.message.startswith("run r did not stop within 30 s")
