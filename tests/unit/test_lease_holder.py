"""The checkpoint hook as its run's lease holder (holding.py), two boxes on one mounted durable dir and a fake
clock: manifests record their lease, restore keeps to the lineage and quarantines fenced orphans (never deletes
them), a fenced hook writes nothing at all, retention counts only the lineage, and local checkpoints of a
superseded timeline are kept aside."""
from __future__ import annotations

import os
from typing import Any, Dict, List

from onbox import fsutil
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.leases.fencing import RunLease
from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.supervisor.hooks import RunContext
from tests.checkpoint_files import write_torch_zip
from tests.fakes.recorders import EventRecorder as Recorder


class Box:
    def __init__(self, tmp, name: str, clock: FakeClock, **cfg: Any) -> None:
        self.durable = str(tmp / "durable")
        run_dir, ckpt = tmp / name / "run", tmp / name / "ckpt"
        run_dir.mkdir(parents=True)
        ckpt.mkdir(parents=True)
        config = RunConfig(name="r1", ckpt_dir=str(ckpt), durable=self.durable, sync_interval=5.0, settle_seconds=0.0,
                           **cfg)
        self.emit = Recorder()
        self.ctx = RunContext(name="r1", run_dir=str(run_dir), ckpt_dir=str(ckpt), config=config, clock=clock,
                              emit=self.emit, attempt=lambda: 0)
        self.clock = clock
        self.box = "%s-0000000%s" % (name, name[-1])
        self.hook: Any = None
        self.lease: Any = None

    def take(self, take_over: bool = False) -> "Box":
        target = LocalPathTarget(self.durable, "r1")
        reader = CheckpointCommitter(target, "r1", self.clock, lambda *a, **k: None)
        self.lease = RunLease.take(target, "r1", 30.0, take_over, self.clock, reader.committed, 1.0,
                                   host=self.box, box=self.box, pid=1, start_time=1, alive=lambda p, s: True)
        self.hook = CheckpointCommitHook(self.ctx, lease=self.lease)
        self.lease.attach(self.emit, self.hook.lease_changed)
        return self

    def save(self, step: int) -> str:
        return write_torch_zip(os.path.join(self.ctx.ckpt_dir, "step_%03d.pt" % step), payload=bytes([step]) * 4096)

    def commit(self, step: int) -> Any:
        self.save(step)
        cands = self.hook.scan_now(settle=0.0)
        return self.hook.commit_one(cands[-1])


def committed(durable: str) -> Dict[str, Dict[str, Any]]:
    root = os.path.join(durable, "r1", "checkpoints")
    return {n: fsutil.read_json(os.path.join(root, n, "MANIFEST.json")) for n in sorted(os.listdir(root))
            if os.path.isfile(os.path.join(root, n, "MANIFEST.json"))}


def quarantined(durable: str) -> List[str]:
    root = os.path.join(durable, "r1", "quarantine")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def test_manifests_and_index_entries_record_the_lease_they_were_committed_under(tmp_path):
    a = Box(tmp_path, "a1", FakeClock()).take()
    assert a.commit(1).status == "committed"
    m = committed(a.durable)["step_001.pt"]
    assert (m["epoch"], m["holder"]) == (1, a.lease.holder)
    [entry] = fsutil.read_json(os.path.join(a.durable, "r1", "checkpoints_index.json"))["checkpoints"]
    assert (entry["epoch"], entry["holder"]) == (1, a.lease.holder)
    status = fsutil.read_json(os.path.join(a.ctx.run_dir, "checkpoint_status.json"))
    assert status["lease"]["epoch"] == 1 and status["lease"]["holder"] == a.lease.holder


def test_a_fenced_hook_writes_nothing_more(tmp_path):
    clock = FakeClock()
    a = Box(tmp_path, "a1", clock).take()
    a.commit(1)
    b = Box(tmp_path, "b2", clock).take(take_over=True)
    before = sorted(os.listdir(os.path.join(a.durable, "r1", "checkpoints")))
    index = fsutil.read_json(os.path.join(a.durable, "r1", "checkpoints_index.json"))
    assert a.commit(2) is None  # refused at its first write (the payload): nothing lands
    assert sorted(os.listdir(os.path.join(a.durable, "r1", "checkpoints"))) == before
    assert fsutil.read_json(os.path.join(a.durable, "r1", "checkpoints_index.json")) == index
    [fenced] = a.emit.of("fenced")
    assert fenced["newer_holder"] == b.lease.holder and not a.emit.of("sync_failed")
    assert a.hook.fenced()["newer_epoch"] == 2
    assert a.hook.final(clock.monotonic() + 60) is None
    assert a.emit.of("final_sync_none")[-1]["reason"].startswith("fenced")
    a.hook.periodic()  # nothing is started
    assert a.hook.scheduler.worker is None
    status = fsutil.read_json(os.path.join(a.ctx.run_dir, "checkpoint_status.json"))
    assert status["fenced"]["newer_holder"] == b.lease.holder


