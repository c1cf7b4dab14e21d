"""Real files, real processes: nanoGPT-style in-place rewrites during syncs, `onbox verify` on corrupted files,
and a real torch checkpoint (CPU torch) with and without --load."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.verify import verify_path
from onbox.clock import SystemClock
from tests.checkpoint_files import flip_byte, truncate, write_torch_zip
from tests.conftest import subprocess_env
from tests.fakes.run_context import run_context

pytestmark = pytest.mark.integration

# rewrites ckpt.pt in place like nanoGPT's torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt')): open with
# truncation, write slowly; each version's payload bytes are its number, and progress.json says its step first
WRITER = r"""
import io, json, os, sys, time, zipfile
ckpt, run_dir, versions = sys.argv[1], sys.argv[2], int(sys.argv[3])
for v in range(1, versions + 1):
    with open(os.path.join(run_dir, "progress.json.tmp"), "w") as f:
        json.dump({"step": v * 100, "loss": 1.0 / v, "time": time.time()}, f)
    os.replace(os.path.join(run_dir, "progress.json.tmp"), os.path.join(run_dir, "progress.json"))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("ckpt/data.pkl", b"\x80\x02}q\x00.")
        zf.writestr("ckpt/data/0", bytes([v]) * 600000)
        zf.writestr("ckpt/version", b"3\n")
    data = buf.getvalue()
    with open(ckpt, "wb") as f:
        for i in range(0, len(data), 32768):
            f.write(data[i:i + 32768]); f.flush(); time.sleep(0.002)
    time.sleep(0.15)
print("done", flush=True)
"""


def test_in_place_rewrite_is_never_committed_torn(tmp_path):
    ctx = run_context(tmp_path, settle_seconds=0.0, sync_interval=0.0, keep_last=100)
    ctx.clock = SystemClock()
    hook = CheckpointCommitHook(ctx)
    ckpt = os.path.join(ctx.ckpt_dir, "ckpt.pt")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, ckpt, ctx.run_dir, "6"], stdout=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 60
        while writer.poll() is None and time.monotonic() < deadline:
            hook.periodic()  # settle 0: only the format checks and the copy-time fingerprint stand guard
            hook.join_worker(None)
        assert writer.wait(timeout=60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    hook.periodic()
    hook.join_worker(None)
    durable = os.path.join(str(tmp_path / "durable"), "r1", "checkpoints")
    names = sorted(os.listdir(durable))
    assert len(names) >= 2, names  # it did commit while the trainer kept rewriting
    seen_versions = set()
    for n in names:
        rep = verify_path(os.path.join(durable, n))
        assert rep.ok, rep.problems  # every committed copy is whole: central directory, CRCs, hashes
        import zipfile

        with zipfile.ZipFile(os.path.join(durable, n, "ckpt.pt")) as zf:
            payload = zf.read("ckpt/data/0")
        assert len(set(payload)) == 1
        v = payload[0]
        seen_versions.add(v)
        assert n == "ckpt.pt.step-%d" % (v * 100)  # the last step the trainer reported before it saved
    assert 6 in seen_versions  # the final, complete version got committed


def run_onbox(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "onbox", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=timeout)


def test_verify_cli_catches_flipped_byte_and_truncation(tmp_path):
    p = write_torch_zip(str(tmp_path / "model.pt"))
    assert run_onbox("verify", p).returncode == 0
    flip_byte(p, 150)
    proc = run_onbox("verify", p)
    assert proc.returncode == 1 and "model.pt" in proc.stderr and "CRC" in proc.stderr
    q = write_torch_zip(str(tmp_path / "other.pt"))
    truncate(q, 1000)
    proc = run_onbox("verify", "--json", q)
    assert proc.returncode == 1
    import json

    rep = json.loads(proc.stdout)
    assert rep["ok"] is False and "central directory" in rep["problems"][0]


TORCH_SAVE = r"""
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 64)).sum().backward(); opt.step()
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 7}, sys.argv[1])
"""


def test_real_torch_checkpoint_verifies_with_and_without_load(tmp_path):
    pytest.importorskip("torch")
    p = str(tmp_path / "ckpt.pt")
    subprocess.run([sys.executable, "-c", TORCH_SAVE, p], check=True, timeout=120, env=subprocess_env())
    proc = run_onbox("verify", p)
    assert proc.returncode == 0 and "torch-zip" not in proc.stderr, proc.stderr
    proc = run_onbox("verify", "--load", "--json", p)
    assert proc.returncode == 0, proc.stderr
    import json

    rep = json.loads(proc.stdout)
    assert rep["loaded"] is True and rep["files"][0]["kind"] == "torch-zip"
    # a flipped byte inside a tensor: torch.load would not notice (it skips CRCs); verify does, without --load
    with open(p, "rb") as f:
        data = f.read()
    off = data.index(b"ckpt/data/0") + 200
    flip_byte(p, off)
    proc = run_onbox("verify", p)
    assert proc.returncode == 1 and "ckpt.pt" in proc.stderr


def test_sync_and_checkpoints_cli(tmp_path):
    import json

    env = subprocess_env({"ONBOX_HOME": str(tmp_path / "home")})

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "onbox", *args], capture_output=True, text=True, env=env,
                              timeout=60)

    ck, dur = str(tmp_path / "ck"), str(tmp_path / "dur")
    os.makedirs(ck)
    where = ["--durable", dur, "--ckpt-dir", ck]
    r = cli("sync", "r1", "--now", *where)
    assert r.returncode == 1 and "nothing to commit" in r.stderr and "synced" not in r.stdout
    write_torch_zip(os.path.join(ck, "checkpoint-40", "model.pt"))
    r = cli("sync", "r1", *where)  # settle interval (10 s default) not over: not complete yet
    assert r.returncode == 1 and "still changing" in r.stderr
    r = cli("sync", "r1", "--now", *where)
    assert r.returncode == 0 and r.stdout.startswith("committed checkpoint-40 (step 40"), r.stderr
    r = cli("sync", "r1", "--now", "--json", *where)
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "already"
    r = cli("checkpoints", "r1", "--json", *where)
    doc = json.loads(r.stdout)
    assert [e["name"] for e in doc["committed"]] == ["checkpoint-40"] and doc["committed"][0]["verified"]
    assert doc["local"][0]["name"] == "checkpoint-40" and doc["status"]["last_sync"]["ok"] is True
    r = cli("sync", "no-such-run")
    assert r.returncode == 2 and "no run" in r.stderr
