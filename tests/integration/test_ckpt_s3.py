"""What object stores do that the sftp cases cannot show, against the real S3 API of tests/hosts/s3.py: a multipart
upload killed half-way, and the environment trap of an old rclone client (AWS_CA_BUNDLE)."""
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
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan
from onbox.checkpoints.verify import verify_path
from onbox.clock import SystemClock
from tests.checkpoint_files import write_torch_zip
from tests.conftest import subprocess_env
from tests.fakes.recorders import EventRecorder

pytestmark = pytest.mark.integration
MiB = 1024 * 1024

# Commits checkpoint-2 of argv[2] to argv[1] at 4 MB/s: slow enough to be killed inside its upload.
UPLOADER = r"""
import sys
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan
from onbox.checkpoints.durable.rclone import RcloneTarget
from onbox.clock import SystemClock
remote, src = sys.argv[1], sys.argv[2]
target = RcloneTarget(remote, "r1", extra_flags=["--bwlimit", "4M"])
[cand] = [c for c in CompletionTracker(0.0).update(scan(src), 0.0, 0.0) if c.name == "checkpoint-2"]
CheckpointCommitter(target, "r1", SystemClock(), lambda *a, **k: None).commit(cand)
"""


def newest(root):
    return [c for c in CompletionTracker(0.0).update(scan(root), 0.0, 0.0) if c.complete][-1]


def hidden_temps(root: str):
    """The server's files for uploads in flight (`.rclone_temp_*`, out of every listing): {path: bytes}."""
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
            if f.startswith(".rclone_temp_")}


def open_uploads(s3, remote: str):
    r = s3.rclone("backend", "list-multipart-uploads", remote)
    assert r.returncode == 0, r.stderr
    return [u["Key"] for uploads in json.loads(r.stdout or "{}").values() for u in uploads or []]


def test_a_multipart_upload_killed_half_way_is_never_a_checkpoint_and_the_next_commit_aborts_it(tmp_path, s3):
    # rclone uploads in parts above its upload cutoff (200 MiB by default): lowered on this remote, a 24 MB file
    # goes up in 5 MiB parts
    remote = s3.remote_with("onboxs3mp", upload_cutoff="5M", chunk_size="5M")
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-1", "model.pt"))
    assert CheckpointCommitter(RcloneTarget(remote, "r1"), "r1", SystemClock(), EventRecorder()).commit(
        newest(src)).status == "committed"
    write_torch_zip(os.path.join(src, "checkpoint-2", "model.pt"), payload=os.urandom(24 * 1000 * 1000))
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, remote, src], env=subprocess_env(),
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial_dir = os.path.join(s3.durable_root, "r1", "checkpoints", "checkpoint-2")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None and \
                max(hidden_temps(partial_dir).values(), default=0) < 6 * MiB:
            time.sleep(0.05)  # more than one part streamed into the server's temp object
        assert proc.poll() is None, "the upload ended before the kill: %s" % proc.communicate()[1]
        os.killpg(proc.pid, signal.SIGKILL)  # the committer and its rclone, mid-upload
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    # what a reader sees: the marker and nothing else (a part of an object never shows), no manifest
    there = s3.rclone("lsjson", "-R", "--files-only", remote + "/r1/checkpoints/checkpoint-2")
    assert [e["Path"] for e in json.loads(there.stdout)] == [".onbox-partial"], there.stdout + there.stderr
    reader = CheckpointCommitter(RcloneTarget(remote, "r1"), "r1", SystemClock(), EventRecorder())
    assert [e["name"] for e in reader.committed()] == ["checkpoint-1"]
    assert reader.target.read_manifest("checkpoint-2") is None
    # what the server keeps of it: the open upload, its parts so far in a hidden file
    assert open_uploads(s3, remote + "/r1") == ["dur/r1/checkpoints/checkpoint-2/model.pt"]
    assert hidden_temps(partial_dir)
    # the next commit aborts it with the leftover (a bucket's lifecycle rule would only after days) and commits
    emit = EventRecorder()
    nxt = CheckpointCommitter(RcloneTarget(remote, "r1"), "r1", SystemClock(), emit)
    assert nxt.commit(newest(src)).status == "committed"
    assert emit.of("checkpoint_leftovers_cleaned")[0]["removed"] == ["checkpoint-2"]
    assert open_uploads(s3, remote + "/r1") == []
    assert hidden_temps(s3.durable_root) == {}
    assert sorted(os.listdir(partial_dir)) == [MANIFEST, "model.pt"] and verify_path(partial_dir).ok


DEBIAN_RCLONE = "/usr/bin/rclone"
SYSTEM_CA = "/etc/ssl/certs/ca-certificates.crt"


def test_an_old_rclone_that_fails_every_s3_call_under_aws_ca_bundle_is_named_with_what_to_do(
        tmp_path, s3, monkeypatch, onbox_home):
    if not os.access(DEBIAN_RCLONE, os.X_OK) or not os.path.isfile(SYSTEM_CA):
        pytest.skip("no Debian rclone at %s or no %s (make sysdeps installs both)" % (DEBIAN_RCLONE, SYSTEM_CA))
    monkeypatch.setenv("AWS_CA_BUNDLE", SYSTEM_CA)  # as these machines set it
    probe = subprocess.run([DEBIAN_RCLONE, "lsjson", s3.remote], capture_output=True, text=True, timeout=60)
    if "LoadCustomCABundleError" not in probe.stderr:
        pytest.skip("the rclone at %s runs S3 calls with AWS_CA_BUNDLE set: no trap to name" % DEBIAN_RCLONE)
    old_first = tmp_path / "old-rclone"
    old_first.mkdir()
    os.symlink(DEBIAN_RCLONE, old_first / "rclone")
    monkeypatch.setenv("PATH", "%s%s%s" % (old_first, os.pathsep, os.environ["PATH"]))
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-1", "model.pt"))
    r = subprocess.run([sys.executable, "-m", "onbox", "sync", "r1", "--now", "--durable", s3.remote, "--ckpt-dir",
                        src], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "AWS_CA_BUNDLE" in r.stderr and "old rclone" in r.stderr and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(SyncFailed) as e:
        CheckpointCommitter(RcloneTarget(s3.remote, "r1"), "r1", SystemClock(), EventRecorder()).commit(newest(src))
    assert "env -u AWS_CA_BUNDLE" in (e.value.hint or "") and "rclone.org/install" in (e.value.hint or "")
    assert not os.path.exists(os.path.join(s3.durable_root, "r1", "checkpoints"))  # nothing half-written
    # what the hint says works: the same rclone, AWS_CA_BUNDLE unset
    monkeypatch.delenv("AWS_CA_BUNDLE")
    com = CheckpointCommitter(RcloneTarget(s3.remote, "r1"), "r1", SystemClock(), EventRecorder())
    assert com.commit(newest(src)).status == "committed"
    assert verify_path(os.path.join(s3.durable_root, "r1", "checkpoints", "checkpoint-1")).ok
