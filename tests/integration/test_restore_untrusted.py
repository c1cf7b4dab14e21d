"""A hostile or damaged bucket against the real agent: a replacement box restores from durable storage whose
newest manifest lists a path out of the checkpoint dir, or whose manifests name a hash onbox cannot compute.

Box 1 (its own ONBOX_HOME and checkpoint dir) trains to step 10 and commits steps 5 and 10 to a mounted durable
dir. The test then edits durable storage as an attacker would, and box 2 (a new ONBOX_HOME, an empty checkpoint
dir) runs the same trainer with `onbox run --foreground`: a real agent, a real trainer process, real torch files.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap

import pytest

from tests.integration.supervisor_helpers import events, onbox, state

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch")

TRAINER = textwrap.dedent("""
    import os, sys, time
    import torch
    ck = os.environ["ONBOX_CKPT_DIR"]
    resume = os.environ.get("ONBOX_RESUME_FROM") or ""
    print("RESUME_FROM=%s" % resume, flush=True)
    start = torch.load(resume, weights_only=True)["step"] if resume else 0
    for step in range(start + 1, 11):
        print("step %d loss %.3f" % (step, 1.0 / step), flush=True)
        if step in (5, 10):
            torch.save({"step": step, "w": torch.ones(16)}, os.path.join(ck, "step_%05d.pt" % step))
            time.sleep(1.0)  # the periodic commit (every 0.1 s) takes each one
    print("done", flush=True)
""")


def train_box1(tmp_path):
    trainer = tmp_path / "train.py"
    trainer.write_text(TRAINER)
    (tmp_path / "box1").mkdir()
    r = onbox(tmp_path / "home1", "run", "--foreground", "--name", "x", "--ckpt-dir", str(tmp_path / "box1"),
              "--durable", str(tmp_path / "durable"), "--sync-interval", "0.1", "--", sys.executable, str(trainer),
              timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = tmp_path / "durable" / "x" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step_00005.pt", "step_00010.pt"]
    return trainer, ckpts


def box2(tmp_path, trainer, *extra):
    (tmp_path / "box2" / "ckpt").mkdir(parents=True)
    return onbox(tmp_path / "home2", "run", "--foreground", "--name", "x", "--ckpt-dir", str(tmp_path / "box2" / "ckpt"),
                 "--durable", str(tmp_path / "durable"), "--sync-interval", "0.1", *extra, "--", sys.executable,
                 str(trainer), timeout=120)


def output(tmp_path) -> str:
    with open(tmp_path / "home2" / "runs" / "x" / "output.log") as f:
        return f.read()


def test_a_manifest_path_out_of_the_checkpoint_dir_writes_nothing_and_the_run_resumes_from_the_older_one(tmp_path):
    trainer, ckpts = train_box1(tmp_path)
    payload = b"#!/bin/sh\necho owned\n"
    (ckpts / "step_00010.pt" / "payload").write_bytes(payload)
    m = json.loads((ckpts / "step_00010.pt" / "MANIFEST.json").read_text())
    m.update(kind="dir", source={}, files=[{"path": "../../evilsrc/payload", "size": len(payload),
                                            "sha256": hashlib.sha256(payload).hexdigest()}])
    (ckpts / "step_00010.pt" / "MANIFEST.json").write_text(json.dumps(m))

    r = box2(tmp_path, trainer)
    assert r.returncode == 0, r.stderr[-3000:]
    for dirpath, _dirs, files in os.walk(tmp_path):
        assert "evilsrc" not in dirpath
        for n in files:
            if not dirpath.startswith(str(ckpts)) and "quarantine" not in dirpath:
                with open(os.path.join(dirpath, n), "rb") as f:
                    assert f.read() != payload, os.path.join(dirpath, n)
    assert "RESUME_FROM=%s" % (tmp_path / "box2" / "ckpt" / "step_00005.pt") in output(tmp_path)
    evs = events(tmp_path / "home2", "x")
    [refused] = [e for e in evs if e["type"] == "checkpoint_refused"]
    assert "../../evilsrc/payload" in refused["problem"] and "'..'" in refused["problem"]
    assert [e["checkpoint"] for e in evs if e["type"] == "checkpoint_quarantined"] == ["step_00010.pt"]
    assert not [e for e in evs if e["type"] == "checkpoint_restored" and e["checkpoint"] == "step_00010.pt"]
    quarantined = os.listdir(tmp_path / "durable" / "x" / "quarantine")
    assert len(quarantined) == 1 and quarantined[0].startswith("step_00010.pt.")


def test_manifests_with_an_unknown_hash_never_make_a_silent_start_from_scratch(tmp_path):
    trainer, ckpts = train_box1(tmp_path)
    for name in ("step_00005.pt", "step_00010.pt"):
        p = ckpts / name / "MANIFEST.json"
        p.write_text(json.dumps(dict(json.loads(p.read_text()), hash="md7")))
    hb = tmp_path / "beats.jsonl"
    r = box2(tmp_path, trainer, "--heartbeat-file", str(hb), "--heartbeat-interval", "0.05")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "RESUME_FROM=\n" in output(tmp_path)  # from scratch: nothing restorable ...
    evs = events(tmp_path / "home2", "x")
    [scratch] = [e for e in evs if e["type"] == "resume_from_scratch"]  # ... and said, once
    assert "none of the 2 checkpoint(s) on durable storage could be restored" in scratch["why"]
    assert sorted(e["checkpoint"] for e in evs if e["type"] == "checkpoint_refused") == ["step_00005.pt",
                                                                                       "step_00010.pt"]
    [w] = [w for w in state(tmp_path / "home2", "x")["warnings"] if w["code"] == "resume_from_scratch"]
    assert w["severity"] == "critical"
    status = onbox(tmp_path / "home2", "status", "x")
    assert "starts from scratch" in status.stdout, status.stdout
    beats = [json.loads(line) for line in hb.read_text().splitlines() if line.strip()]
    assert any(a["code"] == "resume_from_scratch" for b in beats for a in b.get("alerts") or [])
