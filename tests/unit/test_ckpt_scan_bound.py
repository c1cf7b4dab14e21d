"""The checkpoint-dir scan is bounded (issue 19: `--ckpt-dir /` read every file of the machine for over a minute and
the agent did not answer SIGTERM): entries, depth and seconds; a dir past them is said once to be implausibly
large, is not walked again at every tick, and the hook's callers (restore, final) carry on with no candidate.
And what `onbox sync` says when there is nothing to commit."""
from __future__ import annotations

import os
import pathlib
from typing import List

import pytest

from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.local import detect
from onbox.checkpoints.local.detect import BoundedScan, CheckpointDirTooLarge, ScanBound, scan, walk_files
from onbox.config import RunConfig
from onbox.paths import CHECKPOINT_STATUS_FILE
from tests.checkpoint_files import write_torch_zip
from tests.fakes.run_context import run_context


def old_walk_files(top: str) -> List[str]:
    """walk_files as it was (os.walk), the reference for its order and what it leaves out."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for fn in sorted(filenames):
            full = os.path.join(dirpath, fn)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, top))
    return out


def tree(root, files: int = 0, depth: int = 0):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        (root / ("f%03d.bin" % i)).write_bytes(b"x")
    d = root
    for i in range(depth):
        d = d / ("level%d" % i)
        d.mkdir()
    (d / "deepest.bin").write_bytes(b"x")
    return root


class Ticking:
    """A monotonic clock that moves `step` seconds at each look."""

    def __init__(self, step: float) -> None:
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_walk_files_keeps_the_order_and_the_rules_of_os_walk(tmp_path):
    top = tmp_path / "ck"
    for rel in ("b/z.bin", "b/a/y.bin", "a.bin", "c/d/e/f.bin", "B/x.bin", "b/a/0.bin"):
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(b"1")
    (top / "link.bin").symlink_to(top / "a.bin")
    (top / "dirlink").symlink_to(top / "b")
    os.mkfifo(top / "fifo")
    (top / "empty").mkdir()
    assert walk_files(str(top)) == old_walk_files(str(top))
    assert walk_files(str(top / "nope")) == [] == old_walk_files(str(top / "nope"))


def test_a_dir_past_its_entries_is_too_large_and_nothing_of_it_is_returned(tmp_path):
    ck = tree(tmp_path / "ck" / "checkpoint-1", files=40).parent  # 1 entry in ck, 41 in checkpoint-1
    assert [c.name for c in scan(str(ck), ScanBound(entries=42))] == ["checkpoint-1"]
    with pytest.raises(CheckpointDirTooLarge) as e:
        scan(str(ck), ScanBound(entries=41))
    assert "implausibly large for checkpoints: more than 41 entries" in str(e.value)
    assert e.value.fields["bound"] == "entries" and e.value.fields["ckpt_dir"] == str(ck)


def test_a_flat_dir_of_many_names_stops_while_it_is_read(tmp_path):
    ck = tree(tmp_path / "ck", files=1200)
    with pytest.raises(CheckpointDirTooLarge) as e:
        scan(str(ck), ScanBound(entries=300))
    assert 300 < e.value.fields["entries"] <= 300 + detect.TIME_CHECK_EVERY  # not all 1,201 read first


def test_a_dir_past_its_depth_is_too_large(tmp_path):
    ck = tmp_path / "ck"
    tree(ck / "run", depth=5)
    assert len(scan(str(ck), ScanBound(depth=6))) == 1
    with pytest.raises(CheckpointDirTooLarge, match="nested more than 5 levels deep"):
        scan(str(ck), ScanBound(depth=5))


def test_a_scan_past_its_seconds_stops(tmp_path):
    ck = tmp_path / "ck"
    for i in range(5):
        tree(ck / ("d%d" % i), files=3)
    assert len(scan(str(ck), ScanBound(seconds=100.0), now=Ticking(1.0))) == 5
    with pytest.raises(CheckpointDirTooLarge, match=r"not scanned within 3 s") as e:
        scan(str(ck), ScanBound(seconds=3.0), now=Ticking(1.0))
    assert e.value.fields["bound"] == "seconds"


def test_a_dir_found_too_large_is_said_once_and_not_walked_again_until_the_retry(tmp_path, monkeypatch):
    ck = tree(tmp_path / "ck" / "data", files=30).parent
    clock = [0.0]
    walks = []
    real_scan = detect.scan
    monkeypatch.setattr(detect, "scan", lambda *a, **k: walks.append(1) or real_scan(*a, **k))
    scans = BoundedScan(str(ck), ScanBound(entries=10), now=lambda: clock[0])
    with pytest.raises(CheckpointDirTooLarge) as first:
        scans.scan()
    assert first.value.first and scans.failed is first.value
    clock[0] += detect.SCAN_RETRY_S - 1
    with pytest.raises(CheckpointDirTooLarge) as again:
        scans.scan()
    assert not again.value.first and str(again.value) == str(first.value) and len(walks) == 1
    clock[0] += 1
    with pytest.raises(CheckpointDirTooLarge) as rewalked:
        scans.scan()
    assert not rewalked.value.first and len(walks) == 2  # walked again, still too large: already said
    for f in (ck / "data").iterdir():  # the user cleaned up
        f.unlink()
    (ck / "data").rmdir()
    clock[0] += detect.SCAN_RETRY_S
    assert scans.scan() == [] and scans.failed is None


def test_the_hook_says_it_once_and_restore_and_final_carry_on(tmp_path):
    ctx = run_context(tmp_path, scan_max_entries=5, sync_interval=0.0)
    for i in range(10):
        write_torch_zip(os.path.join(ctx.ckpt_dir, "step_%d.pt" % i))
    hook = CheckpointCommitHook(ctx)
    assert hook.restore() is None  # no local candidate; durable has none either: a fresh start, no exception
    hook.periodic()
    ctx.clock.advance(2.0)
    hook.periodic()
    said = ctx.emit.of("checkpoint_dir_too_large")
    assert len(said) == 1 and said[0]["bound"] == "entries" and "implausibly large" in said[0]["error"]
    assert not ctx.emit.of("checkpoint_scan_failed")
    status = pathlib.Path(ctx.run_dir, CHECKPOINT_STATUS_FILE)
    assert "implausibly large" in status.read_text()
    assert hook.final(ctx.clock.monotonic() + 30) is None
    assert ctx.emit.of("final_sync_none")[-1]["reason"] == "no complete checkpoint"
    ctx.clock.advance(10 * ctx.config.sync_interval + 600)
    hook.periodic()  # "no checkpoint yet" must not replace what is true
    assert "implausibly large" in status.read_text()


def test_scan_knobs_are_run_config_fields_in_range():
    bound = ScanBound.of(RunConfig(scan_max_entries=7, scan_max_depth=2, scan_max_seconds=0.5).validate())
    assert bound == ScanBound(entries=7, depth=2, seconds=0.5)
    assert ScanBound.of(RunConfig()) == ScanBound()
    from onbox.errors import UsageError

    for key, bad in (("scan_max_entries", 0), ("scan_max_depth", 0), ("scan_max_seconds", float("inf"))):
        with pytest.raises(UsageError, match=key):
            RunConfig(**{key: bad}).validate()


# -- what `onbox sync` says when there is nothing to commit ------------------------------------------------------
def _sync(tmp_path, *args):
    from click.testing import CliRunner

    from onbox.commands.checkpoints import sync

    r = CliRunner().invoke(sync, ["r1", "--ckpt-dir", str(tmp_path / "ck"), "--durable", str(tmp_path / "dur"),
                                  *args], standalone_mode=False)
    assert r.exception is not None, r.output
    return r.exception.message, r.exception.hint


def test_sync_with_no_checkpoint_yet_says_the_trainer_must_write_one(tmp_path, onbox_home):
    (tmp_path / "ck").mkdir()
    message, hint = _sync(tmp_path, "--now")
    assert message == "nothing to commit for run r1: there is no checkpoint in %s yet" % (tmp_path / "ck")
    assert "--now" not in hint and "$ONBOX_CKPT_DIR" in hint and "must save one there first" in hint


def test_sync_of_a_checkpoint_still_being_written(tmp_path, onbox_home):
    from tests.checkpoint_files import truncate

    truncate(write_torch_zip(str(tmp_path / "ck" / "ckpt.pt")), 300)
    message, hint = _sync(tmp_path)
    assert "no complete checkpoint in" in message and "ckpt.pt: still being written" in message
    assert "or use --now" in hint
    message, hint = _sync(tmp_path, "--now")
    assert "--now" not in hint and hint.startswith("wait for the trainer to finish writing it")


def test_sync_of_a_dir_too_large_says_so(tmp_path, onbox_home):
    tree(tmp_path / "ck" / "data", files=20)
    run = onbox_home / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.json").write_text('{"name": "r1", "command": ["x"], "scan_max_entries": 5}')
    message, hint = _sync(tmp_path, "--now")
    assert "implausibly large" in message and "checkpoints only" in hint
