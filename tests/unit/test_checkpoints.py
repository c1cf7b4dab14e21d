"""Checkpoint detection, format checks, the local-path committer, retention, verify, restore and the hook, driven
through the clock seam (FakeClock) on real files in tmp dirs."""
from __future__ import annotations

import json
import os

import pytest

from onbox import fsutil
from onbox.checkpoints import MANIFEST, DurableFull, SyncFailed, formats
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.durable.retention import select_keep
from onbox.checkpoints.durable.targets import make_target
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import durable_name, scan
from onbox.checkpoints.verify import NO_MANIFEST, verify_path
from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.paths import CHECKPOINT_STATUS_FILE
from onbox.subsystems import make_hooks
from onbox.supervisor.hooks import RunContext
from tests.checkpoint_files import (
    complete_cands,
    flip_byte,
    safetensors_bytes,
    torch_zip_bytes,
    truncate,
    write_safetensors,
    write_torch_zip,
)
from tests.fakes.recorders import EventRecorder
from tests.fakes.run_context import run_context


# -- formats ----------------------------------------------------------------------------------------------------
def test_torch_zip_checks(tmp_path):
    p = write_torch_zip(str(tmp_path / "a.pt"))
    assert formats.check_file(p, full=True) == formats.FormatResult("torch-zip", None)
    flip_byte(p, 200)  # inside the first data member
    res = formats.check_file(p, full=True)
    assert res.kind == "torch-zip" and "archive/data/0" in res.problem and "CRC" in res.problem
    assert formats.check_file(p, full=False).ok  # structure is fine; only the full check reads the data
    q = write_torch_zip(str(tmp_path / "b.pt"))
    truncate(q, os.path.getsize(q) - 10)
    assert "central directory" in formats.check_file(q).problem


def test_safetensors_checks(tmp_path):
    p = write_safetensors(str(tmp_path / "m.safetensors"))
    assert formats.check_file(p).ok
    truncate(p, os.path.getsize(p) - 4)
    assert "buffer" in formats.check_file(p).problem
    bad = tmp_path / "h.safetensors"
    data = safetensors_bytes()
    bad.write_bytes(data[:8] + b"[" + data[9:])
    assert "JSON" in formats.check_file(str(bad)).problem
    huge = tmp_path / "x.safetensors"
    huge.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    assert "does not fit" in formats.check_file(str(huge)).problem


# -- detection ------------------------------------------------------------------------------------------------
def test_detect_kinds_markers_and_steps(tmp_path):
    d = tmp_path / "ck"
    write_torch_zip(str(d / "ckpt.pt"))
    write_safetensors(str(d / "checkpoint-500" / "model.safetensors"))
    (d / "checkpoint-500" / "trainer_state.json").write_text("{}")
    write_torch_zip(str(d / "tmp-checkpoint-600" / "pytorch_model.bin"))  # HF writes here, then renames
    write_torch_zip(str(d / "step_1000.pt.tmp"))
    write_torch_zip(str(d / "dcp" / "__0_0.distcp"))
    (d / "dcp" / ".metadata").write_bytes(b"x")
    (d / "notes.txt").write_text("not a checkpoint")
    names = {c.name: c for c in scan(str(d))}
    assert set(names) == {"ckpt.pt", "checkpoint-500", "dcp"}
    assert names["checkpoint-500"].step == 500 and names["ckpt.pt"].step is None
    assert not names["dcp"].marked and not names["ckpt.pt"].marked
    judged = {c.name: c for c in CompletionTracker(30.0).update(list(names.values()), 0.0, 0.0)}
    assert (judged["dcp"].format, judged["dcp"].complete_by) == ("dcp", "format")  # .metadata is written last
    (d / "ckpt.pt.done").write_text("")
    assert {c.name: c for c in scan(str(d))}["ckpt.pt"].marked


def by_name(cands):
    named = {c.name: c for c in cands}
    return named["ckpt.pt"], named["run7"]


