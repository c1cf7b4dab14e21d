"""checkpoints_index.json (onbox.checkpoints_index/2): every committed checkpoint with its commit time, step,
metrics and verification state; an older agent's /1 index read and upgraded; re-checks by a restore and by
`onbox verify <durable>/<run>` recorded (passed and failed), under the run's commit lock held by another real
process; quarantine keeping the whole entry. Real torch files, the real hook, a mounted-path durable target."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from onbox import fsutil
from onbox.checkpoints import INDEX_SCHEMA, INDEX_SCHEMA_V1
from onbox.checkpoints.durable.index import MAX_CHECKS
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.recheck import record_verification
from onbox.checkpoints.verify import verify_path
from onbox.cli import cli
from onbox.clikit import run_cli
from onbox.paths import COMMIT_LOCK_FILE
from tests.checkpoint_files import flip_byte, write_torch_zip
from tests.fakes.run_context import run_context
from tests.polling import wait_for


def ctx_in_home(onbox_home, tmp_path, ckpt="ckpt"):
    """A run context whose run dir is where `onbox` looks for run r1 ($ONBOX_HOME/runs/r1)."""
    return run_context(tmp_path, run_dir=onbox_home / "runs" / "r1", ckpt_dir=tmp_path / ckpt)


def commit_steps(ctx, steps):
    hook = CheckpointCommitHook(ctx)
    for step in steps:
        fsutil.atomic_write_json(os.path.join(ctx.run_dir, "progress.json"),
                                 {"step": step, "loss": 1.0 / step, "eval_loss": 2.0 / step, "time": ctx.clock.time()})
        write_torch_zip(os.path.join(ctx.ckpt_dir, "step_%05d.pt" % step), payload=bytes([step]) * 4096)
        hook.scheduler.last_sync = float("-inf")
        hook.periodic()
        hook.join_worker(None)
        ctx.clock.advance(2)
    return hook


def index_of(tmp_path):
    return fsutil.read_json(str(tmp_path / "durable" / "r1" / "checkpoints_index.json"))


def entry(tmp_path, name):
    return next(e for e in index_of(tmp_path)["checkpoints"] if e["name"] == name)


@pytest.fixture
def onbox_cli(capsys):
    def go(*args):
        with pytest.raises(SystemExit) as e:
            run_cli(cli, "onbox", list(args))
        out = capsys.readouterr()
        return e.value.code, out.out, out.err
    return go


def test_each_committed_checkpoint_has_time_step_metrics_and_its_verification_at_commit(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    doc = index_of(tmp_path)
    assert doc["schema"] == INDEX_SCHEMA == "onbox.checkpoints_index/2" and doc["run"] == "r1"
    e = doc["checkpoints"][1]
    assert (e["name"], e["step"], e["verified"]) == ("step_00020.pt", 20, True)
    assert e["committed_at"].endswith("Z") and isinstance(e["created"], float)
    assert (e["metrics"]["step"], e["metrics"]["loss"], e["metrics"]["eval_loss"]) == (20, 1.0 / 20, 2.0 / 20)
    v = e["verification"]
    assert v["state"] == "verified" and v["checks"] == []
    assert v["committed"]["digest"] == e["digest"] and v["committed"]["hash"] == "sha256"
    assert "sha256" in v["committed"]["checked"]


def test_an_older_agents_v1_index_is_read_and_upgraded_keeping_every_v1_field(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10])
    path = tmp_path / "durable" / "r1" / "checkpoints_index.json"
    doc = fsutil.read_json(str(path))
    old = {k: v for k, v in doc["checkpoints"][0].items() if k not in ("verification", "committed_at")}
    fsutil.atomic_write_json(str(path), dict(doc, schema=INDEX_SCHEMA_V1, checkpoints=[old]))  # as /1 wrote it
    commit_steps(ctx, [20])
    doc = fsutil.read_json(str(path))
    assert doc["schema"] == INDEX_SCHEMA and [e["name"] for e in doc["checkpoints"]] == ["step_00010.pt",
                                                                                      "step_00020.pt"]
    first = doc["checkpoints"][0]
    assert {k: first[k] for k in old} == old  # a /1 reader still finds what it read
    assert first["verification"]["state"] == "verified" and first["verification"]["checks"] == []
    assert first["committed_at"] and first["verification"]["committed"]["digest"] == first["digest"]


def test_onbox_verify_of_the_run_dir_records_passed_and_failed_checks(onbox_home, tmp_path, onbox_cli):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    run_root = tmp_path / "durable" / "r1"
    rc, out, err = onbox_cli("verify", str(run_root))
    assert rc == 0, err
    assert "recorded in checkpoints_index.json: step_00010.pt, step_00020.pt" in out
    [check] = entry(tmp_path, "step_00010.pt")["verification"]["checks"]
    assert (check["by"], check["result"], check["problems"]) == ("verify", "passed", [])
    assert {"size", "sha256", "format"} <= set(check["checked"]) and check["time"].endswith("Z")
    # a flipped bit on durable storage: the next verify fails, says so, and the index records it
    flip_byte(str(run_root / "checkpoints" / "step_00020.pt" / "step_00020.pt"), 300)
    rc, out, err = onbox_cli("verify", str(run_root), "--json")
    assert rc == 1
    assert json.loads(out)["index_recorded"] == ["step_00010.pt", "step_00020.pt"]
    bad = entry(tmp_path, "step_00020.pt")
    assert bad["verified"] is False and bad["verification"]["state"] == "failed"
    last = bad["verification"]["checks"][-1]
    assert last["result"] == "failed" and "sha256 mismatch" in last["problems"][0]
    assert entry(tmp_path, "step_00010.pt")["verified"] is True
    # one committed checkpoint given directly is recorded too; the list keeps the newest MAX_CHECKS
    for _ in range(MAX_CHECKS + 1):
        onbox_cli("verify", str(run_root / "checkpoints" / "step_00010.pt"))
    assert len(entry(tmp_path, "step_00010.pt")["verification"]["checks"]) == MAX_CHECKS
    # a file, or a copy without an index (pulled home), is verified and nothing is recorded
    rc, out, _ = onbox_cli("verify", str(run_root / "checkpoints" / "step_00010.pt" / "step_00010.pt"))
    assert rc == 0 and "recorded" not in out


def test_a_check_of_what_was_since_recommitted_under_the_name_is_not_recorded(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10])
    rows = verify_path(str(tmp_path / "durable" / "r1")).checkpoints
    rows = [dict(r, digest="0" * 64) for r in rows]  # what was checked is not what the index lists now
    assert record_verification(str(tmp_path / "durable" / "r1"), rows, 1.0) == ([], None)
    assert entry(tmp_path, "step_00010.pt")["verification"]["checks"] == []


def test_a_recheck_is_recorded_only_under_a_lease_this_box_holds_on_that_target(onbox_home, tmp_path):
    """Issue 30.1: recording a re-check rewrites the index, a write like any other. Where another box holds the
    run's lease, the verdict stands and the record is skipped, said; the holder's own box records it."""
    from onbox.checkpoints.leases.fencing import RunLease
    from onbox.clock import FakeClock

    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10])
    run_root = str(tmp_path / "durable" / "r1")
    target = LocalPathTarget(str(tmp_path / "durable"), "r1")
    other = RunLease.take(target, "r1", 30.0, False, FakeClock(), lambda: [], 1.0, host="gpu9", box="gpu9-1234abcd",
                          pid=4242, start_time=1, alive=lambda p, s: True)
    rows = verify_path(run_root).checkpoints
    recorded, warning = record_verification(run_root, rows, 5.0)
    assert recorded == [] and "not recorded in %s" % os.path.join(run_root, "checkpoints_index.json") in warning
    assert "fenced: %s (lease epoch 1) holds run r1" % other.holder in warning
    assert entry(tmp_path, "step_00010.pt")["verification"]["checks"] == []
    # the holder's box: its agent recorded the lease in checkpoint_status.json
    with open(os.path.join(ctx.run_dir, "checkpoint_status.json"), "w") as f:
        json.dump({"lease": {"epoch": other.epoch, "holder": other.holder, "durable": other.store.url}}, f)
    assert record_verification(run_root, rows, 6.0) == (["step_00010.pt"], None)


HOLD_LOCK = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()   # hold until the test says
"""


