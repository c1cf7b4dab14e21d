"""The rclone target against real servers on loopback, each test once per backend (tests/hosts/rclone.py's
`rclone_remote`): `rclone serve sftp` (renames, directories) and `rclone serve s3` (an S3 API: objects, no
renames, flat listings). Commit (payload first, manifest last), restore onto an empty checkpoint dir, an upload
interrupted by SIGKILL of the committing process, an unreachable remote, a user's own dirs left alone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from onbox.checkpoints import MANIFEST, SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable.rclone import RcloneTarget
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan
from onbox.checkpoints.verify import NO_MANIFEST, verify_path
from onbox.clock import SystemClock
from tests.checkpoint_files import write_safetensors, write_torch_zip
from tests.conftest import subprocess_env
from tests.fakes.recorders import EventRecorder
from tests.fakes.run_context import run_context

pytestmark = pytest.mark.integration
# the cases whose S3 side the default rclone (1.75.2 over rcd) shows; the others run as processes on S3 too
CALLS_ONCE_ON_S3 = pytest.mark.parametrize("rclone_remote", ["sftp", "s3", "sftp-rcd"], indirect=True)


def newest(root):
    return [c for c in CompletionTracker(0.0).update(scan(root), 0.0, 0.0) if c.complete][-1]


def test_commit_and_restore(tmp_path, rclone_remote):
    ctx = run_context(tmp_path, durable=rclone_remote.remote, settle_seconds=0.0, sync_interval=0.0)
    write_torch_zip(os.path.join(ctx.ckpt_dir, "checkpoint-10", "model.pt"), payload=os.urandom(300_000))
    write_safetensors(os.path.join(ctx.ckpt_dir, "checkpoint-10", "sub", "ema.safetensors"))
    hook = CheckpointCommitHook(ctx)
    hook.periodic()
    hook.join_worker(None)
    assert ctx.emit.of("checkpoint_committed"), ctx.emit.events
    rcd = hook.target.rcd
    # 1.75.2 over one rclone rcd; Debian's 1.60 cannot serve rc on a unix socket: a process per call, said why
    assert ("rcd" if rcd is not None and rcd.problem is None else "cli") == rclone_remote.calls, rcd and rcd.problem
    assert rclone_remote.calls == "rcd" or rcd is None or "rclone rcd ended at its start" in (rcd.problem or "")
    served = os.path.join(rclone_remote.durable_root, "r1", "checkpoints", "checkpoint-10")
    assert os.path.exists(os.path.join(served, MANIFEST))
    assert verify_path(served).ok  # what landed on the server, checked byte by byte
    assert sorted(os.listdir(served)) == [MANIFEST, "model.pt", "sub"]  # the partial marker is gone
    assert os.path.exists(os.path.join(rclone_remote.durable_root, "r1", "checkpoints_index.json"))
    # a replacement box with an empty checkpoint dir
    box2 = run_context(tmp_path / "box2", durable=rclone_remote.remote, settle_seconds=0.0)
    path = CheckpointCommitHook(box2).restore()
    assert path == os.path.join(box2.ckpt_dir, "checkpoint-10")
    rep = verify_path(path)  # the local copy has no manifest (it is not a committed checkpoint): files check out
    assert all(r["ok"] for r in rep.files) and rep.problems == ["checkpoint-10: " + NO_MANIFEST]
    assert box2.emit.of("checkpoint_restored")


UPLOADER = r"""
import sys
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan
from onbox.checkpoints.durable.rclone import RcloneTarget
from onbox.clock import SystemClock
remote, src = sys.argv[1], sys.argv[2]
target = RcloneTarget(remote, "r1", extra_flags=["--bwlimit", "1M"])
[cand] = [c for c in CompletionTracker(0.0).update(scan(src), 0.0, 0.0) if c.name == "checkpoint-2"]
CheckpointCommitter(target, "r1", SystemClock(), lambda *a, **k: None).commit(cand)
print("finished", flush=True)
"""


def landed(path: str) -> int:
    """Bytes under `path` on the server's disk, hidden files too (an S3 upload in flight is a temp file there)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_interrupted_upload_is_invisible_and_finished_next_run(tmp_path, rclone_remote):
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-1", "model.pt"))
    target = RcloneTarget(rclone_remote.remote, "r1")
    CheckpointCommitter(target, "r1", SystemClock(), EventRecorder()).commit(newest(src))
    write_torch_zip(os.path.join(src, "checkpoint-2", "model.pt"), payload=os.urandom(6_000_000))
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, rclone_remote.remote, src], env=subprocess_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial_dir = os.path.join(rclone_remote.durable_root, "r1", "checkpoints", "checkpoint-2")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and landed(partial_dir) < 100_000:
            time.sleep(0.05)  # the marker (0 bytes) first, then payload bytes arriving
        assert proc.poll() is None, "upload never started: %s" % (proc.stderr and proc.stderr.read())
        os.killpg(proc.pid, signal.SIGKILL)  # the committer and its rclone child, mid-upload
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    assert os.path.isdir(partial_dir) and not os.path.exists(os.path.join(partial_dir, MANIFEST))
    # readers ignore it: no manifest, not in the index
    reader = CheckpointCommitter(RcloneTarget(rclone_remote.remote, "r1"), "r1", SystemClock(), EventRecorder())
    assert [e["name"] for e in reader.committed()] == ["checkpoint-1"]
    assert reader.target.read_manifest("checkpoint-2") is None
    # the next run cleans the leftover and finishes the commit
    emit = EventRecorder()
    nxt = CheckpointCommitter(RcloneTarget(rclone_remote.remote, "r1"), "r1", SystemClock(), emit)
    r = nxt.commit(newest(src))
    assert r.status == "committed" and r.name == "checkpoint-2"
    assert emit.of("checkpoint_leftovers_cleaned")[0]["removed"] == ["checkpoint-2"]
    assert verify_path(partial_dir).ok
    assert [e["name"] for e in nxt.committed()] == ["checkpoint-1", "checkpoint-2"]
    assert sorted(os.listdir(partial_dir)) == [MANIFEST, "model.pt"]  # no temp file, no marker left