def test_quiescence_settle_and_torn_files(tmp_path):
    clock = FakeClock()
    d = tmp_path / "ck"
    p = write_torch_zip(str(d / "ckpt.pt"))
    (d / "run7").mkdir()
    (d / "run7" / "weights.raw").write_bytes(b"\x17RAW" + b"\x00" * 100)  # no format rule: quiescence decides
    tr = CompletionTracker(settle_seconds=3.0)
    t0 = os.stat(p).st_mtime
    ck, rd = by_name(tr.update(scan(str(d)), clock.monotonic(), clock.time(), {"step": 42, "loss": 1.5, "time": t0 - 1}))
    assert (ck.name, ck.complete, ck.complete_by) == ("ckpt.pt", True, "format")  # a whole zip needs no quiet
    assert not rd.complete and "still changing" in rd.reason
    assert (ck.step, ck.step_source) == (42, "progress before the file's mtime")
    clock.advance(2.0)
    # the trainer reports step 50, saves (rewrites in place), and is at step 77 by the time onbox looks
    os.utime(p, (t0 + 5, t0 + 5))
    tr.update(scan(str(d)), clock.monotonic(), clock.time(), {"step": 50, "time": t0 + 4})
    write_torch_zip(p, payload=b"\x02" * 5000)
    os.utime(p, (t0 + 10, t0 + 10))
    (d / "run7" / "weights.raw").write_bytes(b"\x17RAW" + b"\x01" * 100)  # the settle interval starts again
    ck, rd = by_name(tr.update(scan(str(d)), clock.monotonic(), clock.time(), {"step": 77, "time": t0 + 11}))
    assert ck.complete and ck.step == 50 and not rd.complete  # the last step reported before it was written
    clock.advance(3.0)
    ck, rd = by_name(tr.update(scan(str(d)), clock.monotonic(), clock.time(), {"step": 77, "time": t0 + 11}))
    assert rd.complete and rd.complete_by == "quiescent"
    assert durable_name(ck) == "ckpt.pt.step-50"
    truncate(p, 100)  # a torn file, however quiet, is never complete
    [c] = [c for c in tr.update(scan(str(d)), clock.monotonic(), clock.time()) if c.name == "ckpt.pt"]
    assert not c.complete and c.reason.startswith("still being written")
    clock.advance(10.0)
    [c] = [c for c in tr.update(scan(str(d)), clock.monotonic(), clock.time()) if c.name == "ckpt.pt"]
    assert not c.complete and c.reason.startswith("torn: ckpt.pt: torch zip truncated")


# -- committing -------------------------------------------------------------------------------------------------
def test_commit_manifest_index_and_idempotence(tmp_path):
    d = tmp_path / "ck"
    write_torch_zip(str(d / "checkpoint-100" / "model.pt"))
    write_safetensors(str(d / "checkpoint-100" / "sub" / "opt.safetensors"))
    emit = EventRecorder()
    target = LocalPathTarget(str(tmp_path / "dur"), "r1")
    com = CheckpointCommitter(target, "r1", FakeClock(), emit)
    [cand] = complete_cands(str(d), progress={"step": 100, "loss": 2.0})
    r = com.commit(cand)
    assert r.status == "committed" and r.name == "checkpoint-100"
    cdir = tmp_path / "dur" / "r1" / "checkpoints" / "checkpoint-100"
    man = json.loads((cdir / MANIFEST).read_text())
    assert man["hash"] == "sha256" and {f["path"] for f in man["files"]} == {"model.pt", "sub/opt.safetensors"}
    assert man["metrics"]["loss"] == 2.0 and man["step"] == 100
    index = json.loads((tmp_path / "dur" / "r1" / "checkpoints_index.json").read_text())
    assert [e["name"] for e in index["checkpoints"]] == ["checkpoint-100"]
    assert verify_path(str(cdir)).ok
    assert com.commit(cand).status == "already"
    assert not [n for n in os.listdir(cdir.parent) if n.startswith(".")]


def test_same_name_new_content_gets_new_durable_name(tmp_path):
    d = tmp_path / "ck"
    p = write_torch_zip(str(d / "step_5.pt"))
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), EventRecorder())
    assert com.commit(complete_cands(str(d))[0]).name == "step_5.pt"
    os.utime(p, ns=(1, 1))  # same bytes, new mtime (e.g. restored): recognised by hash, not re-committed
    assert com.commit(complete_cands(str(d))[0]).status == "already"
    write_torch_zip(p, payload=b"\x07" * 4096)
    r = com.commit(complete_cands(str(d))[0])
    assert r.status == "committed" and r.name == "step_5.pt.r2"


def test_retention_rules():
    e = [{"name": "c%d" % s, "step": s, "metrics": {"eval_loss": 10 - s if s != 3 else 0.5}, "verified": True}
         for s in range(1, 9)]
    assert select_keep(e, keep_last=2) == {"c7", "c8"}
    assert select_keep(e, keep_last=1, best_metric="eval_loss", best_mode="min") == {"c8", "c3"}
    assert select_keep(e, keep_last=0, every_steps=4) == {"c4", "c8"}
    e[-1]["verified"] = False
    assert select_keep(e, keep_last=0) == {"c7"}  # the newest VERIFIED one is never dropped


def test_commit_applies_retention(tmp_path):
    d = tmp_path / "ck"
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), EventRecorder())
    for s in (100, 200, 300, 400):
        write_torch_zip(str(d / ("step_%d.pt" % s)))
        newest = complete_cands(str(d))[-1]
        com.commit(newest)
        com.apply_retention(keep_last=2, every_steps=200)
    assert [e["name"] for e in com.committed()] == ["step_200.pt", "step_300.pt", "step_400.pt"]
    assert sorted(os.listdir(tmp_path / "dur" / "r1" / "checkpoints")) == ["step_200.pt", "step_300.pt", "step_400.pt"]


