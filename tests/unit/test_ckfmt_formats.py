"""The formats onbox recognises beyond torch (issue 32, item 1): each one's structural check passes a whole file the
framework wrote and refuses the same file cut short, and each one's names, completion rule and step. Real files
of the frameworks where the project's own venv cannot make them (tests/fixtures/ckfmt/README.md says how they were
written); numpy and pickle files are written here."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import time

import numpy as np
import pytest

from onbox.checkpoints import formats
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import Selection, scan

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "ckfmt")


def cut(path: str, keep_fraction: float = 0.6) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep_fraction)])


def make(tmp_path, name: str) -> str:
    """A whole file of the format `name` stands for, in tmp_path."""
    p = str(tmp_path / name)
    if name.endswith(".npy"):
        np.save(p, np.arange(600, dtype=np.float32).reshape(20, 30))
    elif name.endswith(".npz"):
        np.savez(p, w=np.ones((40, 40)), step=np.array(7))
    elif name.endswith((".pkl", ".joblib")):
        with open(p, "wb") as f:
            pickle.dump({"step": 3, "w": list(range(2000))}, f, protocol=4)
    elif name.endswith(".json"):
        with open(p, "w") as f:
            json.dump({"step": 800, "w": list(range(100))}, f)
    else:
        shutil.copy(os.path.join(FIXTURES, name), p)
    return p


@pytest.mark.parametrize("name,kind", [("a.npy", "npy"), ("b.npz", "npz"), ("model.keras", "keras"),
                                       ("latest.weights.h5", "hdf5"), ("model_1.ubj", "xgboost-ubj"),
                                       ("s.pkl", "pickle"), ("m.joblib", "pickle"), ("state_000800.json", "json")])
def test_a_whole_file_passes_and_the_same_file_cut_short_is_torn(tmp_path, name, kind):
    p = make(tmp_path, name)
    assert formats.check_file(p) == formats.FormatResult(kind, None)
    assert formats.check_file(p, full=True).ok
    cut(p)
    res = formats.check_file(p)
    assert res.kind == kind and res.problem, res


def test_a_file_still_growing_past_its_hdf5_end_of_file_address_is_not_whole(tmp_path):
    p = make(tmp_path, "latest.weights.h5")
    with open(p, "ab") as f:
        f.write(b"\0" * 100)  # HDF5 writes the address at its close: bytes past it are a write under way
    assert "still being written" in formats.check_file(p).problem


def test_an_npy_file_longer_than_its_header_says_is_refused_and_a_unicode_array_is_sized(tmp_path):
    p = str(tmp_path / "u.npy")
    np.save(p, np.array(["ab", "cdef"]))
    assert formats.check_file(p).ok
    with open(p, "ab") as f:
        f.write(b"x")
    assert "past its array" in formats.check_file(p).problem


def test_a_pickle_of_protocol_0_has_no_end_to_check_and_says_so(tmp_path):
    p = str(tmp_path / "old.pkl")
    with open(p, "wb") as f:
        pickle.dump({"a": 1}, f, protocol=0)
    res = formats.check_file(p)
    assert res.ok and "only its hash" in res.note


@pytest.mark.parametrize("name", ["a.npy", "b.npz", "model.keras", "latest.weights.h5", "model_1.ubj", "s.pkl",
                                  "state_000800.json"])
def test_a_whole_file_of_a_self_checking_format_is_complete_at_once_and_a_torn_one_never(tmp_path, name):
    ck = tmp_path / "ck"
    ck.mkdir()
    p = make(ck, name)
    tr = CompletionTracker(settle_seconds=60.0)
    [c] = tr.update(scan(str(ck)), time.monotonic(), time.time())
    assert (c.complete, c.complete_by) == (True, "format"), c.reason
    cut(p)
    [c] = tr.update(scan(str(ck)), time.monotonic() + 3600, time.time() + 3600)  # however quiet
    assert not c.complete and c.reason.startswith("torn: ")


def test_steps_from_the_formats_own_records(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    make(ck, "state_000800.json")  # {"step": 800}: the content says it
    make(ck, "model_1.ubj")  # TrainingCheckPoint's iteration 1: two rounds boosted
    shutil.copy(os.path.join(FIXTURES, "model.keras"), str(ck / "model.07.keras"))  # ModelCheckpoint's {epoch:02d}
    got = {c.name: (c.step, c.step_source) for c in CompletionTracker(0.0).update(
        scan(str(ck)), time.monotonic(), time.time())}
    assert got["state_000800.json"] == (800, "state_000800.json:step")
    assert got["model_1.ubj"] == (2, "name (xgboost-ubj)")
    assert got["model.07.keras"] == (7, "name (keras)")


def orbax_step(root, name: str, committed: bool = True) -> str:
    """The dir an Orbax CheckpointManager leaves for one step (orbax-checkpoint 0.12, as in /tmp probes)."""
    d = os.path.join(str(root), name)
    os.makedirs(os.path.join(d, "default", "ocdbt.process_0", "d"))
    with open(os.path.join(d, "default", "_METADATA"), "w") as f:
        f.write("{}")
    with open(os.path.join(d, "default", "ocdbt.process_0", "d", "0a1b"), "wb") as f:
        f.write(os.urandom(4096))
    meta = {"item_handlers": {}, "init_timestamp_nsecs": 1, "commit_timestamp_nsecs": 2 if committed else None}
    with open(os.path.join(d, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump(meta, f)
    if committed:
        with open(os.path.join(d, "commit_success.txt"), "w") as f:
            f.write("Checkpoint commit was successful")
    return d


def test_an_orbax_tmp_dir_is_never_a_candidate_and_a_committed_step_is_complete_by_its_own_rule(tmp_path):
    """Observed: an async save preempted midway left `100.orbax-checkpoint-tmp`, onbox committed it after 2 s of
    quiet and the replacement box restored it; Orbax ignored it and trained from step 1."""
    ck = tmp_path / "ck"
    orbax_step(ck, "100")
    orbax_step(ck, "200.orbax-checkpoint-tmp", committed=False)
    orbax_step(ck, "300.orbax-checkpoint-tmp-1764660000", committed=False)
    orbax_step(ck, "400", committed=False)  # renamed but its metadata holds no commit time (an older Orbax)
    cands = {c.name: c for c in CompletionTracker(settle_seconds=0.0).update(
        scan(str(ck)), time.monotonic() + 3600, time.time() + 3600)}
    assert set(cands) == {"100", "400"}
    assert (cands["100"].complete, cands["100"].complete_by, cands["100"].format) == (True, "format", "orbax")
    assert (cands["100"].step, cands["100"].step_source) == (100, "name (the Orbax step)")
    assert not cands["400"].complete and "not committed yet" in cands["400"].reason  # never by quiet


def keras_backup(root, epoch: int) -> str:
    d = os.path.join(str(root), "backup")
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(FIXTURES, "latest.weights.h5"), os.path.join(d, "latest.weights.h5"))
    with open(os.path.join(d, "training_metadata.json"), "w") as f:
        json.dump({"epoch": epoch, "batch": -1}, f)
    return d


def test_a_keras_backup_dir_is_complete_by_its_metadata_written_after_the_weights_not_by_quiet(tmp_path):
    """BackupAndRestore rewrites its dir every epoch (more often than any quiet period): its own signal, the
    metadata file written after the weights, completes it."""
    ck = tmp_path / "ck"
    d = keras_backup(ck, epoch=4)
    tr = CompletionTracker(settle_seconds=600.0)
    [c] = tr.update(scan(str(ck)), time.monotonic(), time.time())
    assert (c.complete, c.complete_by, c.format) == (True, "format", "keras-backup")
    assert (c.step, c.step_source) == (4, "training_metadata.json:epoch")  # epochs done (keras 3.15)
    # the next epoch: the weights rewritten, the metadata not yet
    shutil.copy(os.path.join(FIXTURES, "latest.weights.h5"), os.path.join(d, "latest.weights.h5"))
    os.utime(os.path.join(d, "training_metadata.json"), ns=(1, 1))
    [c] = tr.update(scan(str(ck)), time.monotonic() + 3600, time.time() + 3600)
    assert not c.complete and "older than latest.weights.h5" in c.reason


def tf_save(root, prefix: str, shards: int = 1, state: bool = True) -> None:
    for i in range(shards):
        with open(os.path.join(str(root), "%s.data-%05d-of-%05d" % (prefix, i, shards)), "wb") as f:
            f.write(os.urandom(1000))
    with open(os.path.join(str(root), prefix + ".index"), "wb") as f:
        f.write(os.urandom(200))
    if state:
        with open(os.path.join(str(root), "checkpoint"), "w") as f:
            f.write('model_checkpoint_path: "%s"\nall_model_checkpoint_paths: "%s"\n' % (prefix, prefix))


def test_a_tensorflow_save_is_one_candidate_of_its_index_and_shards_complete_once_the_state_file_names_it(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    tf_save(ck, "ckpt-3", shards=2)
    os.unlink(str(ck / "ckpt-3.data-00001-of-00002"))
    tr = CompletionTracker(settle_seconds=600.0)
    [c] = tr.update(scan(str(ck)), time.monotonic(), time.time())
    assert (c.name, c.group, c.complete) == ("ckpt-3", True, False) and "1 of 2 data shards" in c.reason
    tf_save(ck, "ckpt-3", shards=2)
    [c] = tr.update(scan(str(ck)), time.monotonic(), time.time())
    assert (c.complete, c.complete_by, c.format, c.step) == (True, "format", "tf-checkpoint", 3)
    assert c.files == ["ckpt-3.index", "ckpt-3.data-00000-of-00002", "ckpt-3.data-00001-of-00002"]


@pytest.mark.parametrize("name", ["train.log", "events.out.tfevents.1764.box", "sample_0003.png", "metrics.jsonl",
                                  ".hidden.json", "ckpt.json.tmp", "state.json.part", "tmp-checkpoint-5"])
def test_logs_events_samples_and_temp_names_are_never_candidates(tmp_path, name):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / name).write_text('{"step": 1}')
    assert scan(str(ck)) == []


def test_the_users_patterns_say_what_a_checkpoint_is_and_ignores_win(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    for n in ("state_1.json", "config.json", "notes.txt", "weights.bin.partial", "samples_1.json"):
        (ck / n).write_text("{}")
    names = lambda sel: sorted(c.name for c in scan(str(ck), select=sel))  # noqa: E731
    assert names(Selection()) == ["config.json", "samples_1.json", "state_1.json"]
    assert names(Selection(patterns=("state_*.json", "notes.txt"))) == ["notes.txt", "state_1.json"]
    assert names(Selection(ignore=("samples_*", "config.json"))) == ["state_1.json"]
    assert names(Selection(patterns=("*.json",), ignore=("samples_*",))) == ["config.json", "state_1.json"]
