"""The example trainer (onbox/examples/charlm.py) honours the child contract: atomic full-state checkpoints,
SIGTERM -> checkpoint -> exit 75, and a resume that continues exactly where the uninterrupted run would be."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import subprocess_env

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration

ARGS = ["--steps", "30", "--ckpt-every", "10", "--log-every", "10", "--batch-size", "4", "--block", "32",
        "--d-model", "32", "--threads", "1"]


def _run(tmp, name, extra_env=None, extra_args=(), wait=True):
    ck = tmp / name
    env = subprocess_env({"ONBOX_CKPT_DIR": str(ck), "ONBOX_METRICS_FILE": str(tmp / (name + ".jsonl")),
                          "PYTHONWARNINGS": "ignore"})
    env.update(extra_env or {})
    p = subprocess.Popen([sys.executable, "-m", "onbox.examples.charlm", *ARGS, *extra_args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        out, err = p.communicate(timeout=120)
        return p.returncode, out, err
    return p


def _lines(text):
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_matches_uninterrupted_run(tmp_path):
    # the uninterrupted run and the interrupted one side by side (slow steps for the latter)
    straight_p = _run(tmp_path, "straight", wait=False)
    p = _run(tmp_path, "cut", extra_args=["--step-delay", "0.2"], wait=False)
    out, err = straight_p.communicate(timeout=120)
    assert straight_p.returncode == 0, err
    straight = {r["step"]: r["loss"] for r in _lines(out) if "loss" in r}
    assert sorted(straight) == [10, 20, 30]
    metrics = _lines((tmp_path / "straight.jsonl").read_text())
    assert any(r.get("event") == "done" for r in metrics)

    # SIGTERM once the first checkpoint exists
    first = tmp_path / "cut" / "step_000010.pt"
    deadline = time.monotonic() + 60
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.exists()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 75, err
    events = _lines(out)
    saved = [r for r in events if r.get("event") == "checkpoint" and r["reason"] == "preempt"]
    assert len(saved) == 1
    resume_from = saved[0]["path"]
    assert not [f for f in os.listdir(tmp_path / "cut") if "tmp" in f]  # atomic: no temp file left behind

    state = torch.load(resume_from, weights_only=True)  # loads with the safe loader
    assert {"model", "optimizer", "scheduler", "step", "rng"} <= set(state)

    rc, out, err = _run(tmp_path, "cut", extra_env={"ONBOX_RESUME_FROM": str(tmp_path / "cut")})
    assert rc == 0, err
    resumed = _lines(out)
    assert resumed[0]["event"] == "resumed" and resumed[0]["step"] == saved[0]["step"]
    after = {r["step"]: r["loss"] for r in resumed if "loss" in r}
    assert after[30] == straight[30]  # same seed + restored RNG, optimizer and scheduler: the same trajectory


def test_preempt_file_is_honoured(tmp_path):
    flag = tmp_path / "preempt"
    p = _run(tmp_path, "pf", extra_env={"ONBOX_PREEMPT_FILE": str(flag)}, extra_args=["--step-delay", "0.05"],
             wait=False)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pf.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    flag.write_text("")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 75, err
    assert any(r.get("event") == "preempted" for r in _lines(out))