def test_preflight_refuses_when_target_reports_too_little(tmp_path):
    d = tmp_path / "ck"
    write_torch_zip(str(d / "step_1.pt"))

    class Tiny(LocalPathTarget):
        def free_space(self):
            return fsutil.FreeSpace(path=self.ckpts, free_bytes=10**9, total_bytes=10**10, free_inodes=3,
                                    total_inodes=1000)

    emit = EventRecorder()
    com = CheckpointCommitter(Tiny(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), emit)
    with pytest.raises(DurableFull) as ei:
        com.commit(complete_cands(str(d))[0])
    assert "inodes" in str(ei.value) and emit.of("durable_full")[0]["free_inodes"] == 3
    assert not (tmp_path / "dur" / "r1" / "checkpoints" / "step_1.pt").exists()


def test_unwritable_durable_fails_loudly(tmp_path):
    d = tmp_path / "ck"
    write_torch_zip(str(d / "step_1.pt"))
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    com = CheckpointCommitter(LocalPathTarget(str(blocker), "r1"), "r1", FakeClock(), EventRecorder())
    with pytest.raises(SyncFailed):
        com.commit(complete_cands(str(d))[0])


# -- verify ---------------------------------------------------------------------------------------------------------
def test_verify_committed_catches_flip_and_truncation(tmp_path):
    d = tmp_path / "ck"
    write_torch_zip(str(d / "checkpoint-1" / "a.pt"))
    (d / "checkpoint-1" / "cfg.json").write_text('{"x": 1}')
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), EventRecorder())
    com.commit(complete_cands(str(d))[0])
    cdir = tmp_path / "dur" / "r1" / "checkpoints" / "checkpoint-1"
    flip_byte(str(cdir / "cfg.json"), 2)
    rep = verify_path(str(cdir))
    assert not rep.ok and rep.problems == ["cfg.json: sha256 mismatch (content corrupted)"]
    flip_byte(str(cdir / "cfg.json"), 2)
    truncate(str(cdir / "a.pt"), 50)
    rep = verify_path(str(cdir))
    assert len(rep.problems) == 1 and rep.problems[0].startswith("a.pt: size 50")


# -- the hook -------------------------------------------------------------------------------------------------------
def test_make_hooks_uses_the_commit_hook(tmp_path):
    assert isinstance(make_hooks(run_context(tmp_path)).checkpoints, CheckpointCommitHook)


def test_hook_periodic_commits_a_whole_zip_at_once_and_writes_status(tmp_path):
    ctx = run_context(tmp_path)
    fsutil.atomic_write_json(os.path.join(ctx.run_dir, "progress.json"), {"step": 7, "loss": 3.0, "time": 0.0})
    with open(os.path.join(ctx.run_dir, "output.log"), "w") as f:
        f.write("iter 7: loss 3.0\n")
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "ckpt.pt"))
    hook.periodic()  # a whole torch zip needs no quiet period: committed at the first look
    hook.join_worker(None)
    [ev] = ctx.emit.of("checkpoint_committed")
    assert ev["checkpoint"] == "ckpt.pt.step-7"
    st = fsutil.read_json(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE))
    assert st["latest_local"]["name"] == "ckpt.pt" and st["latest_durable"]["name"] == "ckpt.pt.step-7"
    assert st["verified"] is True and st["last_sync"]["ok"] is True
    with open(tmp_path / "durable" / "r1" / "logs" / hook.box_logs / "output.log") as f:
        assert f.read() == "iter 7: loss 3.0\n"  # the log travels with the checkpoints
    ctx.clock.advance(10)
    hook.periodic()
    hook.join_worker(None)
    assert len(ctx.emit.of("checkpoint_committed")) == 1  # unchanged: nothing new to commit


def test_each_status_write_tells_the_supervisor_that_its_summary_is_due(tmp_path):
    """training_status.md shows checkpoint_status.json: each rewrite calls RunContext.summary_due (from the commit
    thread too), instead of the loop polling the file's mtime; a write the disk refused calls nothing."""
    ctx = run_context(tmp_path)
    seen = []
    ctx.summary_due = lambda: seen.append(fsutil.read_json(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE)))
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_3.pt"))
    hook.periodic()
    hook.join_worker(None)
    assert seen[0]["latest_local"]["name"] == "step_3.pt" and seen[0]["last_sync"] is None  # the scan: no event
    assert seen[-1]["last_sync"]["ok"] is True  # the commit thread's write
    os.unlink(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE))
    os.mkdir(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE))  # no file can be written there
    calls = len(seen)
    hook.status_file.update(warning="x")
    assert len(seen) == calls and ctx.emit.of("checkpoint_status_unwritable")


def test_hook_failure_is_recorded_not_raised(tmp_path):
    ctx = run_context(tmp_path, settle_seconds=0.0)
    (tmp_path / "durable").write_text("a file where the durable dir should be")
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_3.pt"))
    hook.periodic()
    hook.join_worker(None)
    assert ctx.emit.of("sync_failed")
    st = fsutil.read_json(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE))
    assert st["last_sync"]["ok"] is False and st["last_sync"]["error"]
    assert "synced" not in json.dumps(ctx.emit.events)  # U33


