"""Restore falls back: the real agent, a real trainer process, real torch files, a mounted durable dir.

The trainer saves step 5 (good) and step 10 (a checkpoint it cannot resume from: it raises on load), then
crashes. The next attempt resumes from step 10 and dies at once; the agent quarantines step 10 (on durable
storage and locally, never deleted), the attempt after that resumes from step 5 and finishes. With
crash_loop_threshold=2 the two failures in a row would have ended the run without the fallback.
"""
from __future__ import annotations

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
    start = 0
    resume = os.environ.get("ONBOX_RESUME_FROM")
    if resume:
        state = torch.load(resume, weights_only=True)
        if state.get("poison"):
            raise RuntimeError("cannot resume from %s: the state does not fit the model" % resume)
        start = state["step"]
        print("resumed from step %d" % start, flush=True)
    for step in range(start + 1, 13):
        print("step %d loss %.3f" % (step, 1.0 / step), flush=True)
        if step in (5, 10):
            torch.save({"step": step, "w": torch.ones(64), "poison": step == 10 and not resume},
                       os.path.join(ck, "step_%05d.pt" % step))
        if step == 10 and not resume:
            time.sleep(1.5)  # long enough for the periodic commit of step 10
            sys.exit(3)  # the crash that made the run restart
    print("done", flush=True)
""")


def test_a_checkpoint_the_trainer_cannot_resume_from_is_quarantined_and_the_run_falls_back(onbox_home, tmp_path):
    trainer = tmp_path / "train.py"
    trainer.write_text(TRAINER)
    ck, durable = tmp_path / "ck", tmp_path / "durable"
    ck.mkdir()
    r = onbox(onbox_home, "run", "--foreground", "--name", "fb", "--ckpt-dir", str(ck), "--durable", str(durable),
              "--sync-interval", "0.1", "--restart", "on-failure", "--max-restarts", "5", "--", sys.executable,
              str(trainer), env_extra={"ONBOX_CRASH_LOOP_THRESHOLD": "2"}, timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    assert state(onbox_home, "fb")["state"] == "done"
    evs = events(onbox_home, "fb")
    [q] = [e for e in evs if e["type"] == "checkpoint_quarantined"]
    assert (q["checkpoint"], q["step"], q["fallback"]) == ("step_00010.pt", 10, "step_00005.pt")
    resumes = [(e["checkpoint"], e["source"]) for e in evs if e["type"] == "checkpoint_resume"]
    assert resumes == [("step_00010.pt", "local"), ("step_00005.pt", "local")]
    with open(os.path.join(str(onbox_home), "runs", "fb", "output.log")) as f:
        log = f.read()
    assert "cannot resume from" in log and "resumed from step 5" in log and "\ndone\n" in log
    quarantined = os.listdir(durable / "fb" / "quarantine")
    assert len(quarantined) == 1 and quarantined[0].startswith("step_00010.pt.")
    # the quarantined copy is kept whole; what durable storage holds as step_00010.pt now is the good one the
    # resumed attempt saved
    bad = json.loads((durable / "fb" / "quarantine" / quarantined[0] / "MANIFEST.json").read_text())
    good = json.loads((durable / "fb" / "checkpoints" / "step_00010.pt" / "MANIFEST.json").read_text())
    assert bad["digest"] != good["digest"]
    saved = torch.load(str(durable / "fb" / "checkpoints" / "step_00010.pt" / "step_00010.pt"), weights_only=True)
    assert saved["poison"] is False
    assert [n for n in os.listdir(ck / ".onbox-aside") if n.startswith("step_00010.pt.")]
