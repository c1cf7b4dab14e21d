"""Commits to a durable volume on a block device of its own (a real loop-mounted ext4, tests/hosts/blockfs.py): the
payload crosses filesystems, lands whole and hash-correct; a volume that fills in the middle of a copy fails loudly
(ENOSPC), leaves no staging dir, and the previous checkpoint and the source intact."""
from __future__ import annotations

import os

import pytest

from onbox.checkpoints import SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import hashcopy
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.verify import verify_path
from onbox.clock import SystemClock
from tests.checkpoint_files import complete_cands, write_torch_zip
from tests.fakes.recorders import EventRecorder
from tests.hosts.blockfs import ext4_volume

pytestmark = [pytest.mark.integration, pytest.mark.root]
MiB = 1024 * 1024


class BlindTarget(LocalPathTarget):
    """A mount that cannot report free space (some FUSE/NFS): the failure then comes from the copy itself."""

    def free_space(self):
        return None


def test_a_commit_to_a_volume_on_its_own_disk_lands_whole(tmp_path):
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-7", "pytorch_model.bin"), payload=os.urandom(20 * MiB + 123))
    write_torch_zip(os.path.join(src, "checkpoint-7", "optimizer.pt"), payload=os.urandom(3 * MiB))
    with open(os.path.join(src, "checkpoint-7", "trainer_state.json"), "w") as f:  # written last by HF's Trainer
        f.write('{"global_step": 7}')
    with ext4_volume(tmp_path / "vol", 64) as vol:
        assert os.stat(vol).st_dev != os.stat(src).st_dev  # across filesystems: no in-kernel copy between them
        emit = EventRecorder()
        com = CheckpointCommitter(LocalPathTarget(vol, "r1"), "r1", SystemClock(), emit)
        [cand] = complete_cands(src)
        assert com.commit(cand).status == "committed"
        assert verify_path(os.path.join(vol, "r1", "checkpoints", "checkpoint-7")).ok
        assert emit.of("checkpoint_committed")[0]["phases"]["copy+hash"] > 0


def test_a_volume_that_fills_during_a_copy_fails_loudly_and_keeps_what_was_there(tmp_path):
    src = str(tmp_path / "ck")
    with ext4_volume(tmp_path / "vol", 16) as vol:
        write_torch_zip(os.path.join(src, "step_1.pt"), payload=os.urandom(MiB))
        com = CheckpointCommitter(BlindTarget(vol, "r1"), "r1", SystemClock(), EventRecorder())
        assert com.commit(complete_cands(src)[-1]).status == "committed"
        big = write_torch_zip(os.path.join(src, "step_2.pt"), payload=os.urandom(24 * MiB))
        src_hash = hashcopy.hash_file(big)
        with pytest.raises(SyncFailed) as ei:
            com.commit(complete_cands(src)[-1])
        assert ei.value.errno_name == "ENOSPC"
        ckpts = os.path.join(vol, "r1", "checkpoints")
        assert os.listdir(ckpts) == ["step_1.pt"]  # no staging dir left behind
        assert verify_path(os.path.join(ckpts, "step_1.pt")).ok
        assert hashcopy.hash_file(big) == src_hash