def test_final_respects_deadline(tmp_path):
    ctx = run_context(tmp_path, settle_seconds=0.0)
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_9.pt"), payload=b"\x00" * (4 << 20))
    hook.throughput = 1024.0  # measured: 1 KiB/s, so 8 MiB cannot finish in 10 s
    assert hook.final(ctx.clock.monotonic() + 10.0) is None
    [skip] = ctx.emit.of("final_sync_skipped")
    assert skip["checkpoint"] == "step_9.pt" and skip["estimate_s"] > skip["left_s"]
    assert ctx.emit.of("final_sync_none")
    hook.throughput = 1e9
    out = hook.final(ctx.clock.monotonic() + 10.0)
    assert out is not None and out["name"] == "step_9.pt" and out["status"] == "committed"


def test_restore_onto_empty_dir_and_fallback_on_corruption(tmp_path):
    ctx = run_context(tmp_path, settle_seconds=0.0)
    hook = CheckpointCommitHook(ctx)
    for s in (1, 2):
        write_torch_zip(os.path.join(ctx.ckpt_dir, "checkpoint-%d" % s, "model.pt"), payload=bytes([s]) * 4096)
        hook.scheduler.last_sync = float("-inf")
        hook.periodic()
        hook.join_worker(None)
        ctx.clock.advance(2)
    assert len(ctx.emit.of("checkpoint_committed")) == 2
    # a replacement box: empty checkpoint dir
    fresh = run_context(tmp_path / "box2", settle_seconds=0.0, durable=str(tmp_path / "durable"))
    path = CheckpointCommitHook(fresh).restore()
    assert path == os.path.join(fresh.ckpt_dir, "checkpoint-2")
    rep = verify_path(path)  # a local copy has no manifest (not a committed checkpoint): its files check out
    assert [r["ok"] for r in rep.files] == [True] and rep.problems == ["checkpoint-2: " + NO_MANIFEST]
    assert fresh.emit.of("checkpoint_restored")[0]["checkpoint"] == "checkpoint-2"
    # corrupt the newest on durable storage: the next fresh box falls back to checkpoint-1 and says so
    flip_byte(str(tmp_path / "durable" / "r1" / "checkpoints" / "checkpoint-2" / "model.pt"), 300)
    box3 = run_context(tmp_path / "box3", settle_seconds=0.0, durable=str(tmp_path / "durable"))
    h3 = CheckpointCommitHook(box3)
    assert h3.restore() == os.path.join(box3.ckpt_dir, "checkpoint-1")
    assert box3.emit.of("restore_verify_failed")[0]["checkpoint"] == "checkpoint-2"
    assert h3.status["restore_rejected"][0]["name"] == "checkpoint-2"
    assert not os.path.exists(os.path.join(box3.ckpt_dir, "checkpoint-2"))


def test_restore_without_durable_returns_newest_local(tmp_path):
    ctx = run_context(tmp_path, durable=None, settle_seconds=0.0)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_10.pt"))
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_20.pt"))
    assert CheckpointCommitHook(ctx).restore() == os.path.join(ctx.ckpt_dir, "step_20.pt")
    assert CheckpointCommitHook(run_context(tmp_path / "e", durable=None)).restore() is None


def test_restore_waits_for_the_commit_in_flight_then_resumes_from_what_it_committed(tmp_path):
    """A restart after a crash: the periodic commit the crashed attempt left running finishes first (so the
    durable side is consistent and the index current), then the next attempt resumes from the newest."""
    import threading

    ctx = run_context(tmp_path, settle_seconds=0.0, final_sync_timeout=30.0)
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_5.pt"))
    cand = [c for c in hook.scan_now() if c.complete][-1]
    started = threading.Event()

    def slow_commit():
        started.set()
        threading.Event().wait(0.3)  # the commit is still copying when the restart comes
        hook.commit_one(cand)

    hook.scheduler.worker = threading.Thread(target=slow_commit, daemon=True)
    hook.scheduler.worker.start()
    started.wait(5)
    assert hook.restore() == os.path.join(ctx.ckpt_dir, "step_5.pt")
    assert not hook.scheduler.worker.is_alive()  # restore() returned only after the commit in flight
    assert [e["checkpoint"] for e in ctx.emit.of("checkpoint_committed")] == ["step_5.pt"]
    assert ctx.emit.of("restore_durable_skipped") == []


def test_restore_does_not_wait_forever_for_a_hung_commit(tmp_path):
    import threading

    ctx = run_context(tmp_path, settle_seconds=0.0, final_sync_timeout=0.05)
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_5.pt"))
    release = threading.Event()
    hook.scheduler.worker = threading.Thread(target=release.wait, daemon=True)  # a commit hung on a dead mount
    hook.scheduler.worker.start()
    try:
        assert hook.restore() == os.path.join(ctx.ckpt_dir, "step_5.pt")  # the local one: newest anyway
        assert "still runs" in ctx.emit.of("restore_durable_skipped")[0]["reason"]
    finally:
        release.set()