def test_restore_keeps_to_the_lineage_and_quarantines_a_race_window_orphan(tmp_path):
    clock = FakeClock()
    a = Box(tmp_path, "a1", clock).take()
    a.commit(1)
    clock.advance(1)
    a.commit(2)
    b = Box(tmp_path, "b2", clock).take(take_over=True)
    # agent 1's commit whose lease check passed before agent 2's take: its manifest lands after it
    late = CheckpointCommitter(LocalPathTarget(a.durable, "r1"), "r1", clock, lambda *k, **f: None,
                               stamp=lambda: {"epoch": 1, "holder": a.lease.holder})
    a.save(3)
    clock.advance(1)
    cand = a.hook.scan_now(settle=0.0)[-1]
    assert late.commit(cand).status == "committed" and "step_003.pt" in committed(a.durable)
    path = b.hook.restore()
    assert os.path.basename(path) == "step_002.pt"  # not the newer orphan
    assert "step_003.pt" not in committed(a.durable)
    [moved] = quarantined(a.durable)
    assert moved.startswith("step_003.pt.")  # whole, with its manifest: never deleted
    assert os.path.isfile(os.path.join(a.durable, "r1", "quarantine", moved, "MANIFEST.json"))
    [q] = b.emit.of("checkpoint_quarantined")
    assert "fenced orphan" in q["reason"] and q["epoch"] == 1
    lease_doc = fsutil.read_json(os.path.join(a.durable, "r1", "leases", b.lease.mine.name))
    assert lease_doc["resumed_from"] == "step_002.pt" and lease_doc["base"] == ["step_001.pt", "step_002.pt"]


def test_retention_counts_only_the_lineage(tmp_path):
    """keep_last=1 retires this holder's older checkpoints; one outside its lineage (here a newer epoch's, which
    a holder does not judge) is neither counted nor retired."""
    clock = FakeClock()
    b = Box(tmp_path, "b2", clock, keep_last=1).take()
    b.commit(1)
    clock.advance(1)
    other = CheckpointCommitter(LocalPathTarget(b.durable, "r1"), "r1", clock, lambda *k, **f: None,
                                stamp=lambda: {"epoch": 9, "holder": "zz-00000000-00000000"})
    b.save(5)
    assert other.commit(b.hook.scan_now(settle=0.0)[-1]).status == "committed"
    clock.advance(1)
    b.commit(7)
    assert sorted(committed(b.durable)) == ["step_005.pt", "step_007.pt"]
    assert not quarantined(b.durable)


def test_local_checkpoints_of_a_superseded_timeline_are_kept_aside_at_the_first_restore(tmp_path):
    """Box b held the run (epoch 1), box a took it over (epoch 2) and committed step 2; now b takes it back
    (epoch 3): b's local step 9, written under epoch 1 after the takeover, is another timeline."""
    clock = FakeClock()
    b_old = Box(tmp_path, "b1", clock).take()
    b_old.commit(1)
    b_old.save(9)  # saved by the trainer of epoch 1 after it was superseded, never committed
    clock.advance(1)
    a = Box(tmp_path, "a2", clock).take(take_over=True)
    a.commit(2)
    b = Box.__new__(Box)
    b.__dict__.update(b_old.__dict__)
    b.emit = Recorder()
    b.ctx.emit = b.emit
    b.take(take_over=True)
    assert not b.lease.lineage.local_ok
    path = b.hook.restore()
    assert os.path.basename(path) == "step_002.pt"
    aside = os.listdir(os.path.join(b.ctx.ckpt_dir, ".onbox-aside"))
    assert any(n.startswith("step_009.pt") for n in aside)
    assert "older lease" in b.emit.of("checkpoint_set_aside")[0]["reason"]