@CALLS_ONCE_ON_S3
def test_unreachable_remote_fails_loudly(tmp_path, rclone_remote):
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-1", "model.pt"))
    ctx = run_context(tmp_path, durable=rclone_remote.unreachable(), settle_seconds=0.0)
    os.rmdir(ctx.ckpt_dir)
    os.symlink(src, ctx.ckpt_dir)
    hook = CheckpointCommitHook(ctx)
    hook.committer.target.base_timeout = 20
    # one attempt per request: an S3 client retries a refused connection with backoff for ~16 s a call otherwise
    hook.committer.target.flags += ["--low-level-retries", "1"]
    hook.periodic()
    hook.join_worker(None)
    [fail] = ctx.emit.of("sync_failed")
    assert "rclone" in fail["error"] and not ctx.emit.of("checkpoint_committed")
    assert hook.status["last_sync"]["ok"] is False


@CALLS_ONCE_ON_S3
def test_a_users_own_dirs_on_the_remote_are_never_purged_or_overwritten(tmp_path, rclone_remote):
    theirs = os.path.join(rclone_remote.durable_root, "r1", "checkpoints")
    for n in ("checkpoint-5", "checkpoint-7"):
        os.makedirs(os.path.join(theirs, n))
        with open(os.path.join(theirs, n, "weights.bin"), "wb") as f:
            f.write(b"theirs")
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-9", "model.pt"))
    com = CheckpointCommitter(RcloneTarget(rclone_remote.remote, "r1"), "r1", SystemClock(), EventRecorder())
    assert com.commit(newest(src)).status == "committed"
    write_torch_zip(os.path.join(src, "checkpoint-7", "model.pt"))
    cand = next(c for c in CompletionTracker(0.0).update(scan(src), 0.0, 0.0) if c.name == "checkpoint-7")
    with pytest.raises(SyncFailed) as e:
        com.commit(cand)
    assert "not written by onbox" in str(e.value)
    for n in ("checkpoint-5", "checkpoint-7"):
        with open(os.path.join(theirs, n, "weights.bin"), "rb") as f:
            assert f.read() == b"theirs"
    assert sorted(os.listdir(os.path.join(theirs, "checkpoint-9"))) == [MANIFEST, "model.pt"]


def commit_newest(hook):
    r = hook.commit_one(hook.scan_now(settle=0.0)[-1])
    assert r is not None and r.status == "committed", hook.ctx.emit.events
    return r


@CALLS_ONCE_ON_S3
def test_retention_leaves_the_newest_whole_no_leftovers_and_the_logs_per_box(tmp_path, rclone_remote):
    ctx = run_context(tmp_path, durable=rclone_remote.remote, settle_seconds=0.0, keep_last=2)
    with open(os.path.join(ctx.run_dir, "output.log"), "w") as f:
        f.write("step 40 loss 1.25\n")
    hook = CheckpointCommitHook(ctx)
    for step in (10, 20, 30, 40):
        write_torch_zip(os.path.join(ctx.ckpt_dir, "checkpoint-%d" % step, "model.pt"), payload=os.urandom(50_000))
        commit_newest(hook)
    root = os.path.join(rclone_remote.durable_root, "r1")
    kept = ["checkpoint-30", "checkpoint-40"]
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == kept  # retired ones gone, nothing left over
    for n in kept:
        assert sorted(os.listdir(os.path.join(root, "checkpoints", n))) == [MANIFEST, "model.pt"]
        assert verify_path(os.path.join(root, "checkpoints", n)).ok
    with open(os.path.join(root, "checkpoints_index.json")) as f:
        assert [e["name"] for e in json.load(f)["checkpoints"]] == kept
    assert [e["removed"] for e in ctx.emit.of("checkpoints_retired")] == [["checkpoint-10"], ["checkpoint-20"]]
    # this box's logs, in a folder of its own: what a replacement box finds of the run's history
    assert os.listdir(os.path.join(root, "logs")) == [hook.box_logs]
    with open(os.path.join(root, "logs", hook.box_logs, "output.log")) as f:
        assert f.read() == "step 40 loss 1.25\n"