def test_prune_local_never_the_newest(tmp_path):
    ctx = run_context(tmp_path, settle_seconds=0.0, prune_local=True)
    hook = CheckpointCommitHook(ctx)
    for s in (1, 2, 3):
        write_torch_zip(os.path.join(ctx.ckpt_dir, "step_%d.pt" % s))
        hook.scan_now()
        hook.commit_one([c for c in hook.cands if c.complete][-1])
    hook.scan_now()
    removed = hook.prune_local(low_fraction=1.1)  # "the disk is low" whatever it really holds
    assert removed == ["step_1.pt", "step_2.pt"] and os.listdir(ctx.ckpt_dir) == ["step_3.pt"]


def test_make_target_kinds(tmp_path):
    assert isinstance(make_target(str(tmp_path), "r"), LocalPathTarget)
    assert make_target("s3remote:bucket/x", "r").url == "s3remote:bucket/x/r"
    assert make_target(":sftp,host=h:path", "r").url == ":sftp,host=h:path/r"
    assert make_target("rel/dir", "r").url.endswith("rel/dir/r")


def test_final_commits_a_just_saved_self_checking_checkpoint(tmp_path):
    ctx = run_context(tmp_path, settle_seconds=30.0)
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_1.pt"))
    (tmp_path / "ckpt" / "step_1.log").write_text("{}")  # not a candidate (a log, ignored by default)
    os.makedirs(os.path.join(ctx.ckpt_dir, "checkpoint-2"))
    (tmp_path / "ckpt" / "checkpoint-2" / "notes.txt").write_text("no self-check")  # needs the quiet period
    # a short grace: no room to wait for checkpoint-2's quiet period as well as commit step_1.pt
    out = hook.final(ctx.clock.monotonic() + 1.0)
    assert out is not None and out["name"] == "step_1.pt"  # saved on the signal, committed at once
    assert ctx.clock.sleeps == []
    truncate(os.path.join(ctx.ckpt_dir, "step_1.pt"), 64)
    os.rename(os.path.join(ctx.ckpt_dir, "step_1.pt"), os.path.join(ctx.ckpt_dir, "step_3.pt"))
    out = hook.final(ctx.clock.monotonic() + 60)  # a torn file is never committed, even at the end: the newest
    assert out is not None and out["name"] == "checkpoint-2"  # complete one is (quiet once the final wait is over)
    assert [e["checkpoint"] for e in ctx.emit.of("checkpoint_committed")] == ["step_1.pt", "checkpoint-2"]


def test_final_waits_out_the_quiet_period_of_the_newest_checkpoint_when_time_allows(tmp_path):
    """At the end of a run (or a long grace) the checkpoint the trainer wrote last is the one to commit, even when
    its files carry no integrity structure and it is still inside its (short, final) quiet period."""
    ctx = run_context(tmp_path, settle_seconds=30.0)
    hook = CheckpointCommitHook(ctx)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_1.pt"))
    os.makedirs(os.path.join(ctx.ckpt_dir, "checkpoint-2"))
    (tmp_path / "ckpt" / "checkpoint-2" / "state.json").write_text('{"step": 2}')  # no known layout
    out = hook.final(ctx.clock.monotonic() + 300)
    assert out is not None and out["name"] == "checkpoint-2"
    assert 2.0 <= sum(ctx.clock.sleeps) <= 2.0 + 0.2  # FINAL_SETTLE_S, in SETTLE_POLL_S steps


def test_final_does_not_wait_past_the_deadline_for_a_running_commit(tmp_path):
    import threading

    ctx = run_context(tmp_path, settle_seconds=0.0)
    hook = CheckpointCommitHook(ctx)
    release = threading.Event()
    hook.scheduler.worker = threading.Thread(target=release.wait, daemon=True)  # a periodic commit that takes long
    hook.scheduler.worker.start()
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_1.pt"))
    try:
        assert hook.final(ctx.clock.monotonic()) is None
        assert "still runs" in ctx.emit.of("final_sync_none")[0]["reason"]
    finally:
        release.set()


def test_verify_a_whole_durable_run_dir(tmp_path):
    d = tmp_path / "ck"
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), EventRecorder())
    for s in (1, 2):
        write_torch_zip(str(d / ("step_%d.pt" % s)))
        com.commit(complete_cands(str(d))[-1])
    run = tmp_path / "dur" / "r1"
    os.makedirs(run / "checkpoints" / "step_3.pt")  # an interrupted commit: ignored, said so
    rep = verify_path(str(run))
    assert rep.ok and {r["path"] for r in rep.files} == {"checkpoints/step_1.pt/step_1.pt",
                                                          "checkpoints/step_2.pt/step_2.pt", "checkpoints/step_3.pt"}
    flip_byte(str(run / "checkpoints" / "step_2.pt" / "step_2.pt"), 100)
    rep = verify_path(str(run / "checkpoints"))
    assert rep.problems == ["step_2.pt/step_2.pt: sha256 mismatch (content corrupted)"]
    rep = verify_path(str(d))  # a plain local dir of checkpoint files: format checks of each, and not verified
    assert all(r["ok"] for r in rep.files) and len(rep.files) == 2 and rep.problems == ["ck: " + NO_MANIFEST]


