"""Completeness without a format rule (issue 32, item 1): a file of any name the trainer renames into the checkpoint
dir, or closes after writing, is complete at once where inotify is there (a real rename, a real close, seen by a
real inotify watch); without a watch, stability across scans decides. And a checkpoint goes back where the
framework reads it (item 3): a TensorFlow save's files and the state file naming them."""
from __future__ import annotations

import json
import os
import time

import pytest

from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import scan
from onbox.checkpoints.local.watch import DirWatch
from tests.checkpoint_files import torch_zip_bytes
from tests.fakes.run_context import run_context
from tests.unit.test_ckfmt_formats import tf_save

pytestmark = pytest.mark.skipif(not DirWatch("/").available, reason="no inotify on this machine")


def judge(tr: CompletionTracker, ck, later: float = 0.0):
    return {c.name: c for c in tr.update(scan(str(ck)), time.monotonic() + later, time.time() + later)}


def test_a_file_of_any_name_renamed_into_the_dir_is_complete_at_once(tmp_path):
    """A trainer of its own: step_000800.yaml written under a temp name and renamed; no format knows .yaml."""
    ck = tmp_path / "ck"
    ck.mkdir()
    watch = DirWatch(str(ck))
    tr = CompletionTracker(settle_seconds=600.0, watch=watch)
    (ck / "step_000800.yaml.tmp").write_text("step: 800\n")
    assert judge(tr, ck) == {}  # a temp name is never a candidate
    os.rename(str(ck / "step_000800.yaml.tmp"), str(ck / "step_000800.yaml"))
    c = judge(tr, ck)["step_000800.yaml"]
    assert (c.complete, c.complete_by, c.step) == (True, "renamed", 800), c.reason
    with open(str(ck / "step_000800.yaml"), "a") as f:  # written again in place: no longer finished
        f.write("more: 1\n")
        f.flush()
        c = judge(tr, ck)["step_000800.yaml"]
        assert not c.complete and c.reason.startswith("still changing")


def test_a_file_closed_after_writing_and_left_alone_is_complete_and_one_still_open_is_not(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    tr = CompletionTracker(settle_seconds=600.0, watch=DirWatch(str(ck)))
    with open(str(ck / "weights.raw"), "wb") as f:
        f.write(os.urandom(4096))
        f.flush()
        c = judge(tr, ck)["weights.raw"]
        assert not c.complete and "still changing" in c.reason  # open for writing: no close seen yet
    c = judge(tr, ck)["weights.raw"]
    assert (c.complete, c.complete_by) == (True, "closed"), c.reason


def test_a_directory_renamed_into_place_is_complete_and_one_made_in_place_waits_for_quiet(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    tr = CompletionTracker(settle_seconds=600.0, watch=DirWatch(str(ck)))
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "blob.raw").write_bytes(os.urandom(100))
    (ck / "inplace").mkdir()
    (ck / "inplace" / "blob.raw").write_bytes(os.urandom(100))
    os.rename(str(tmp_path / "staging"), str(ck / "step_7"))
    got = judge(tr, ck)
    assert (got["step_7"].complete, got["step_7"].complete_by) == (True, "renamed")
    assert not got["inplace"].complete and "still changing" in got["inplace"].reason
    got = judge(tr, ck, later=601.0)
    assert (got["inplace"].complete, got["inplace"].complete_by) == (True, "quiescent")


def test_a_known_layout_is_never_completed_by_its_rename(tmp_path):
    """An HF checkpoint dir renamed into place without trainer_state.json stays incomplete: resuming fails."""
    ck = tmp_path / "ck"
    ck.mkdir()
    tr = CompletionTracker(settle_seconds=0.0, watch=DirWatch(str(ck)))
    staging = tmp_path / "checkpoint-9"
    staging.mkdir()
    (staging / "training_args.bin").write_bytes(torch_zip_bytes())
    os.rename(str(staging), str(ck / "checkpoint-9"))
    c = judge(tr, ck, later=3600)["checkpoint-9"]
    assert not c.complete and c.reason.startswith("hf-trainer: no trainer_state.json")


def test_without_inotify_stability_across_scans_decides(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    tr = CompletionTracker(settle_seconds=5.0, watch=None)
    (ck / "x.tmp").write_text("a: 1\n")
    os.rename(str(ck / "x.tmp"), str(ck / "state.yaml"))
    t0 = time.monotonic()
    c = tr.update(scan(str(ck)), t0, time.time())[0]
    assert not c.complete
    c = tr.update(scan(str(ck)), t0 + 5.0, time.time())[0]
    assert (c.complete, c.complete_by) == (True, "quiescent")


def test_a_tensorflow_save_goes_back_with_the_state_file_naming_it(tmp_path):
    durable = str(tmp_path / "durable")
    box1 = run_context(tmp_path / "box1", durable=durable, settle_seconds=0.0)
    tf_save(box1.ckpt_dir, "ckpt-1")
    tf_save(box1.ckpt_dir, "ckpt-2", shards=2)
    hook = CheckpointCommitHook(box1)
    newest = hook.scan_now()[-1]
    assert (newest.name, newest.format) == ("ckpt-2", "tf-checkpoint")
    assert hook.commit_one(newest).status == "committed"
    with open(os.path.join(durable, box1.name, "checkpoints", "ckpt-2", "MANIFEST.json")) as f:
        manifest = json.load(f)
    assert (manifest["kind"], manifest["local_name"], len(manifest["files"])) == ("files", "ckpt-2", 3)
    box2 = run_context(tmp_path / "box2", durable=durable, settle_seconds=0.0)  # a replacement box, same durable
    path = CheckpointCommitHook(box2).restore()
    assert path == os.path.join(box2.ckpt_dir, "ckpt-2")  # ONBOX_RESUME_FROM: the prefix tf.train reads
    assert sorted(os.listdir(box2.ckpt_dir)) == ["checkpoint", "ckpt-2.data-00000-of-00002",
                                                 "ckpt-2.data-00001-of-00002", "ckpt-2.index"]
    with open(os.path.join(box2.ckpt_dir, "checkpoint")) as f:
        assert f.read().splitlines()[0] == 'model_checkpoint_path: "ckpt-2"'
    for name in os.listdir(box2.ckpt_dir):
        if name != "checkpoint":
            with open(os.path.join(box1.ckpt_dir, name), "rb") as a, open(os.path.join(box2.ckpt_dir, name), "rb") as b:
                assert a.read() == b.read()
