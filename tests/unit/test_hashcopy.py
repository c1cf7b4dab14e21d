"""The copy+hash of one file (hashcopy.copy_and_hash) on real files, and the split a commit records (steptimes.py)."""
from __future__ import annotations

import os

from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import hashcopy, steptimes
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.clock import FakeClock
from tests.checkpoint_files import complete_cands, write_torch_zip
from tests.fakes.recorders import EventRecorder

CHUNK = 64 * 1024


def test_a_source_cut_short_while_copied_gives_a_short_copy_described_by_its_hash(tmp_path, monkeypatch):
    # nanoGPT's torch.save reopens ckpt.pt with O_TRUNC while the agent may be copying it: the copy ends short, with
    # the hash of what landed (the commit then finds the size short and the source changed, and looks again)
    monkeypatch.setattr(hashcopy, "CFR_CHUNK", CHUNK)
    monkeypatch.setattr(hashcopy, "WRITEBACK_EVERY", CHUNK)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(os.urandom(4 * CHUNK))

    def trainer_saves_again(label):
        if label == "copy-chunk":
            os.truncate(str(src), CHUNK // 2)

    hashcopy.fault_hook = trainer_saves_again
    try:
        size, digest = hashcopy.copy_and_hash(str(src), str(dst))
    finally:
        hashcopy.fault_hook = None
    assert size == CHUNK and (size, digest) == hashcopy.hash_file(str(dst))


def test_a_commit_records_where_its_time_went_and_its_event_carries_it(tmp_path):
    write_torch_zip(str(tmp_path / "ck" / "checkpoint-5" / "model.pt"), payload=os.urandom(200_000))
    emit = EventRecorder()
    com = CheckpointCommitter(LocalPathTarget(str(tmp_path / "dur"), "r1"), "r1", FakeClock(), emit)
    [cand] = complete_cands(str(tmp_path / "ck"))
    assert com.commit(cand).status == "committed"
    com.apply_retention(keep_last=2)
    steps = {"look-up", "fingerprint", "preflight", "lease checks", "copy+hash", "fsync files", "fsync dirs",
             "rename", "manifest", "index"}
    assert set(com.last_phases.seconds) == steps | {"format check", "retention"}
    assert all(s >= 0 for s in com.last_phases.seconds.values())
    [ev] = emit.of("checkpoint_committed")
    assert steps <= set(ev["phases"]) and "retention" not in ev["phases"]  # retention comes after the event
    with steptimes.phase("outside a commit"):  # records nowhere, runs its block
        pass
    assert "outside a commit" not in com.last_phases.seconds


def test_no_environment_variable_plants_a_fault_hook_in_a_real_agent(tmp_path):
    """The fault point is a seam tests set in the process (hashcopy.fault_hook), never read from the environment: a
    variable left in a box's environment must not pause a real agent's commits (it used to: ONBOX_TEST_PAUSE_AT)."""
    import subprocess
    import sys

    gate = str(tmp_path / "gate")
    code = "from onbox.checkpoints.durable import hashcopy; hashcopy.fault_point('before-manifest'); " \
           "print(hashcopy.fault_hook)"
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ONBOX_TEST_PAUSE_AT="before-manifest:1:"
                                                              + gate), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
    assert not os.path.exists(gate + ".waiting")