@pytest.mark.parametrize("stop_after", [0, 2])
def test_copy_survives_a_copy_file_range_that_stops_short(tmp_path, monkeypatch, stop_after):
    from onbox.checkpoints.durable import hashcopy

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(50_000))
    real = getattr(os, "copy_file_range", None)
    if real is None:
        pytest.skip("no os.copy_file_range on this Python")
    calls = []

    def quirky(*args):  # a filesystem whose in-kernel copy gives up part way (returns 0)
        calls.append(args)
        return 0 if len(calls) > stop_after else real(*args)

    monkeypatch.setattr(os, "copy_file_range", quirky)
    monkeypatch.setattr(hashcopy, "CFR_CHUNK", 8192)
    size, digest = hashcopy.copy_and_hash(str(src), str(tmp_path / "dst.bin"))
    assert (size, digest) == hashcopy.hash_file(str(src)) == hashcopy.hash_file(str(tmp_path / "dst.bin"))


@pytest.mark.parametrize("name", ["ckpt.pt", "model.pth", "last.ckpt", "pytorch_model.bin"])
def test_an_empty_torch_file_is_torn_never_complete_and_fails_verify(tmp_path, name):
    # a save killed (OOM, SIGKILL) before torch.save's first buffered write reached the disk leaves a 0-byte file;
    # quiescent or not, it must never be committed or handed to the trainer as ONBOX_RESUME_FROM
    d = tmp_path / "ck"
    d.mkdir()
    (d / name).write_bytes(b"")
    assert not formats.check_file(str(d / name)).ok
    clock = FakeClock()
    tr = CompletionTracker(settle_seconds=1.0)
    clock.advance(5.0)
    tr.update(scan(str(d)), clock.monotonic(), clock.time())
    clock.advance(5.0)
    [c] = tr.update(scan(str(d)), clock.monotonic(), clock.time())
    assert not c.complete and "empty" in c.reason
    assert not verify_path(str(d / name)).ok


def test_retention_never_deletes_the_checkpoint_it_just_committed_when_steps_went_back(tmp_path):
    # a run re-launched under the same name that trains from scratch (or a trainer whose step counter reset)
    # commits step 100 next to an older attempt's steps 3000..5000: ordering by step alone retired the new
    # checkpoint the moment it was committed, every time, so durable storage never held the live run's progress
    clock = FakeClock()
    d = tmp_path / "ck"
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", clock, EventRecorder())
    for s in (3000, 4000, 5000, 100, 200):
        clock.advance(60.0)
        write_torch_zip(str(d / ("step_%d.pt" % s)))
        com.commit(next(c for c in complete_cands(str(d)) if c.name == "step_%d.pt" % s))
        com.apply_retention(keep_last=2)
        assert "step_%d.pt" % s in [e["name"] for e in com.committed()]
    assert "step_200.pt" in os.listdir(tmp_path / "dur" / "r1" / "checkpoints")


@pytest.mark.parametrize("layout", ["same", "ckpt-inside-durable-run", "durable-run-inside-ckpt"])
def test_a_checkpoint_dir_overlapping_the_durable_run_dir_is_refused_before_anything_is_touched(tmp_path, layout):
    # --durable /ws --ckpt-dir /ws/myrun/checkpoints: the committer "replaced the manifest-less leftover"
    # /ws/myrun/checkpoints/checkpoint-500 (the trainer's own checkpoint) by its staged copy, then deleted that
    # too when the source "changed": the trainer's checkpoint was gone
    from onbox.errors import UsageError
    from onbox.subsystems import preflight

    ws = tmp_path / "ws"
    ckpt = {"same": ws / "myrun" / "checkpoints", "ckpt-inside-durable-run": ws / "myrun" / "checkpoints" / "x",
            "durable-run-inside-ckpt": ws}[layout]
    hf = ckpt / "checkpoint-500"
    hf.mkdir(parents=True)
    (hf / "trainer_state.json").write_text("{}")
    cfg = RunConfig(name="myrun", ckpt_dir=str(ckpt), durable=str(ws), settle_seconds=0.0).validate()
    with pytest.raises(UsageError) as e:
        preflight(cfg, environ={})
    assert "overlap" in e.value.message
    ctx = RunContext(name="myrun", run_dir=str(tmp_path / "rd"), ckpt_dir=str(ckpt), config=cfg, clock=FakeClock(),
                     emit=EventRecorder(), attempt=lambda: 0)
    os.makedirs(ctx.run_dir)
    with pytest.raises(UsageError):
        CheckpointCommitHook(ctx)
    assert (hf / "trainer_state.json").read_text() == "{}"


