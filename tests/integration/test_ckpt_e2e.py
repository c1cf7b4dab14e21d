"""End to end through the real supervisor: box A's trainer writes a checkpoint which the agent commits to the
durable dir; box B starts with an empty checkpoint dir, the agent restores, and the child sees ONBOX_RESUME_FROM."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from onbox.checkpoints.verify import verify_path
from tests.integration.supervisor_helpers import events, onbox

pytestmark = pytest.mark.integration

TRAINER = r"""
import io, os, sys, time, zipfile
out = sys.argv[1]
with open(out, "w") as f:
    f.write(os.environ.get("ONBOX_RESUME_FROM", ""))
if not os.environ.get("ONBOX_RESUME_FROM"):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("step_10/data.pkl", b"\x80\x02}q\x00.")
        zf.writestr("step_10/data/0", os.urandom(100000))
        zf.writestr("step_10/version", b"3\n")  # torch.load requires it: without it, not a torch checkpoint
    path = os.path.join(os.environ["ONBOX_CKPT_DIR"], "step_10.pt")
    with open(path + ".tmp", "wb") as f:
        f.write(buf.getvalue())
    os.replace(path + ".tmp", path)  # an atomic save, as careful trainers do
    manifest = os.path.join(sys.argv[2], "e2e", "checkpoints", "step_10.pt", "MANIFEST.json")
    deadline = time.monotonic() + 30
    while not os.path.exists(manifest) and time.monotonic() < deadline:
        time.sleep(0.02)  # keep training until the agent's periodic sync has committed it
"""


def test_replacement_box_resumes_from_durable(tmp_path):
    durable = str(tmp_path / "durable")
    knobs = {"ONBOX_SETTLE_SECONDS": "0", "ONBOX_SYNC_INTERVAL": "0"}
    box_a, box_b = tmp_path / "boxA", tmp_path / "boxB"  # each box's ONBOX_HOME
    disk_a, disk_b = tmp_path / "diskA", tmp_path / "diskB"  # each box's local disk (a checkpoint dir is never in
    # ONBOX_HOME, where onbox keeps its own state)
    seen_a, seen_b = str(tmp_path / "resume_a.txt"), str(tmp_path / "resume_b.txt")
    r = onbox(box_a, "run", "--foreground", "--name", "e2e", "--restart", "never", "--ckpt-dir", str(disk_a / "ck"),
              "--durable", durable, "--", sys.executable, "-c", TRAINER, seen_a, durable, env_extra=knobs,
              timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert Path(seen_a).read_text() == ""
    assert [e for e in events(box_a, "e2e") if e["type"] == "checkpoint_committed"]
    committed = os.path.join(durable, "e2e", "checkpoints", "step_10.pt")
    assert verify_path(committed).ok
    r = onbox(box_b, "run", "--foreground", "--name", "e2e", "--restart", "never", "--ckpt-dir", str(disk_b / "ck"),
              "--durable", durable, "--", sys.executable, "-c", TRAINER, seen_b, durable, env_extra=knobs,
              timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = Path(seen_b).read_text()
    assert resumed == str(disk_b / "ck" / "step_10.pt")
    assert verify_path(resumed).ok
    assert [e for e in events(box_b, "e2e") if e["type"] == "checkpoint_restored"]


# checkpoints on SIGTERM (a torch zip, written non-atomically the way torch.save does), then exits 0
ON_TERM = r"""
import io, os, signal, sys, time, zipfile
def save(step):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ckpt/data.pkl", b"\x80\x02}q\x00.")
        zf.writestr("ckpt/data/0", os.urandom(200000))
        zf.writestr("ckpt/version", b"3\n")
    with open(os.path.join(os.environ["ONBOX_CKPT_DIR"], "step_%d.pt" % step), "wb") as f:
        f.write(buf.getvalue())
def on_term(signum, frame):
    save(2)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
save(1)
print("child-" + "up", flush=True)
for _ in range(6000):
    time.sleep(0.01)
sys.exit(3)
"""


def test_preemption_commits_the_checkpoint_saved_on_the_signal(tmp_path):
    import signal
    import subprocess

    from tests.integration.supervisor_helpers import env_for
    from tests.polling import wait_for
    from tests.processes import Started

    home, durable = tmp_path / "home", str(tmp_path / "durable")
    env = env_for(home, ONBOX_SETTLE_SECONDS="30", ONBOX_SYNC_INTERVAL="3600")
    with Started() as started:
        p = started.popen([sys.executable, "-m", "onbox", "run", "--foreground", "--name", "pre", "--grace", "20",
                           "--durable", durable, "--", sys.executable, "-c", ON_TERM], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        wait_for(lambda: "child-up" in _read(home / "runs" / "pre" / "output.log"), timeout=30, what="child up")
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=60)
    assert p.returncode == 75, err
    [final] = [e for e in events(home, "pre") if e["type"] == "final_checkpoint"]
    assert final["summary"]["name"] == "step_2.pt" and final["summary"]["status"] == "committed"
    assert verify_path(os.path.join(durable, "pre", "checkpoints", "step_2.pt")).ok


def _read(path):
    try:
        return Path(path).read_text()
    except OSError:
        return ""
