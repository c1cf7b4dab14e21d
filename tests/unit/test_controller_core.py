"""Controller pieces without a network: generated ssh/rsync command lines (golden), the status table (golden),
the inventory, run naming, fan-out files and the teardown gate's judgement."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from controller.boxes.inventory import Box, Inventory
from controller.boxes.ssh import Ssh, SshSettings, Target, remote_command
from controller.launch.start import parse_json_tail, read_fanout
from controller.results.pull import PullsRecord, RemoteCheckpoint, newest
from controller.results.teardown import judge_run
from controller.tracker.runview import render_table, rows_from_box_status, rows_from_tracker
from onbox.errors import UsageError
from onbox.paths import default_run_name  # the one rule, shared with the agent (tests/unit/test_run_names.py)
from tests.golden import check_golden

NOW = 1_800_000_000.0


def _ssh():
    return Ssh(SshSettings(control_dir="/run/onboxctl-ssh", connect_timeout=10, alive_interval=5, alive_count=3))


def test_ssh_and_rsync_command_lines_golden():
    s = _ssh()
    full = Target(name="gpu1", host="203.0.113.7", port=2222, user="root", identity="/keys/id_ed25519",
                  options=("StrictHostKeyChecking=accept-new",))
    alias = Target(name="lambda-a", host="lambda-a")
    out = []
    out.append(s.ssh_argv(full, ["python3", ".onbox/onbox.pyz", "status", "my run; rm -rf /", "--json"]))
    out.append(s.ssh_argv(alias, script="umask 077; cat > .onbox/secrets/wandb"))
    out.append(s.master_argv(full))
    out.append(s.master_argv(alias, persist=True))  # a master that carries a tracker tunnel stays
    out.append(s.control_argv(full, "forward", "-R", "127.0.0.1:0:127.0.0.1:8787"))
    out.append(s.rsync_argv(full, ["/src/code/"], ".onbox/code/code/", upload=True,
                            extra=["--filter=:- .gitignore", "--exclude=/.git/"]))
    out.append(s.rsync_argv(alias, ["/durable/run 1/checkpoints/step_100/"], "/home/me/pulled/run 1/", upload=False,
                            extra=["--partial-dir=.onbox-partial"], io_timeout=30))
    check_golden("ssh_commands.txt", "".join(json.dumps(a) + "\n" for a in out))


def test_remote_command_quotes_every_argument():
    assert remote_command(["echo", "a b", "$HOME", "x;y", "it's"]) == "echo 'a b' '$HOME' 'x;y' 'it'\"'\"'s'"


def _beat(**kw):
    beat = {"schema": "onbox.heartbeat/1", "run": "r", "box": "b", "attempt": 0, "seq": 1, "time": NOW - 12,
            "state": "running", "progress": {"step": 1200, "loss": 1.23456, "tokens_per_s": 48213.7},
            "checkpoint": {"latest_durable": {"name": "step_001000", "step": 1000}},
            "gpus": {"available": True, "reason": None,
                     "gpus": [{"util_percent": 97.0, "memory_used_bytes": 30 << 30, "memory_total_bytes": 80 << 30},
                              {"util_percent": 93.0, "memory_used_bytes": 31 << 30, "memory_total_bytes": 80 << 30}]}}
    beat.update(kw)
    return beat


def test_status_table_golden_with_late_and_silent():
    doc = {"runs": [
        {"run": "gpt-small", "box": "gpu1", "liveness": "ok", "latest": _beat(run="gpt-small", box="gpu1")},
        {"run": "gpt-large", "box": "gpu2", "liveness": "late", "age_s": 95,
         "latest": _beat(run="gpt-large", box="gpu2", attempt=2, state="running",
                         alerts=[{"code": "loss_spike", "severity": "warning", "hint": "look at the batch",
                                  "message": "loss spiked to 9.1 at step 1190"}])},
        {"run": "json-loop", "box": "gpu4", "liveness": "ok",  # nothing committed: `none`, and the agent's word
         "latest": _beat(run="json-loop", box="gpu4", checkpoint={"latest_durable": None, "durable": "/d/json-loop"},
                         alerts=[{"code": "no_checkpoint", "severity": "warning", "hint": "until one counts ...",
                                  "message": "38 files in /ck, none a checkpoint: state_000760.txt, state_000780.txt "
                                             "and 36 more are *.txt, a name onbox ignores by default"}])},
        {"run": "sweep-3", "box": "spot7", "liveness": "silent", "age_s": 1260,
         "latest": {"run": "sweep-3", "box": "spot7", "state": "preempting", "attempt": 1, "time": NOW - 1260,
                    "progress": {"step": 50}, "gpus": {"available": False, "gpus": [], "reason": "no driver"}}},
        {"run": "curriculum", "box": "gpu3", "liveness": "ok",
         "latest": _beat(run="curriculum", box="gpu3", phase={"name": "anneal", "index": 2, "count": 3})},
    ]}
    rows = rows_from_tracker(doc, now=NOW)
    assert [r.liveness for r in rows] == ["ok", "late", "ok", "ok", "silent"]
    assert [r.phase for r in rows] == [None, None, "3/3 anneal", None, None]
    assert [r.checkpoint for r in rows] == ["step_001000"] * 3 + ["none", None]  # never the durable dir's name
    check_golden("status_table.txt", render_table(rows))


def test_status_table_golden_with_a_deadline_column_only_where_a_run_has_a_deadline():
    wall = {"at": NOW + 4 * 3600 + 600, "ask_at": NOW + 4 * 3600 + 400, "asked_at": None, "source": "kaggle",
            "left_s": 4 * 3600 + 612, "commit_estimate_s": 12.5, "grace_s": 30, "margin_s": 60}
    doc = {"runs": [
        {"run": "kaggle-run", "box": "kaggle", "liveness": "ok", "latest": _beat(run="kaggle-run", deadline=wall)},
        {"run": "slurm-soon", "box": "node1", "liveness": "ok", "latest": _beat(
            run="slurm-soon", deadline=dict(wall, at=NOW + 900, ask_at=NOW + 700, source="slurm"))},
        {"run": "slurm-asked", "box": "node2", "liveness": "ok", "latest": _beat(
            run="slurm-asked", deadline=dict(wall, at=NOW + 100, ask_at=NOW - 20, asked_at=NOW - 20))},
        {"run": "plain", "box": "gpu1", "liveness": "ok", "latest": _beat(run="plain", deadline=None)},
        {"run": "ended", "box": "gpu2", "liveness": "ended", "latest": _beat(run="ended", state="preempted",
                                                                             deadline=dict(wall, at=NOW - 5))},
    ]}
    rows = rows_from_tracker(doc, now=NOW)
    assert sorted(r.run for r in rows if r.deadline is None) == ["plain"]
    check_golden("status_table_deadline.txt", render_table(rows, now=NOW))
    # the same runs without deadlines render the table the other goldens hold: no column of dashes
    assert "DEADLINE" not in render_table([r for r in rows if r.deadline is None], now=NOW)
    box = rows_from_box_status("kaggle", {"run": "k", "state": "running", "deadline": wall}, now=NOW)
    assert "4.2h" in render_table(box, now=NOW)  # `onbox status --json` carries the same block


def test_status_rows_from_box_fallback():
    rows = rows_from_box_status("gpu1", {"runs": [{"name": "a", "state": "running", "attempt": 1,
                                                   "progress": {"step": 5, "loss": 2.5},
                                                   "phase": {"name": "warmup", "index": 0, "count": 2}}]}, now=NOW)
    assert rows[0].run == "a" and rows[0].step == 5 and rows[0].source == "ssh" and rows[0].liveness == "unknown"
    assert rows[0].phase == "1/2 warmup" and "running (phase 1/2 warmup)" in render_table(rows)
    assert "(no runs)" in render_table([])


def test_inventory_round_trip_and_alias(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path))
    inv = Inventory()
    inv.add(Box(name="gpu1", host="10.0.0.5", port=2222, user="root", profile="runpod",
                options=["StrictHostKeyChecking=accept-new"]))
    assert (tmp_path / "boxes.toml").stat().st_mode & 0o777 == 0o600
    got = Inventory().load()["gpu1"]
    assert (got.host, got.port, got.user, got.profile, got.options) == ("10.0.0.5", 2222, "root", "runpod",
                                                                        ["StrictHostKeyChecking=accept-new"])
    with pytest.raises(UsageError):
        inv.add(Box(name="gpu1", host="x"))
    alias = inv.resolve("my-alias")
    assert not alias.in_inventory and alias.target().destination == "my-alias" and alias.target().port is None
    inv.remove("gpu1")
    assert Inventory().load() == {}


def test_inventory_rejects_bad_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path))
    (tmp_path / "boxes.toml").write_text('[boxes.a]\nhost = "h"\nport = 99999\n')
    with pytest.raises(UsageError, match="port"):
        Inventory().load()
    (tmp_path / "boxes.toml").write_text('[boxes.a]\nhots = "h"\n')
    with pytest.raises(UsageError, match="unknown key"):
        Inventory().load()


def test_box_cli(tmp_path, monkeypatch):
    from controller.cli import cli

    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(cli, ["box", "add", "gpu1", "--host", "1.2.3.4", "--port", "22", "--user", "ubuntu"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["box", "ls", "--json"])
    assert json.loads(r.output)["boxes"] == [{"name": "gpu1", "host": "1.2.3.4", "port": 22, "user": "ubuntu",
                                              "python": "python3"}]
    r = CliRunner().invoke(cli, ["box", "add", "bad name", "--host", "x"], standalone_mode=False)
    assert isinstance(r.exception, UsageError)


def test_run_names_and_fanout(tmp_path):
    assert default_run_name(["python", "train.py", "--lr", "3"], now=0) == "train-19700101-000000"
    assert default_run_name(["python", "-m", "onbox.examples.charlm"], now=0) == "charlm-19700101-000000"
    f = tmp_path / "fan"
    f.write_text("# boxes\ngpu1\ngpu2 -- python train.py --seed 2\n\n")
    assert read_fanout(str(f)) == [("gpu1", []), ("gpu2", ["python", "train.py", "--seed", "2"])]
    f.write_text("gpu1 python train.py\n")
    with pytest.raises(UsageError, match="fan"):
        read_fanout(str(f))
    assert parse_json_tail('warning: x\n{"name": "r", "pid": 5}\n') == {"name": "r", "pid": 5}
    assert parse_json_tail("[" * 100_000 + "]" * 100_000) == {}  # a hostile box's answer: no document, no traceback


@pytest.mark.timeout(30)  # before issue 19 the FIFO hung the read forever
def test_a_fanout_file_is_read_bounded_and_only_when_regular(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_text("# x\n" * (2 << 20))  # 8 MiB of comments, past the 4 MiB bound
    latin1 = tmp_path / "latin1"
    latin1.write_bytes(b"gpu\xe9\n")
    for path, says in ((fifo, "it is a FIFO (named pipe), not a regular file"), ("/dev/zero", "character device"),
                       (big, "too large"), (latin1, "can't decode byte 0xe9")):
        with pytest.raises(UsageError, match="cannot read fan-out file") as e:
            read_fanout(str(path))
        assert says in e.value.message and str(path) in e.value.message


def test_a_push_record_nested_100000_deep_is_no_record_not_a_traceback():
    from controller.boxes.ssh import Result
    from controller.launch.start import remote_env

    class BoxAnswers:
        def run(self, target, argv=None, **kw):
            return Result([], 0, b"/root\n" + b"[" * 100_000 + b"]" * 100_000, b"")

    assert remote_env(BoxAnswers(), Box(name="b", host="h")) == ("/root", {})  # type: ignore[arg-type]


def test_run_cli_splits_the_command_at_double_dash(tmp_path, monkeypatch):
    from controller.cli import cli

    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path))
    r = CliRunner().invoke(cli, ["run", "gpu1"], standalone_mode=False)
    assert isinstance(r.exception, UsageError) and "after `--`" in (r.exception.hint or "")
    r = CliRunner().invoke(cli, ["run", "--", "python", "x.py"], standalone_mode=False)
    assert isinstance(r.exception, UsageError) and "no box" in r.exception.message


def test_teardown_judgement(tmp_path):
    rec = PullsRecord(str(tmp_path / "pulls.json"))
    c1 = RemoteCheckpoint(name="step_000100", manifest_sha256="aa", step=100)
    c2 = RemoteCheckpoint(name="step_000200", manifest_sha256="bb", step=200)
    assert newest([c2, c1]) is c2
    doc = {"run": "r1", "state": "preempted", "checkpoints": [c1, c2]}
    v = judge_run("b", doc, rec)
    assert v.blocking and "not pulled" in v.reason
    rec.record("b", "r1", "/d", "step_000100", {"ok": True, "manifest_sha256": "aa"})
    v = judge_run("b", doc, rec)
    assert v.blocking and "only older" in v.reason
    rec.record("b", "r1", "/d", "step_000200", {"ok": False, "manifest_sha256": "bb", "error": "hash mismatch"})
    v = judge_run("b", doc, rec)
    assert v.blocking and "verification failed" in v.reason
    rec.record("b", "r1", "/d", "step_000200", {"ok": True, "manifest_sha256": "OTHER"})
    assert "re-committed" in judge_run("b", doc, rec).reason
    rec.record("b", "r1", "/d", "step_000200", {"ok": True, "manifest_sha256": "bb", "verified_at": 1.0})
    v = judge_run("b", doc, rec)
    assert not v.blocking and v.verified
    remote = {"run": "r3", "state": "running", "durable": "s3remote:bucket/x", "checkpoints": []}
    assert not judge_run("b", remote, rec).blocking
    empty = {"run": "r2", "state": "failed", "checkpoints": []}
    assert judge_run("b", empty, rec).blocking
    assert not judge_run("b", empty, rec, abandoned=["r2"]).blocking
    assert oct(os.stat(rec.path).st_mode & 0o777) == "0o600"


def test_gate_report_golden():
    from controller.boxes.profiles import MeterStop
    from controller.results.teardown import GateReport, RunVerdict, render

    report = GateReport(
        box="gpu1",
        runs=[RunVerdict("gpt-small", "done", "step_002000", 2000, True, True, False,
                         "newest checkpoint pulled and verified"),
              RunVerdict("gpt-large", "running", "step_000500", 500, False, False, True,
                         "newest checkpoint step_000500 not pulled")],
        meter=MeterStop(profile="runpod", verb="terminate", irreversible=True, verified="2026-06",
                        source="https://docs.runpod.io/pods/manage-pods", command=None,
                        note="only a Network Volume survives"),
        allowed=False, warnings=["run gpt-large is still running: tearing the box down kills it"])
    check_golden("gate_report.txt", render(report))


def test_meter_stop_from_the_shipped_profiles():
    from controller.boxes.profiles import known_profiles, meter_stop

    if "runpod" not in known_profiles():
        pytest.skip("profiles/ not in this checkout yet")
    m = meter_stop("runpod")
    assert m.verb == "terminate" and m.irreversible is True and m.verified
    assert meter_stop("no-such-profile").verb.startswith("unknown")


def test_a_refused_user_profile_is_said_never_replaced_by_the_built_in_one(tmp_path, monkeypatch):
    from controller.boxes.profiles import meter_stop

    monkeypatch.setenv("ONBOX_HOME", str(tmp_path))
    mine = tmp_path / "profiles" / "runpod.toml"
    mine.parent.mkdir()
    mine.write_text('[billing]\nmeter_stop = "stop"\n')
    assert meter_stop("runpod").verb == "stop"  # the user's override is what the gate shows
    for make, says in ((lambda: mine.write_text("[billing\n"), "is not valid TOML"),
                       (lambda: os.mkfifo(mine), "FIFO"), (lambda: os.symlink("/dev/zero", mine), "character device"),
                       (lambda: mine.write_text("# x\n" * (2 << 20)), "too large")):
        if os.path.lexists(mine):
            mine.unlink()
        make()
        with pytest.raises(UsageError) as e:
            meter_stop("runpod")
        assert str(mine) in e.value.message and says in e.value.message
    mine.unlink()
    assert meter_stop("runpod").verb == "terminate"  # no user file of that name: the built-in one
    assert meter_stop("no-such-profile").verb.startswith("unknown")


def test_rsync_progress_lines_parse():
    from controller.results.pull import PROGRESS_RE

    m = PROGRESS_RE.match("    111,443,968  20%  106.28MB/s    0:00:03")
    assert m and m.group(2) == "20" and m.group(3) == "106.28MB/s"
    assert PROGRESS_RE.match("receiving incremental file list") is None


def test_ssh_settings_from_env():
    from controller.boxes.ssh import settings_from_env

    s = settings_from_env({"ONBOX_SSH_CONNECT_TIMEOUT": "3", "ONBOX_SSH_MULTIPLEX": "0"}, connect_timeout=None)
    assert s.connect_timeout == 3 and not s.multiplex
    assert settings_from_env({}, connect_timeout=7).connect_timeout == 7
    with pytest.raises(UsageError):
        settings_from_env({"ONBOX_SSH_ALIVE_COUNT": "many"})
    no_mux = Ssh(s).ssh_argv(Target(name="b", host="h"), ["true"])
    assert not any(a.startswith("Control") for a in no_mux)


def test_json_output_is_strict_json_even_for_a_diverged_run(capsys):
    """`onboxctl status --json` of a run whose loss is NaN or Infinity: what any JSON parser (jq) reads."""
    from onbox.clikit import echo_json

    rows = rows_from_tracker({"runs": [{"run": "div", "box": "b", "liveness": "ok",
                                         "latest": _beat(progress={"step": 3, "loss": "NaN", "tokens_per_s": "Infinity"})}]},
                             now=NOW)
    assert rows[0].loss != rows[0].loss  # a float NaN inside the row
    echo_json({"runs": [r.to_dict() for r in rows], "neg": -float("inf")})
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail("bare %s in the output" % c))
    assert out["runs"][0]["loss"] == "NaN" and out["runs"][0]["tokens_per_s"] == "Infinity"
    assert out["neg"] == "-Infinity"
