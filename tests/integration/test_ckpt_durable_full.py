"""A durable side that runs out of bytes or inodes (real size-limited tmpfs mounts): loud failure, the previous
committed checkpoint intact, the source intact, the training loop (the hook) undisturbed, never "synced" (U33)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from onbox.checkpoints import DurableFull, SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import hashcopy
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan
from onbox.checkpoints.verify import verify_path
from onbox.clock import SystemClock
from tests.checkpoint_files import write_torch_zip
from tests.conftest import subprocess_env
from tests.fakes.recorders import EventRecorder
from tests.fakes.run_context import run_context
from tests.hosts.tmpfs import tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.root]


class BlindTarget(LocalPathTarget):
    """A mount that cannot report free space (some FUSE/NFS): the failure then comes from the copy itself."""

    def free_space(self):
        return None


def newest(root):
    return [c for c in CompletionTracker(0.0).update(scan(root), 0.0, 0.0) if c.complete][-1]


def test_bytes_full_preflight_and_enospc_mid_copy(tmp_path):
    src = str(tmp_path / "ck")
    with tmpfs(tmp_path / "dur", size="2m", nr_inodes=1000) as dur:
        write_torch_zip(os.path.join(src, "step_1.pt"), payload=b"\x01" * 100_000)
        com = CheckpointCommitter(LocalPathTarget(dur, "r1"), "r1", SystemClock(), EventRecorder())
        assert com.commit(newest(src)).status == "committed"
        big = write_torch_zip(os.path.join(src, "step_2.pt"), payload=os.urandom(1_500_000))
        src_hash = hashcopy.hash_file(big)
        # the CLI: preflight refuses, exit 1, the numbers, no "synced"
        env = subprocess_env({"ONBOX_HOME": str(tmp_path / "home")})
        proc = subprocess.run([sys.executable, "-m", "onbox", "sync", "r1", "--durable",
                               dur, "--ckpt-dir", src, "--now"], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "too full" in proc.stderr and "MiB free" in proc.stderr and "synced" not in proc.stdout + proc.stderr
        events = [json.loads(x) for x in (tmp_path / "home" / "runs" / "r1" / "events.jsonl").read_text().splitlines()]
        [full] = [e for e in events if e["type"] == "durable_full"]
        assert full["need_bytes"] > full["free_bytes"] > 0
        # a target that cannot see free space: ENOSPC in the middle of the copy, staging cleaned
        blind = CheckpointCommitter(BlindTarget(dur, "r1"), "r1", SystemClock(), EventRecorder())
        with pytest.raises(SyncFailed) as ei:
            blind.commit(newest(src))
        assert ei.value.errno_name == "ENOSPC"
        ckpts = os.path.join(dur, "r1", "checkpoints")
        assert os.listdir(ckpts) == ["step_1.pt"]  # no partial temp left behind
        assert verify_path(os.path.join(ckpts, "step_1.pt")).ok  # the previous checkpoint is intact
        assert hashcopy.hash_file(big) == src_hash  # and so is the source


def test_inodes_exhausted(tmp_path):
    src = str(tmp_path / "ck")
    with tmpfs(tmp_path / "dur", size="64m", nr_inodes=40) as dur:
        write_torch_zip(os.path.join(src, "step_1.pt"))
        com = CheckpointCommitter(LocalPathTarget(dur, "r1"), "r1", SystemClock(), EventRecorder())
        assert com.commit(newest(src)).status == "committed"
        for i in range(40):
            write_torch_zip(os.path.join(src, "checkpoint-2", "shard-%02d.pt" % i))
        emit = EventRecorder()
        com = CheckpointCommitter(LocalPathTarget(dur, "r1"), "r1", SystemClock(), emit)
        with pytest.raises(DurableFull) as ei:
            com.commit(newest(src))
        assert "inodes free" in str(ei.value)
        [ev] = emit.of("durable_full")
        assert ev["need_inodes"] > ev["free_inodes"] >= 0
        blind = CheckpointCommitter(BlindTarget(dur, "r1"), "r1", SystemClock(), EventRecorder())
        with pytest.raises(SyncFailed) as ei:
            blind.commit(newest(src))
        assert ei.value.errno_name == "ENOSPC"  # tmpfs reports inode exhaustion as ENOSPC (U7)
        ckpts = os.path.join(dur, "r1", "checkpoints")
        assert os.listdir(ckpts) == ["step_1.pt"]
        assert verify_path(os.path.join(ckpts, "step_1.pt")).ok


def test_hook_keeps_the_loop_running_when_durable_is_full(tmp_path):
    with tmpfs(tmp_path / "dur", size="1m") as dur:
        ctx = run_context(tmp_path, durable=dur, settle_seconds=0.0)
        hook = CheckpointCommitHook(ctx)
        write_torch_zip(os.path.join(ctx.ckpt_dir, "step_5.pt"), payload=os.urandom(2_000_000))
        hook.periodic()  # returns at once; the commit runs (and fails) in the background
        hook.join_worker(None)
        assert ctx.emit.of("durable_full") and ctx.emit.of("sync_failed")
        assert hook.status["last_sync"]["ok"] is False and "too full" in hook.status["last_sync"]["error"]
        assert hook.final(ctx.clock.monotonic() + 30) is None


def test_read_only_durable_fails_loudly(tmp_path):
    src = str(tmp_path / "ck")
    with tmpfs(tmp_path / "dur", size="8m") as dur:
        write_torch_zip(os.path.join(src, "step_1.pt"))
        com = CheckpointCommitter(LocalPathTarget(dur, "r1"), "r1", SystemClock(), EventRecorder())
        assert com.commit(newest(src)).status == "committed"
        subprocess.run(["mount", "-o", "remount,ro", dur], check=True, timeout=30)
        write_torch_zip(os.path.join(src, "step_2.pt"))
        with pytest.raises(SyncFailed) as ei:
            CheckpointCommitter(LocalPathTarget(dur, "r1"), "r1", SystemClock(), EventRecorder()).commit(newest(src))
        assert ei.value.errno_name == "EROFS" and "read-only" in (ei.value.hint or "")
        assert verify_path(os.path.join(dur, "r1", "checkpoints", "step_1.pt")).ok
