"""Crash consistency of commits to an S3 API (tests/hosts/s3.py): the committing process and its rclone are
SIGKILLed at random points of a commit (and of the retention after it), TRIALS times.

Half the trials kill at a labelled step (before the upload, before the manifest, after it: hashcopy.fault_hook),
half after a random delay (inside the marker's upload, the payload's, the verify listing, the manifest's sync, the
index write, a retired checkpoint's deletion). After every kill, what a reader of the bucket sees is only complete,
hash-correct checkpoints, the previous ones intact, an index that names none without a manifest; the next commit
cleans what the killed one left and completes. The committer runs in a forked child that leads a process group of
its own, so the kill takes its rclone with it (a box that dies takes everything). Each trial costs two commits of
~10 rclone calls, so there are fewer trials than test_ckpt_crash.py's 240 on a mounted path.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time

import pytest

from onbox.checkpoints import MANIFEST
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import hashcopy
from onbox.checkpoints.durable.rclone import RcloneTarget
from onbox.checkpoints.verify import check_manifest_files
from onbox.clock import SystemClock
from tests.integration.test_ckpt_crash import _candidate, _noop, _write_checkpoint
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TRIALS = int(os.environ.get("ONBOX_TEST_S3_CRASH_TRIALS", "12"))


def _commit_in_child(remote: str, cand, kill_at: int) -> int:
    pid = os.fork()
    if pid == 0:  # the committing process, leader of a group its rclone children join
        try:
            os.setpgid(0, 0)
            calls = [0]

            def fault(label: str) -> None:
                calls[0] += 1
                if calls[0] == kill_at:
                    os.killpg(0, signal.SIGKILL)

            hashcopy.fault_hook = fault if kill_at else None
            com = CheckpointCommitter(RcloneTarget(remote, "r1"), "r1", SystemClock(), _noop)
            com.commit(cand)
            com.apply_retention(keep_last=3)
            os._exit(0)
        except BaseException:
            os._exit(3)
    try:
        os.setpgid(pid, pid)  # also from here: the group exists before the parent may signal it
    except OSError:
        pass  # the child did it first (or already ended)
    return pid


def _reader_view(run_root: str) -> dict:
    """What a reader of the bucket sees (the server's files, less its hidden temps of uploads in flight, which no
    listing shows): checkpoints with a manifest, each complete and hash-correct, and an index naming only those."""
    ckpts = os.path.join(run_root, "checkpoints")
    seen = {}
    for name in sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else []:
        path = os.path.join(ckpts, name, MANIFEST)
        if not os.path.isfile(path):
            continue  # no manifest: does not exist for readers
        with open(path) as f:
            m = json.load(f)
        problems = check_manifest_files(os.path.join(ckpts, name), m, formats_too=False)
        assert problems == [], "a reader saw a torn checkpoint %s: %s" % (name, problems)
        seen[name] = m["digest"]
    index = os.path.join(run_root, "checkpoints_index.json")
    if os.path.exists(index):
        with open(index) as f:
            doc = json.load(f)  # never torn: an object appears whole
        for e in doc["checkpoints"]:
            assert e["name"] in seen, "the index lists %s, which has no manifest" % e["name"]
    return seen


def test_sigkill_anywhere_in_a_commit_to_s3_never_exposes_a_torn_checkpoint(tmp_path, s3):
    seed = int(os.environ.get("ONBOX_TEST_SEED", "20261128"))
    rng = random.Random(seed)
    src = str(tmp_path / "ckpt")
    run_root = os.path.join(s3.durable_root, "r1")
    name = _write_checkpoint(src, 0, rng)
    labels = []
    hashcopy.fault_hook = labels.append  # count the labelled points of one commit, and time it
    try:
        t0 = time.monotonic()
        CheckpointCommitter(RcloneTarget(s3.remote, "r1"), "r1", SystemClock(), _noop).commit(_candidate(src, name))
        full = time.monotonic() - t0
    finally:
        hashcopy.fault_hook = None
    assert {"before-upload", "before-manifest", "after-manifest"} <= set(labels)
    committed = dict(_reader_view(run_root))
    outcomes = {"killed": 0, "finished": 0}
    for trial in range(1, TRIALS + 1):
        name = _write_checkpoint(src, trial, rng)
        cand = _candidate(src, name)
        by_point = trial % 2 == 0
        pid = _commit_in_child(s3.remote, cand, rng.randint(1, len(labels) + 1) if by_point else 0)
        if not by_point:
            time.sleep(rng.uniform(0, 1.2 * full))
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it finished first
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        assert killed or os.WEXITSTATUS(status) == 0, "trial %d (seed %d): the committer failed" % (trial, seed)
        outcomes["killed" if killed else "finished"] += 1
        seen = _reader_view(run_root)
        for old in sorted(committed, key=lambda n: int(n.split("-")[1]))[-2:]:  # retention keeps 3
            assert seen.get(old) == committed[old], "trial %d (seed %d): lost %s" % (trial, seed, old)
        # the next run cleans what the killed one left and finishes the commit
        com = CheckpointCommitter(RcloneTarget(s3.remote, "r1"), "r1", SystemClock(), _noop)
        assert com.commit(cand).status in ("committed", "already")
        com.apply_retention(keep_last=3)
        seen = _reader_view(run_root)
        assert name in seen
        left = [n for n in os.listdir(os.path.join(run_root, "checkpoints")) if n not in seen]
        assert not left, "trial %d (seed %d): left over %s" % (trial, seed, left)
        committed = dict(seen)
        shutil.rmtree(os.path.join(src, name))
    print("S3 crash trials:", outcomes)
    assert outcomes["killed"] >= TRIALS // 3, outcomes  # most trials really died mid-commit
    with open(os.path.join(run_root, "checkpoints_index.json")) as f:
        assert len(json.load(f)["checkpoints"]) == 3
    # what the killed uploads left on the server (a temp file each, out of listings) is gone with their requests
    wait_for(lambda: not [f for d, _, fs in os.walk(s3.durable_root) for f in fs if f.startswith(".rclone_temp_")],
             timeout=10, what="the server's temps of killed uploads to go")