def test_a_damaged_checkpoint_is_refused_quarantined_whole_and_the_older_one_restored(tmp_path, rclone_remote):
    ctx = run_context(tmp_path, durable=rclone_remote.remote, settle_seconds=0.0)
    hook = CheckpointCommitHook(ctx)
    digests = {}
    for step in (10, 20):
        d = os.path.join(ctx.ckpt_dir, "checkpoint-%d" % step)
        write_torch_zip(os.path.join(d, "model.pt"), payload=os.urandom(200_000))
        write_safetensors(os.path.join(d, "sub", "ema.safetensors"))
        digests["checkpoint-%d" % step] = commit_newest(hook).digest
    root = os.path.join(rclone_remote.durable_root, "r1")
    bad = os.path.join(root, "checkpoints", "checkpoint-20", "model.pt")
    with open(bad, "r+b") as f:  # bit rot on the store: same size, other bytes
        f.seek(100_000)
        byte = f.read(1)
        f.seek(100_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(bad, "rb") as f:
        damaged = f.read()
    box2 = run_context(tmp_path / "box2", durable=rclone_remote.remote, settle_seconds=0.0)
    assert CheckpointCommitHook(box2).restore() == os.path.join(box2.ckpt_dir, "checkpoint-10")
    [refused] = box2.emit.of("restore_verify_failed")
    assert refused["checkpoint"] == "checkpoint-20" and "model.pt" in refused["problem"]
    # moved whole to quarantine/ (manifest and payload, the damaged bytes as they were), never deleted
    [moved] = os.listdir(os.path.join(root, "quarantine"))
    assert moved.startswith("checkpoint-20.")
    qdir = os.path.join(root, "quarantine", moved)
    assert sorted(os.listdir(qdir)) == [MANIFEST, "model.pt", "sub"]
    with open(os.path.join(qdir, MANIFEST)) as f:
        assert json.load(f)["digest"] == digests["checkpoint-20"]
    with open(os.path.join(qdir, "model.pt"), "rb") as f:
        assert f.read() == damaged
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == ["checkpoint-10"]
    # the index: only what can be restored, the quarantined one recorded, the restore's passed re-check
    with open(os.path.join(root, "checkpoints_index.json")) as f:
        index = json.load(f)
    [entry] = index["checkpoints"]
    assert entry["name"] == "checkpoint-10" and entry["verification"]["checks"][-1]["by"] == "restore"
    assert entry["verification"]["checks"][-1]["result"] == "passed"
    [q] = index["quarantined"]
    assert q["name"] == "checkpoint-20" and "cannot be restored" in q["reason"]
    assert q["verification"]["checks"][-1]["result"] == "failed"


@CALLS_ONCE_ON_S3
def test_a_retry_over_its_own_leftover_replaces_every_file_even_one_that_looks_unchanged(tmp_path, rclone_remote):
    """The same committer tries again after a failed upload (no new start, no cleanup): the leftover's files are
    overwritten, also one of the same size and time as the source (rclone would skip it as unchanged)."""
    src = str(tmp_path / "ck")
    model = write_torch_zip(os.path.join(src, "checkpoint-3", "model.pt"), payload=os.urandom(100_000))
    left = os.path.join(rclone_remote.durable_root, "r1", "checkpoints", "checkpoint-3")
    os.makedirs(left)
    open(os.path.join(left, ".onbox-partial"), "wb").close()
    with open(os.path.join(left, "model.pt"), "wb") as f:  # an earlier attempt's bytes: same size, other content
        f.write(os.urandom(os.path.getsize(model)))
    st = os.stat(model)
    os.utime(os.path.join(left, "model.pt"), ns=(st.st_atime_ns, st.st_mtime_ns))
    com = CheckpointCommitter(RcloneTarget(rclone_remote.remote, "r1"), "r1", SystemClock(), EventRecorder())
    com._started = True  # the leftover is this committer's own, from its failed try: no cleanup comes first
    assert com.commit(newest(src)).status == "committed"
    assert verify_path(left).ok  # the manifest's hashes are of what is there
    assert sorted(os.listdir(left)) == [MANIFEST, "model.pt"]
