"""Odd moments and odd filesystem states around a commit and a restore: real files, the real hook and committer
on a mounted-path durable target. The only seams: the FakeClock and hashcopy.fault_hook (a labelled point inside
the copy, where the test does what a trainer would do at that moment)."""
from __future__ import annotations

import os
import shutil

from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import hashcopy
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.clock import FakeClock
from tests.checkpoint_files import complete_cands, write_torch_zip
from tests.fakes.recorders import EventRecorder
from tests.fakes.run_context import run_context


def test_a_checkpoint_the_trainer_deletes_while_it_is_copied_is_dropped_not_a_sync_failure(tmp_path):
    """HF's save_total_limit deletes checkpoint-N once checkpoint-N+k is saved, possibly while onbox still copies
    checkpoint-N: the source changed (it is gone), which says nothing about the durable storage. The commit is
    dropped and tried again with what is there now, as for a file rewritten during the copy."""
    d = tmp_path / "ck"
    for rel in ("a.pt", "b.pt", "c.pt"):
        write_torch_zip(str(d / "checkpoint-100" / rel), payload=b"\x01" * 65536)
    emit = EventRecorder()
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), emit)
    [cand] = complete_cands(str(d))
    seen = []

    def trainer_retires_it(label: str) -> None:
        if label == "before-file" and not seen:
            seen.append(label)
            shutil.rmtree(str(d / "checkpoint-100"))

    hashcopy.fault_hook = trainer_retires_it
    try:
        r = com.commit(cand)
    finally:
        hashcopy.fault_hook = None
    assert seen and r.status == "source_changed"
    assert not emit.of("sync_failed") and not emit.of("checkpoint_committed")
    ckpts = tmp_path / "dur" / "r1" / "checkpoints"
    assert os.listdir(str(ckpts)) == []  # no staging dir, no manifest-less dir left behind


def test_the_hook_retries_at_once_after_the_source_vanished_and_never_reports_a_failed_sync(tmp_path):
    ctx = run_context(tmp_path, settle_seconds=0.0)
    hook = CheckpointCommitHook(ctx)
    old = os.path.join(ctx.ckpt_dir, "checkpoint-100")
    write_torch_zip(os.path.join(old, "model.pt"), payload=b"\x01" * 65536)
    seen = []

    def trainer_saves_and_retires(label: str) -> None:
        if label == "before-file" and not seen:
            seen.append(label)
            write_torch_zip(os.path.join(ctx.ckpt_dir, "checkpoint-200", "model.pt"), payload=b"\x02" * 65536)
            shutil.rmtree(old)

    hashcopy.fault_hook = trainer_saves_and_retires
    try:
        hook.periodic()
        hook.join_worker(None)
    finally:
        hashcopy.fault_hook = None
    assert seen and not ctx.emit.of("sync_failed")
    assert (hook.status.get("last_sync") or {}).get("ok") is not False
    ctx.clock.advance(1.5)  # the next scan, well inside the 5 s sync interval
    hook.periodic()
    hook.join_worker(None)
    assert [e["checkpoint"] for e in ctx.emit.of("checkpoint_committed")] == ["checkpoint-200"]


def test_a_retention_failure_after_a_commit_is_said_and_the_commit_stands(tmp_path):
    """Retention deletes older checkpoints after a commit; durable storage that fails that delete (an NFS mount
    going away answers EIO) must not undo what the commit did: the status says the new checkpoint is durable, the
    logs are copied, and `retention_failed` says why the old ones are still there."""
    import errno

    from onbox.checkpoints.durable.targets import make_target

    class DyingMount(LocalPathTarget):  # the durable-storage seam: a mount that fails deletes
        def remove(self, name: str) -> None:
            raise OSError(errno.EIO, "Input/output error", name)

    ctx = run_context(tmp_path, settle_seconds=0.0, keep_last=1)
    assert isinstance(make_target(ctx.config.durable, "r1"), LocalPathTarget)
    hook = CheckpointCommitHook(ctx, target=DyingMount(ctx.config.durable, "r1"))
    with open(os.path.join(ctx.run_dir, "output.log"), "w") as f:
        f.write("step 200 loss 1.0\n")
    for step in (100, 200):
        write_torch_zip(os.path.join(ctx.ckpt_dir, "step_%d.pt" % step), payload=bytes([step % 256]) * 4096)
        hook.periodic()
        hook.join_worker(None)
        ctx.clock.advance(10.0)
    assert [e["checkpoint"] for e in ctx.emit.of("checkpoint_committed")] == ["step_100.pt", "step_200.pt"]
    [failed] = ctx.emit.of("retention_failed")
    assert failed["checkpoint"] == "step_200.pt" and "Input/output error" in failed["error"]
    assert hook.status["latest_durable"]["name"] == "step_200.pt" and hook.status["last_sync"]["ok"] is True
    logs = os.path.join(ctx.config.durable, "r1", "logs")
    assert [n for _d, _s, names in os.walk(logs) for n in names] == ["output.log"]  # the log copy after it ran


def test_a_leftover_of_a_killed_removal_under_the_same_pid_does_not_block_the_next(tmp_path):
    from onbox.checkpoints.durable.localpath import STAGING_PREFIX

    target = LocalPathTarget(str(tmp_path / "dur"), "r1")
    os.makedirs(os.path.join(target.ckpts, "step_1.pt"))
    left = os.path.join(target.ckpts, "%sstep_1.pt.del.%d" % (STAGING_PREFIX, os.getpid()))
    os.makedirs(os.path.join(left, "half-deleted"))  # a container restarted the agent under the same pid
    target.remove("step_1.pt")
    assert not os.path.exists(os.path.join(target.ckpts, "step_1.pt"))
