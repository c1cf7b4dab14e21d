"""Restore to the path the trainer reads, keeping what it left there aside; quarantine and fall back when an
attempt that resumed from a checkpoint crashes before getting past it. Real torch files, the real hook and a
mounted-path durable target; the clock is the FakeClock seam."""
from __future__ import annotations

import json
import os

import pytest

from onbox import fsutil
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.local.restore import ASIDE_DIR
from onbox.checkpoints.verify import verify_path
from onbox.paths import CHECKPOINT_STATUS_FILE
from tests.fakes.run_context import run_context

torch = pytest.importorskip("torch")


def save_nanogpt(path: str, iter_num: int) -> None:
    """What nanoGPT's train.py writes, in place: a dict with the model, the optimizer and iter_num."""
    model = torch.nn.Linear(8, 8)
    torch.save({"model": model.state_dict(), "optimizer": {}, "iter_num": iter_num, "best_val_loss": 1.0},
               path)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def commit_now(hook: CheckpointCommitHook) -> None:
    hook.scheduler.last_sync = float("-inf")
    hook.periodic()
    hook.join_worker(None)
    hook.ctx.clock.advance(2)


def aside(ckpt_dir: str):
    d = os.path.join(ckpt_dir, ASIDE_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def run_started(ctx, at: float = 0.0) -> None:
    fsutil.atomic_write_json(os.path.join(ctx.run_dir, "state.json"), {"started_at": at})


@pytest.mark.parametrize("damage", ["empty", "truncated", "missing"])
def test_a_torn_in_place_ckpt_is_replaced_by_the_verified_copy_where_the_trainer_reads(tmp_path, damage):
    """nanoGPT reads exactly out_dir/ckpt.pt: a restore into any other path leaves it reading the torn file."""
    ctx = run_context(tmp_path)
    run_started(ctx)
    fsutil.atomic_write_json(os.path.join(ctx.run_dir, "progress.json"), {"step": 116, "time": 0.0})
    hook = CheckpointCommitHook(ctx)
    ckpt = os.path.join(ctx.ckpt_dir, "ckpt.pt")
    save_nanogpt(ckpt, 116)
    commit_now(hook)
    assert [e["checkpoint"] for e in ctx.emit.of("checkpoint_committed")] == ["ckpt.pt.step-116"]
    good = read(ckpt)
    if damage == "empty":  # a SIGTERM as torch.save reopened the file
        open(ckpt, "wb").close()
    elif damage == "truncated":
        with open(ckpt, "r+b") as f:
            f.truncate(len(good) // 2)
    else:
        os.unlink(ckpt)
    path = CheckpointCommitHook(ctx).restore()
    assert path == ckpt  # {ckpt} and ONBOX_RESUME_FROM point where the trainer reads
    assert read(ckpt) == good and verify_path(ckpt).ok
    assert torch.load(ckpt, weights_only=True)["iter_num"] == 116
    kept = aside(ctx.ckpt_dir)
    assert len(kept) == (0 if damage == "missing" else 1)  # the torn one is kept, never deleted
    if kept:
        assert kept[0].startswith("ckpt.pt.") and ctx.emit.of("checkpoint_set_aside")[0]["path"] == ckpt
    status = fsutil.read_json(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE))
    assert status["resume_from"] == {"path": ckpt, "source": "durable", "name": "ckpt.pt.step-116"}


def test_an_intact_local_copy_is_used_as_it_is(tmp_path):
    ctx = run_context(tmp_path)
    run_started(ctx)
    hook = CheckpointCommitHook(ctx)
    ckpt = os.path.join(ctx.ckpt_dir, "step_00005.pt")
    save_nanogpt(ckpt, 5)
    commit_now(hook)
    assert CheckpointCommitHook(ctx).restore() == ckpt
    assert ctx.emit.of("checkpoint_resume")[-1]["source"] == "local" and aside(ctx.ckpt_dir) == []


def write_hf(d: str, step: int, state: bool = True) -> None:
    """The files a Hugging Face Trainer save writes, trainer_state.json last."""
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2"}, f)
    from safetensors.torch import save_file  # transformers' own weight format

    save_file({"w": torch.zeros(4, 4)}, os.path.join(d, "model.safetensors"))
    torch.save({"lr": 1e-3}, os.path.join(d, "training_args.bin"))
    torch.save({"state": {}}, os.path.join(d, "optimizer.pt"))
    if state:
        with open(os.path.join(d, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step, "log_history": []}, f)


def test_a_half_saved_hf_checkpoint_is_never_committed_and_is_kept_aside_before_the_next_attempt(tmp_path):
    """The observed failure: a Trainer killed between save_model() and the optimizer/scheduler save left
    checkpoint-60/ without trainer_state.json; it was committed when quiet, restored, and both boxes crash-looped
    on FileNotFoundError while the complete checkpoint-40 sat in durable storage."""
    pytest.importorskip("safetensors")
    ctx = run_context(tmp_path, settle_seconds=0.0)
    run_started(ctx)
    hook = CheckpointCommitHook(ctx)
    write_hf(os.path.join(ctx.ckpt_dir, "checkpoint-40"), 40)
    commit_now(hook)
    write_hf(os.path.join(ctx.ckpt_dir, "checkpoint-60"), 60, state=False)  # killed before trainer_state.json
    for _ in range(3):  # quiet for as long as you like: never complete
        commit_now(hook)
        assert hook.final(ctx.clock.monotonic() + 60)["name"] == "checkpoint-40"
    assert [e["checkpoint"] for e in ctx.emit.of("checkpoint_committed")] == ["checkpoint-40"]
    [c60] = [c for c in hook.cands if c.name == "checkpoint-60"]
    assert not c60.complete and c60.format == "hf-trainer" and "trainer_state.json" in c60.reason
    # the next attempt on this box: resume from 40, and checkpoint-60 must not be found by
    # resume_from_checkpoint=True (which picks the highest checkpoint-N by itself)
    path = CheckpointCommitHook(ctx).restore()
    assert path == os.path.join(ctx.ckpt_dir, "checkpoint-40")
    assert sorted(os.listdir(ctx.ckpt_dir)) == [ASIDE_DIR, "checkpoint-40"]
    assert aside(ctx.ckpt_dir)[0].startswith("checkpoint-60.")
    # a replacement box (empty dir) gets checkpoint-40 too, verified
    box2 = run_context(tmp_path / "box2", durable=str(tmp_path / "durable"))
    p2 = CheckpointCommitHook(box2).restore()
    assert p2 == os.path.join(box2.ckpt_dir, "checkpoint-40")
    assert verify_path(str(tmp_path / "durable" / "r1" / "checkpoints" / "checkpoint-40")).ok
    local = verify_path(p2)  # the restored copy: every file whole; only the manifest (durable's) is not there
    assert [r["ok"] for r in local.files] == [True] * 5 and len(local.problems) == 1  # the 5 files write_hf wrote
    assert "no MANIFEST.json" in local.problems[0]
    m = fsutil.read_json(str(tmp_path / "durable" / "r1" / "checkpoints" / "checkpoint-40" / "MANIFEST.json"))
    assert (m["format"], m["complete_by"]) == ("hf-trainer", "format")


def test_a_users_own_older_files_are_never_moved(tmp_path):
    ctx = run_context(tmp_path, durable=None)
    run_started(ctx, at=4102444800.0)  # the run started after these files were written (2100-01-01)
    write_hf(os.path.join(ctx.ckpt_dir, "checkpoint-60"), 60, state=False)
    assert CheckpointCommitHook(ctx).restore() is None
    assert os.path.isdir(os.path.join(ctx.ckpt_dir, "checkpoint-60")) and aside(ctx.ckpt_dir) == []


def three_commits(ctx) -> CheckpointCommitHook:
    hook = CheckpointCommitHook(ctx)
    for step in (5, 10, 15):
        save_nanogpt(os.path.join(ctx.ckpt_dir, "step_%05d.pt" % step), step)
        commit_now(hook)
    return hook


def test_a_checkpoint_an_attempt_crashes_on_is_quarantined_and_the_next_attempt_falls_back(tmp_path):
    ctx = run_context(tmp_path)
    run_started(ctx)
    three_commits(ctx)
    hook = CheckpointCommitHook(ctx)
    assert hook.restore().endswith("step_00015.pt")
    assert hook.after_failure(3.0) is True  # crashed 3 s in, no step past 15 seen
    [q] = ctx.emit.of("checkpoint_quarantined")
    assert (q["checkpoint"], q["step"], q["fallback"]) == ("step_00015.pt", 15, "step_00010.pt")
    durable = tmp_path / "durable" / "r1"
    assert not (durable / "checkpoints" / "step_00015.pt").exists()
    [moved] = os.listdir(durable / "quarantine")  # renamed whole, manifest and all; never deleted
    assert moved.startswith("step_00015.pt.") and (durable / "quarantine" / moved / "MANIFEST.json").exists()
    index = fsutil.read_json(str(durable / "checkpoints_index.json"))
    assert [e["name"] for e in index["checkpoints"]] == ["step_00005.pt", "step_00010.pt"]
    assert index["quarantined"][0]["name"] == "step_00015.pt"
    assert aside(ctx.ckpt_dir)[0].startswith("step_00015.pt.")  # the local copy too
    assert verify_path(str(durable)).ok  # what readers see is still whole
    # the next attempt gets the newest older verified one; when it crashes as well, fall back again
    assert hook.restore().endswith("step_00010.pt")
    assert hook.after_failure(1.0) is True
    assert hook.restore().endswith("step_00005.pt")
    # nothing older left: the checkpoint stays and the supervisor's crash-loop rule decides
    assert hook.after_failure(1.0) is False
    assert ctx.emit.of("restore_fallback_exhausted")[0]["checkpoint"] == "step_00005.pt"
    assert (durable / "checkpoints" / "step_00005.pt" / "MANIFEST.json").exists()


@pytest.mark.parametrize("how", ["advanced", "late"])
def test_a_failure_after_getting_past_the_checkpoint_or_after_the_probation_quarantines_nothing(tmp_path, how):
    ctx = run_context(tmp_path, restore_probation=600.0)
    run_started(ctx)
    three_commits(ctx)
    hook = CheckpointCommitHook(ctx)
    hook.restore()
    if how == "advanced":
        ctx.clock.advance(1)
        fsutil.atomic_write_json(os.path.join(ctx.run_dir, "progress.json"), {"step": 17, "time": ctx.clock.time()})
        assert hook.after_failure(5.0) is False
    else:
        assert hook.after_failure(601.0) is False
    assert ctx.emit.of("checkpoint_quarantined") == []
    assert (tmp_path / "durable" / "r1" / "checkpoints" / "step_00015.pt").exists()


def test_a_replacement_box_never_replaces_the_first_boxs_logs(tmp_path):
    """Observed: a replacement box's first commit replaced <durable>/<run>/logs/output.log; none of the first
    box's lines remained. Each box (and agent launch) gets its own folder under logs/."""
    first = run_context(tmp_path / "box1", durable=str(tmp_path / "durable"))
    with open(os.path.join(first.run_dir, "output.log"), "w") as f:
        f.write("first box: iter 1\n")
    save_nanogpt(os.path.join(first.ckpt_dir, "step_00001.pt"), 1)
    h1 = CheckpointCommitHook(first)
    commit_now(h1)
    second = run_context(tmp_path / "box2", durable=str(tmp_path / "durable"))
    second.clock.advance(3600)  # launched an hour later
    with open(os.path.join(second.run_dir, "output.log"), "w") as f:
        f.write("second box: iter 2\n")
    with open(os.path.join(second.run_dir, "output.log.1"), "w") as f:
        f.write("second box: rotated\n")
    h2 = CheckpointCommitHook(second)
    save_nanogpt(os.path.join(second.ckpt_dir, "step_00002.pt"), 2)
    commit_now(h2)
    logs = tmp_path / "durable" / "r1" / "logs"
    assert sorted(os.listdir(logs)) == sorted([h1.box_logs, h2.box_logs]) and h1.box_logs != h2.box_logs
    assert read(str(logs / h1.box_logs / "output.log")) == b"first box: iter 1\n"
    assert read(str(logs / h2.box_logs / "output.log")) == b"second box: iter 2\n"
    assert read(str(logs / h2.box_logs / "output.log.1")) == b"second box: rotated\n"


def test_an_empty_checkpoint_dir_is_worth_one_warning_after_five_sync_intervals(tmp_path):
    ctx = run_context(tmp_path, sync_interval=10.0)
    hook = CheckpointCommitHook(ctx)
    for _ in range(5):  # 0, 10, ..., 40 s: not yet
        hook.periodic()
        assert ctx.emit.of("no_checkpoint_yet") == []
        ctx.clock.advance(10.0)
    hook.periodic()  # 50 s: five sync intervals with nothing in the dir
    ctx.clock.advance(10.0)
    hook.periodic()
    [ev] = ctx.emit.of("no_checkpoint_yet")  # once
    assert ev["ckpt_dir"] == ctx.ckpt_dir and ev["seconds"] >= 50.0
    status = fsutil.read_json(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE))
    assert status["warning"].startswith("no checkpoint in %s after " % ctx.ckpt_dir)
    save_nanogpt(os.path.join(ctx.ckpt_dir, "step_00001.pt"), 1)  # the trainer found the dir: warning gone
    ctx.clock.advance(10.0)
    hook.periodic()
    hook.join_worker(None)
    assert fsutil.read_json(os.path.join(ctx.run_dir, CHECKPOINT_STATUS_FILE))["warning"] is None