def test_a_durable_dir_beside_the_checkpoint_dir_is_fine(tmp_path):
    from onbox.subsystems import preflight

    cfg = RunConfig(name="myrun", ckpt_dir=str(tmp_path / "ck"), durable=str(tmp_path / "ckpts-durable")).validate()
    preflight(cfg, environ={})  # a shared name prefix is not an overlap


def test_a_users_own_manifest_less_dirs_on_durable_storage_are_never_deleted_or_replaced(tmp_path):
    # --durable /ws --name exp1 where /ws/exp1/checkpoints/ already held the user's own checkpoints (written
    # before onbox, by hand or by another tool): the committer's start-up clean treated every manifest-less dir
    # as a leftover of an interrupted commit and deleted it, and a same-named one was replaced
    d = tmp_path / "ck"
    dur = tmp_path / "dur"
    theirs = dur / "r1" / "checkpoints"
    for n in ("checkpoint-100", "step_200.pt"):
        (theirs / n).mkdir(parents=True)
        (theirs / n / "weights.bin").write_bytes(b"theirs")
    rec = EventRecorder()
    com = CheckpointCommitter(LocalPathTarget(str(dur), "r1"), "r1", FakeClock(), rec)
    write_torch_zip(str(d / "step_300.pt"))
    assert com.commit(complete_cands(str(d))[-1]).status == "committed"
    write_torch_zip(str(d / "step_200.pt"))
    with pytest.raises(SyncFailed) as e:
        com.commit(next(c for c in complete_cands(str(d)) if c.name == "step_200.pt"))
    assert "not written by onbox" in e.value.message
    for n in ("checkpoint-100", "step_200.pt"):
        assert (theirs / n / "weights.bin").read_bytes() == b"theirs"
    assert [x["name"] for x in com.committed()] == ["step_300.pt"]
    assert sorted(os.listdir(theirs / "step_300.pt")) == [MANIFEST, "step_300.pt"]  # no marker once committed


def test_an_interrupted_commit_of_ours_is_still_cleaned(tmp_path):
    d = tmp_path / "ck"
    write_torch_zip(str(d / "step_1.pt"))
    target = LocalPathTarget(str(tmp_path / "dur"), "r1")
    cand = complete_cands(str(d))[-1]
    target.put_payload("step_1.pt", cand.root, cand.files, "sha256")  # renamed into place, manifest never written
    assert target.list_names() == ["step_1.pt"] and target.read_manifest("step_1.pt") is None
    assert target.clean_leftovers() == ["step_1.pt"]


def test_listing_checkpoints_writes_nothing(tmp_path, onbox_home):
    # `onbox checkpoints` is a read: it used to rewrite checkpoint_status.json (the agent's, read-modify-write:
    # a stale last_sync could come back) and to create a run dir for a name given with --durable/--ckpt-dir
    from click.testing import CliRunner

    from onbox.commands.checkpoints import checkpoints

    ck = tmp_path / "ck"
    write_torch_zip(str(ck / "step_5.pt"))
    r = CliRunner().invoke(checkpoints, ["ghost", "--ckpt-dir", str(ck), "--durable", str(tmp_path / "dur"),
                                         "--json"])
    assert r.exit_code == 0, r.output
    assert [c["name"] for c in json.loads(r.output)["local"]] == ["step_5.pt"]
    assert not (onbox_home / "runs" / "ghost").exists()
    run = onbox_home / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"name": "r1", "command": ["x"], "ckpt_dir": str(ck)}))
    (run / CHECKPOINT_STATUS_FILE).write_text('{"last_sync": {"ok": true}}')
    r = CliRunner().invoke(checkpoints, ["r1"])
    assert r.exit_code == 0, r.output
    assert (run / CHECKPOINT_STATUS_FILE).read_text() == '{"last_sync": {"ok": true}}'


