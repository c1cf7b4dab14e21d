"""Crash consistency of the committer: the committing process is SIGKILLed at random points, 240 times.

Half the trials kill at a chosen step of the protocol (before a file, before the staging rename, after it, before
the manifest, after it: hashcopy.fault_hook), half after a random delay (which also lands inside fsyncs, the
manifest's atomic write, the index write and retention). After every kill a reader of the durable dir sees only
complete, hash-correct checkpoints; the previous ones are intact; and the next run finishes the commit.
The committer runs in a forked child (milliseconds each) so 240 trials stay within a few seconds.
"""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from onbox import fsutil
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import hashcopy
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan
from onbox.checkpoints.verify import check_manifest_files
from onbox.clock import SystemClock
from tests.checkpoint_files import write_safetensors, write_torch_zip

TRIALS = 240


def _noop(*_a, **_k):
    return None


def _write_checkpoint(root: str, step: int, rng: random.Random) -> str:
    d = os.path.join(root, "checkpoint-%d" % step)
    write_torch_zip(os.path.join(d, "model.pt"), payload=rng.randbytes(rng.randint(1, 64) * 1024))
    write_safetensors(os.path.join(d, "optimizer.safetensors"), {"m": rng.randint(1, 4096)})
    os.makedirs(os.path.join(d, "extra"), exist_ok=True)
    with open(os.path.join(d, "extra", "state.json"), "w") as f:
        f.write('{"step": %d}' % step)
    return "checkpoint-%d" % step


def _candidate(root: str, name: str):
    [c] = [c for c in CompletionTracker(0.0).update(scan(root), 0.0, 0.0) if c.name == name]
    assert c.complete, c.reason
    return c


def _reader_view(target: LocalPathTarget) -> dict:
    """What any reader sees: checkpoints with a manifest. Each must be complete and hash-correct."""
    seen = {}
    for name in target.list_names():
        m = target.read_manifest(name)
        if m is None:
            continue  # no manifest: does not exist for readers (an interrupted commit's leftover)
        problems = check_manifest_files(os.path.join(target.ckpts, name), m, formats_too=False)
        assert problems == [], "reader saw a torn checkpoint %s: %s" % (name, problems)
        seen[name] = m["digest"]
    index = target.read_index()
    if os.path.exists(os.path.join(target.run_root, "checkpoints_index.json")):
        assert index is not None, "checkpoints_index.json is torn"
        for e in index["checkpoints"]:
            assert e["name"] in seen, "index lists %s which has no manifest" % e["name"]
    return seen


def _commit_in_child(target, cand, kill_at: int) -> int:
    pid = os.fork()
    if pid == 0:  # the committing process
        try:
            calls = [0]

            def fault(label: str) -> None:
                calls[0] += 1
                if calls[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            hashcopy.fault_hook = fault if kill_at else None
            com = CheckpointCommitter(target, "r1", SystemClock(), _noop)
            com.commit(cand)
            com.apply_retention(keep_last=3)
            os._exit(0)
        except BaseException:
            os._exit(3)
    return pid


@pytest.mark.integration
@pytest.mark.slow
def test_sigkill_anywhere_never_exposes_a_torn_checkpoint(tmp_path):
    seed = int(os.environ.get("ONBOX_TEST_SEED", "20261121"))
    rng = random.Random(seed)
    src = str(tmp_path / "ckpt")
    target = LocalPathTarget(str(tmp_path / "durable"), "r1")
    # calibrate the random-delay kills on one full commit
    name = _write_checkpoint(src, 0, rng)
    labels = []
    hashcopy.fault_hook = labels.append  # count the labelled points of one commit
    try:
        t0 = time.monotonic()
        com = CheckpointCommitter(target, "r1", SystemClock(), _noop)
        com.commit(_candidate(src, name))
        full = time.monotonic() - t0
    finally:
        hashcopy.fault_hook = None
    assert {"before-file", "before-rename", "after-rename", "before-manifest", "after-manifest"} <= set(labels)
    fault_points = len(labels) + 1  # +1: sometimes the child finishes
    committed = {name: target.read_manifest(name)["digest"]}
    outcomes = {"killed": 0, "finished": 0}
    for trial in range(1, TRIALS + 1):
        name = _write_checkpoint(src, trial, rng)
        cand = _candidate(src, name)
        by_point = trial % 2 == 0
        pid = _commit_in_child(target, cand, rng.randint(1, fault_points) if by_point else 0)
        if not by_point:
            time.sleep(rng.uniform(0, 1.5 * full))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        assert killed or os.WEXITSTATUS(status) == 0, "trial %d (seed %d): committer failed" % (trial, seed)
        outcomes["killed" if killed else "finished"] += 1
        seen = _reader_view(target)
        # the two newest earlier checkpoints survive whatever retention the child ran (it keeps 3)
        for old in sorted(committed, key=lambda n: int(n.split("-")[1]))[-2:]:
            assert seen.get(old) == committed[old], "trial %d (seed %d): lost %s" % (trial, seed, old)
        # the next run cleans the leftovers and finishes the commit
        com = CheckpointCommitter(target, "r1", SystemClock(), _noop)
        r = com.commit(cand)
        com.apply_retention(keep_last=3)
        assert r.status in ("committed", "already")
        seen = _reader_view(target)
        assert name in seen
        assert not [n for n in os.listdir(target.ckpts) if n.startswith(".") or target.read_manifest(n) is None]
        committed = {n: d for n, d in seen.items()}
        import shutil

        shutil.rmtree(os.path.join(src, name))
    print("crash trials:", outcomes)
    assert outcomes["killed"] >= TRIALS // 3, outcomes  # most trials really died mid-commit
    assert len(fsutil.read_json(os.path.join(target.run_root, "checkpoints_index.json"))["checkpoints"]) == 3
