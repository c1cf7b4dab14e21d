"""A checkpoint disk that runs low (a real size-limited tmpfs as the checkpoint dir), where onbox prunes local copies
that are already committed (prune_local) while the trainer retires old checkpoints of its own."""
from __future__ import annotations

import os

import pytest

from onbox.checkpoints.durable import hashcopy
from onbox.checkpoints.hook import CheckpointCommitHook
from tests.checkpoint_files import write_torch_zip
from tests.fakes.run_context import run_context
from tests.hosts.tmpfs import tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.root]


def test_pruning_a_local_copy_the_trainer_already_deleted_is_no_error(tmp_path):
    """Lightning's save_top_k deletes an old .ckpt while onbox commits the newest one: the prune that follows the
    commit finds it gone. The commit stands and the rest of the prune and the log copy still happen."""
    ctx = run_context(tmp_path, settle_seconds=0.0, prune_local=True)
    with tmpfs(ctx.ckpt_dir, size="1m"):
        hook = CheckpointCommitHook(ctx)
        for step, size in ((1, 150_000), (2, 150_000)):
            write_torch_zip(os.path.join(ctx.ckpt_dir, "step_%d.pt" % step), payload=os.urandom(size), members=1)
            [*_, newest] = hook.scan_now(settle=0.0)
            assert hook.commit_one(newest).status == "committed"
        assert not ctx.emit.of("local_pruned")  # room enough so far
        write_torch_zip(os.path.join(ctx.ckpt_dir, "step_3.pt"), payload=os.urandom(400_000), members=1)
        with open(os.path.join(ctx.run_dir, "output.log"), "w") as f:
            f.write("step 3\n")
        [*_, newest] = hook.scan_now(settle=0.0)
        assert newest.name == "step_3.pt"

        def trainer_retires_step_1(label: str) -> None:
            if label == "after-manifest":
                os.unlink(os.path.join(ctx.ckpt_dir, "step_1.pt"))

        hashcopy.fault_hook = trainer_retires_step_1
        try:
            r = hook.commit_one(newest)
        finally:
            hashcopy.fault_hook = None
        assert r is not None and r.status == "committed" and r.name == "step_3.pt"
        assert sorted(os.listdir(ctx.ckpt_dir)) == ["step_3.pt"]  # step_2 pruned, the newest never
        assert [e["removed"] for e in ctx.emit.of("local_pruned")] == [["step_2.pt"]]
        assert hook.status["last_sync"]["ok"] is True and hook.status["last_sync"]["checkpoint"] == "step_3.pt"
        logs = os.path.join(str(tmp_path / "durable"), "r1", "logs", hook.box_logs)
        with open(os.path.join(logs, "output.log")) as f:
            assert f.read() == "step 3\n"  # the log copy after the prune