def test_the_step_label_is_what_the_checkpoint_records_not_what_the_log_says(tmp_path):
    """Observed: 12 of 17 nanoGPT commits mislabelled (`ckpt.pt.step-58` held iter 60, the final `step-396`
    held 400, one came out `ckpt.pt.t-1795412750`). nanoGPT's log runs ahead of its save, and a name carries
    no step: the label comes from iter_num inside the file, and the manifest says so."""
    ctx = run_context(tmp_path)
    hook = CheckpointCommitHook(ctx)
    ckpt = os.path.join(ctx.ckpt_dir, "ckpt.pt")
    for iter_num, logged in ((60, 58), (400, 396), (460, None)):
        save_nanogpt(ckpt, iter_num)
        progress = {"step": logged, "time": 0.0} if logged is not None else {}
        fsutil.atomic_write_json(os.path.join(ctx.run_dir, "progress.json"), progress)
        commit_now(hook)
    names = [e["checkpoint"] for e in ctx.emit.of("checkpoint_committed")]
    assert names == ["ckpt.pt.step-60", "ckpt.pt.step-400", "ckpt.pt.step-460"]
    m = fsutil.read_json(str(tmp_path / "durable" / "r1" / "checkpoints" / "ckpt.pt.step-400" / "MANIFEST.json"))
    assert (m["step"], m["step_source"]) == (400, "ckpt.pt:iter_num")
    # a Lightning-style file and an HF dir: global_step from inside, whatever the name or the log say
    torch.save({"global_step": 77, "epoch": 1, "state_dict": {}}, os.path.join(ctx.ckpt_dir, "last.ckpt"))
    pytest.importorskip("safetensors")
    write_hf(os.path.join(ctx.ckpt_dir, "checkpoint-90"), 90)
    hook.scan_now()
    by_name = {c.name: c for c in hook.cands}
    assert (by_name["last.ckpt"].step, by_name["last.ckpt"].step_source) == (77, "last.ckpt:global_step")
    assert (by_name["checkpoint-90"].step, by_name["checkpoint-90"].step_source) == (
        90, "trainer_state.json:global_step")