def test_listing_says_what_is_true_after_the_trainer_died(tmp_path, onbox_home):
    """Observed: `onbox checkpoints` after the child died showed files as "still changing". With no trainer
    alive nothing is being written: a torn file is torn, a save without its last file is incomplete (and why),
    and a quiet directory of no known layout is complete; while the trainer runs, recent files may still be
    being written and the listing says that instead."""
    from click.testing import CliRunner

    from onbox.commands.checkpoints import checkpoints
    from onbox.proc import start_time

    ck = tmp_path / "ck"
    truncate(write_torch_zip(str(ck / "ckpt.pt")), 300)  # written just now, torn
    write_safetensors(str(ck / "checkpoint-60" / "model.safetensors"))
    (ck / "checkpoint-60" / "config.json").write_text("{}")
    (ck / "checkpoint-60" / "training_args.bin").write_bytes(torch_zip_bytes())
    (ck / "mine").mkdir()
    (ck / "mine" / "weights.raw").write_bytes(b"\x17RAW")  # no format rule
    run = onbox_home / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"name": "r1", "command": ["x"], "ckpt_dir": str(ck),
                                                 "settle_seconds": 600}))

    def listing(child):
        (run / "state.json").write_text(json.dumps(child))
        r = CliRunner().invoke(checkpoints, ["r1", "--json"])
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output)
        return doc["trainer_alive"], {c["name"]: (c["complete"], c["reason"]) for c in doc["local"]}

    alive, dead = listing({"state": "failed", "child_pid": None})
    assert not alive
    assert dead["ckpt.pt"][0] is False and dead["ckpt.pt"][1].startswith("torn: ckpt.pt: torch zip truncated")
    assert dead["checkpoint-60"] == (False, "hf-trainer: no trainer_state.json yet (the Trainer writes it last: "
                                            "without it the save was interrupted and resuming fails)")
    assert dead["mine"][0] is True and dead["mine"][1].startswith("unchanged for 0s")
    alive, live = listing({"state": "running", "child_pid": os.getpid(), "child_start_time": start_time(os.getpid())})
    assert alive
    assert live["ckpt.pt"][1].startswith("still being written (ckpt.pt: torch zip truncated")
    assert live["mine"] == (False, "still changing (settle 600s; a directory of no known layout)")
    assert live["checkpoint-60"] == dead["checkpoint-60"]


def test_a_checkpoints_metrics_are_those_of_its_step_never_a_later_one(tmp_path):
    """The trainer saved step 50 and ran on: by the time the scan sees the file it has reported step 60. The
    index must not call step 60's loss the loss of checkpoint 50."""
    d = tmp_path / "ck"
    tr = CompletionTracker(0.0)
    for step, loss in ((30, 3.0), (40, 2.5), (50, 2.0)):
        tr.update(scan(str(d)), 0.0, 0.0, {"step": step, "loss": loss, "time": float(step)})
    write_torch_zip(str(d / "step_50.pt"))
    write_torch_zip(str(d / "step_20.pt"))  # older than every report: nothing known at its step
    tr.update(scan(str(d)), 1.0, 1.0, {"step": 60, "loss": 1.5, "time": 60.0})  # the scan is late: 60 reported
    cands = {c.name: c for c in tr.update(scan(str(d)), 2.0, 2.0, {"step": 60, "loss": 1.5, "time": 60.0})}
    assert cands["step_50.pt"].metrics["step"] == 50 and cands["step_50.pt"].metrics["loss"] == 2.0
    assert cands["step_20.pt"].metrics == {}
    # a resumed run reports step 40 again (from checkpoint 30): the newest report up to a step wins
    tr.update(scan(str(d)), 3.0, 3.0, {"step": 40, "loss": 2.4, "time": 70.0})
    write_torch_zip(str(d / "step_45.pt"))
    cands = {c.name: c for c in tr.update(scan(str(d)), 4.0, 4.0, {"step": 40, "loss": 2.4, "time": 70.0})}
    assert cands["step_45.pt"].metrics["loss"] == 2.4


def test_retention_keeps_the_checkpoint_the_attempt_resumed_from_while_it_runs(tmp_path):
    """A group's node 0 resumes from step 100 and trains on, committing every few seconds with keep_last=1; its
    other nodes fetch step 100 meanwhile (a large checkpoint takes minutes): retention must not retire it under
    them. Outside the attempt's resume point, keep_last rules as before; the next attempt pins its own."""
    box_a = run_context(tmp_path / "a", durable=str(tmp_path / "durable"), settle_seconds=0.0, keep_last=1)
    first = CheckpointCommitHook(box_a)
    write_torch_zip(os.path.join(box_a.ckpt_dir, "step_100.pt"))
    first.commit_one(complete_cands(box_a.ckpt_dir)[-1])
    ctx = run_context(tmp_path / "b", durable=str(tmp_path / "durable"), settle_seconds=0.0, keep_last=1)
    hook = CheckpointCommitHook(ctx)
    assert hook.restore() and hook.resumed["name"] == "step_100.pt"
    for s in (200, 300, 400):
        ctx.clock.advance(60.0)
        write_torch_zip(os.path.join(ctx.ckpt_dir, "step_%d.pt" % s), payload=bytes([s % 256]) * 4096)
        hook.commit_one(next(c for c in complete_cands(ctx.ckpt_dir) if c.name == "step_%d.pt" % s))
    assert [e["name"] for e in hook.committer.committed()] == ["step_100.pt", "step_400.pt"]
    retired = [n for ev in ctx.emit.of("checkpoints_retired") for n in ev["removed"]]
    assert retired == ["step_200.pt", "step_300.pt"]
    hook.restorer.resumed = {"name": "step_400.pt"}  # the next attempt resumed from step 400: step 100 is retired
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_500.pt"), payload=b"\x05" * 4096)
    hook.commit_one(next(c for c in complete_cands(ctx.ckpt_dir) if c.name == "step_500.pt"))
    assert [e["name"] for e in hook.committer.committed()] == ["step_400.pt", "step_500.pt"]