def test_recording_waits_for_the_commit_lock_another_process_holds(onbox_home, tmp_path):
    """The agent's committer holds <run_dir>/checkpoints.lock during a commit: `onbox verify` must not rewrite
    the index under it. A real process holds the real flock here."""
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10])
    run_root = str(tmp_path / "durable" / "r1")
    rows = verify_path(run_root).checkpoints
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, os.path.join(ctx.run_dir, COMMIT_LOCK_FILE)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        recorded, warning = record_verification(run_root, rows, 5.0, lock_timeout=0.3)
        assert recorded == [] and "commit lock stayed busy" in warning
        assert entry(tmp_path, "step_00010.pt")["verification"]["checks"] == []  # untouched while held
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=10) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)
    assert record_verification(run_root, rows, 6.0, lock_timeout=30) == (["step_00010.pt"], None)
    assert entry(tmp_path, "step_00010.pt")["verification"]["checks"][0]["at"] == 6.0


def test_a_restore_records_the_durable_copies_it_checked_passed_or_failed(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    run_root = tmp_path / "durable" / "r1"
    flip_byte(str(run_root / "checkpoints" / "step_00020.pt" / "step_00020.pt"), 300)
    box2 = ctx_in_home(onbox_home, tmp_path, ckpt="ckpt-replacement")  # an empty checkpoint dir: a new box
    hook = CheckpointCommitHook(box2)
    assert hook.restore().endswith("step_00010.pt")  # the corrupted newest is rejected, the older one used
    # it can never be restored: quarantined (moved whole, never deleted) with the failed check on its entry
    [bad] = [q for q in index_of(tmp_path)["quarantined"] if q["name"] == "step_00020.pt"]
    good = entry(tmp_path, "step_00010.pt")
    assert [e["name"] for e in index_of(tmp_path)["checkpoints"]] == ["step_00010.pt"]
    assert (run_root / "quarantine").is_dir() and not (run_root / "checkpoints" / "step_00020.pt").exists()
    assert bad["verified"] is False and bad["verification"]["checks"][-1]["by"] == "restore"
    assert "mismatch" in bad["verification"]["checks"][-1]["problems"][0]
    assert good["verified"] is True and good["verification"]["checks"][-1]["result"] == "passed"
    # the same box again: the local copy matches, nothing was fetched, so nothing new is recorded
    assert hook.restore().endswith("step_00010.pt")
    assert len(entry(tmp_path, "step_00010.pt")["verification"]["checks"]) == 1


def test_quarantine_keeps_the_whole_entry_and_retention_keeps_the_checks(onbox_home, tmp_path, onbox_cli):
    ctx = ctx_in_home(onbox_home, tmp_path)
    fsutil.atomic_write_json(os.path.join(ctx.run_dir, "state.json"), {"started_at": 0.0})
    hook = commit_steps(ctx, [10, 20, 30])
    assert onbox_cli("verify", str(tmp_path / "durable" / "r1"))[0] == 0
    assert hook.restore().endswith("step_00030.pt")
    assert hook.after_failure(1.0) is True  # crashed right after resuming: quarantined
    doc = index_of(tmp_path)
    [q] = doc["quarantined"]
    assert (q["name"], q["step"], q["metrics"]["step"]) == ("step_00030.pt", 30, 30)
    assert q["verification"]["checks"][0]["by"] == "verify" and "moved_to" in q and "failed after" in q["reason"]
    assert [e["name"] for e in doc["checkpoints"]] == ["step_00010.pt", "step_00020.pt"]
    # a later commit and its retention (keep_last 3) leave the recorded checks of the others in place
    commit_steps(ctx, [40, 50])
    doc = index_of(tmp_path)
    assert [e["name"] for e in doc["checkpoints"]] == ["step_00020.pt", "step_00040.pt", "step_00050.pt"]
    assert doc["checkpoints"][0]["verification"]["checks"][0]["result"] == "passed"
    assert doc["quarantined"][0]["name"] == "step_00030.pt"
    wait_for(lambda: not os.path.exists(str(tmp_path / "durable" / "r1" / "checkpoints" / "step_00010.pt")),
             timeout=5, what="the retired checkpoint's files gone")