def test_a_quarantine_does_not_wait_forever_for_a_hung_commit(tmp_path):
    """The attempt that resumed from step 15 crashes while a commit hangs on a dead mount, holding the commit lock.
    after_failure() waits for it no longer than restore() does (final_sync_timeout): it leaves the durable side
    alone and quarantines nothing, instead of blocking the supervisor (signals, preemption, the next attempt)."""
    import threading

    from tests.polling import wait_for

    ctx = run_context(tmp_path)
    run_started(ctx)
    three_commits(ctx)
    hook = CheckpointCommitHook(ctx)
    assert hook.restore().endswith("step_00015.pt")
    ctx.config.final_sync_timeout = 0.05
    release, holding = threading.Event(), threading.Event()

    def hung_commit() -> None:
        with hook.scheduler.locked():
            holding.set()
            release.wait(60)

    hook.scheduler.worker = threading.Thread(target=hung_commit, daemon=True)
    hook.scheduler.worker.start()
    out: list = []
    caller = threading.Thread(target=lambda: out.append(hook.after_failure(3.0)), daemon=True)
    try:
        assert holding.wait(10)
        caller.start()
        wait_for(lambda: out, timeout=20.0, what="after_failure() returning while a commit hangs")
    finally:
        release.set()
        caller.join(30)
    assert out == [False]
    [skipped] = ctx.emit.of("quarantine_skipped")
    assert skipped["checkpoint"] == "step_00015.pt" and "still runs" in skipped["reason"]
    assert (tmp_path / "durable" / "r1" / "checkpoints" / "step_00015.pt" / "MANIFEST.json").exists()
    assert os.path.exists(os.path.join(ctx.ckpt_dir, "step_00015.pt"))


