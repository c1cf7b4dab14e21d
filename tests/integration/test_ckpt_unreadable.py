"""A newest checkpoint this box cannot read is said to be unreadable, never torn, and never hidden behind the
last sync's "ok": the real agent runs a real trainer that saves step 10, then step 20, and makes step 20
unreadable (mode 000).

Permissions bind root only without its DAC capabilities: when the suite runs as root, the agent and its trainer
run with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from their bounding set (prctl PR_CAPBSET_DROP before
exec), so mode 000 means to them what it means to any user.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.integration.supervisor_helpers import env_for, events, onbox, state

pytestmark = pytest.mark.integration
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2

TRAINER = textwrap.dedent("""
    import os, time
    from tests.checkpoint_files import write_torch_zip  # what torch.save writes, without torch
    ck = os.environ["ONBOX_CKPT_DIR"]
    write_torch_zip(os.path.join(ck, "step_00010.pt"), payload=bytes([10]) * 4096)
    print("step 10 loss 0.100", flush=True)
    time.sleep(1.5)  # settled and committed
    # step 20 lands unreadable (as a save by another user with umask 077 does, or a disk that fails its reads)
    tmp = os.path.join(ck, ".tmp-step_00020.pt")
    write_torch_zip(tmp, payload=bytes([20]) * 4096)
    os.chmod(tmp, 0)
    os.rename(tmp, os.path.join(ck, "step_00020.pt"))
    print("step 20 loss 0.050", flush=True)
    time.sleep(2.0)  # the agent's next scans find it
    print("done", flush=True)
""")


def without_dac_override() -> None:
    """preexec_fn: as root, give up the capabilities that let root read any file (no-op for another user)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, %d)" % cap)


def test_an_unreadable_newest_checkpoint_is_said_in_status_and_listing_never_called_torn(onbox_home, tmp_path):
    trainer, ck, durable = tmp_path / "train.py", tmp_path / "ck", tmp_path / "durable"
    trainer.write_text(TRAINER)
    ck.mkdir()
    r = subprocess.run([sys.executable, "-m", "onbox", "run", "--foreground", "--name", "u", "--ckpt-dir", str(ck),
                        "--durable", str(durable), "--sync-interval", "0.1", "--settle-seconds", "0.3",
                        "--", sys.executable, str(trainer)], env=env_for(onbox_home), capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL, preexec_fn=without_dac_override)
    assert r.returncode == 0, r.stderr[-3000:]
    evs = events(onbox_home, "u")
    [unreadable] = [e for e in evs if e["type"] == "checkpoint_unreadable"]
    assert unreadable["checkpoint"] == "step_00020.pt" and "Permission denied" in unreadable["problem"]
    committed = [e["checkpoint"] for e in evs if e["type"] == "checkpoint_committed"]
    assert committed and all(c.startswith("step_00010.pt") for c in committed)
    [w] = [w for w in state(onbox_home, "u")["warnings"] if w["code"] == "checkpoint_unreadable"]
    assert w["severity"] == "critical" and "not committed" in w["message"]
    status = onbox(onbox_home, "status", "u")
    assert "NEWEST UNREADABLE, NOT COMMITTED: step_00020.pt" in status.stdout, status.stdout
    listing = subprocess.run([sys.executable, "-m", "onbox", "checkpoints", "u", "--json"], env=env_for(onbox_home),
                             capture_output=True, text=True, timeout=60, preexec_fn=without_dac_override)
    [local] = [c for c in json.loads(listing.stdout)["local"] if c["name"] == "step_00020.pt"]
    assert local["reason"].startswith("unreadable: ") and "torn" not in local["reason"], local