def test_a_local_checkpoint_committed_during_the_attempt_that_crashed_on_it_is_quarantined_on_durable_too(tmp_path):
    """The attempt resumed from step 20, saved by the trainer but not committed yet; while it ran, the periodic
    commit sent step 20 to durable storage, then the attempt crashed on it. The fallback must not fetch that same
    checkpoint back from durable storage (one more attempt crashing on it): it is quarantined there as well."""
    ctx = run_context(tmp_path)
    run_started(ctx)
    three_commits(ctx)
    hook = CheckpointCommitHook(ctx)
    save_nanogpt(os.path.join(ctx.ckpt_dir, "step_00020.pt"), 20)
    assert hook.restore().endswith("step_00020.pt")
    assert hook.status["resume_from"]["source"] == "local-unsynced"
    commit_now(hook)  # the attempt runs: its periodic commit sends step 20
    durable = tmp_path / "durable" / "r1"
    assert (durable / "checkpoints" / "step_00020.pt" / "MANIFEST.json").exists()
    assert hook.after_failure(3.0) is True
    [q] = ctx.emit.of("checkpoint_quarantined")
    assert q["fallback"] == "step_00015.pt" and q["moved_to"]["durable"].startswith(str(durable / "quarantine"))
    assert not (durable / "checkpoints" / "step_00020.pt").exists()
    index = fsutil.read_json(str(durable / "checkpoints_index.json"))
    assert [e["name"] for e in index["quarantined"]] == ["step_00020.pt"]
    assert hook.restore().endswith("step_00015.pt")
