"""A three-phase curriculum under the real agent: a real trainer (tests/integration/phase_trainer.py), each phase
ended at its target with the checkpoint signal, its final checkpoint handed to the next phase; a preemption in
the middle of phase 2 and the relaunch resuming inside phase 2; phase 3's criterion failing ends the run."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.integration.supervisor_helpers import (
    env_for,
    events,
    onbox,
    state,
)
from tests.polling import wait_for
from tests.processes import Started

pytestmark = [pytest.mark.integration]
PY = sys.executable

RUN_FILE = """
[run]
name = "curr"
command = [%(py)r, "-m", "tests.integration.phase_trainer"]
grace = 20

[[phase]]
name = "broad"
target_steps = 6
args = ["--eval-loss", "2.0"]
lr = 3e-4
criteria = ["eval_loss < 2.5"]

[[phase]]
name = "curated"
target_steps = 45
args = ["--eval-loss", "1.5"]
lr = 1e-4
env = { DATA_MIX = "curated" }
criteria = "val_loss <= 1.5"

[[phase]]
name = "anneal"
target_steps = 49
args = ["--eval-loss", "3.0"]
criteria = ["eval_loss < 1.0"]
"""


def _records(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _step(home):
    """The newest step the trainer printed (its output log)."""
    try:
        lines = (home / "runs" / "curr" / "output.log").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(x)["step"] for x in lines if x.startswith("{")]
    return steps[-1] if steps else 0


def test_a_curriculum_is_preempted_in_phase_two_and_resumes_inside_it(onbox_home, tmp_path, cleanup):
    rf = tmp_path / "run.toml"
    rf.write_text(RUN_FILE % {"py": PY})
    record = tmp_path / "record.jsonl"
    extra = {"PHASE_RECORD": str(record)}
    with Started() as started:
        agent = started.popen([PY, "-m", "onbox", "run", "--foreground", "-f", str(rf)], env=env_for(onbox_home, **extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        wait_for(lambda: state(onbox_home, "curr").get("phase", {}).get("name") == "curated"
                 and _step(onbox_home) >= 12, timeout=30, what="phase 2 past step 12")
        agent.send_signal(signal.SIGTERM)
        _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 75, err
    doc = state(onbox_home, "curr")
    assert doc["state"] == "preempted" and doc["phase"]["name"] == "curated" and doc["phase"]["index"] == 1
    assert [h["name"] for h in doc["phase"]["history"]] == ["broad"]

    r = onbox(onbox_home, "run", "--foreground", "--name", "curr", env_extra=extra, timeout=120)
    assert r.returncode == 1, r.stderr  # phase 3's criterion fails: the run fails, saying why
    starts = _records(record)
    assert [(s["phase"], s["index"]) for s in starts] == [("broad", "0"), ("curated", "1"), ("curated", "1"),
                                                        ("anneal", "2")]
    broad, curated, resumed, anneal = starts
    assert broad["resume_from"] == "" and broad["lr"] == "0.0003" and broad["target"] == "6"
    # each phase starts from the previous phase's final checkpoint (saved on the checkpoint signal at its target)
    assert curated["resumed_at"] >= 6 and curated["resume_from"].endswith("step_%06d.ckpt" % curated["resumed_at"])
    assert curated["mix"] == "curated" and curated["lr"] == "0.0001" and curated["argv"] == ["--eval-loss", "1.5"]
    # the relaunch resumed INSIDE phase 2, from the checkpoint the preemption committed, not from phase 1's
    assert resumed["resumed_at"] >= 12 and resumed["start_step"] == curated["start_step"]
    assert anneal["resumed_at"] >= 45 and anneal["start_step"] == str(anneal["resumed_at"])
    doc = state(onbox_home, "curr")
    assert doc["state"] == "failed"
    assert "phase 3/3 'anneal' reached its target step 49" in doc["message"]
    assert "criteria failed: eval_loss 3 is not < 1" in doc["message"]
    assert [(h["name"], h["status"]) for h in doc["phase"]["history"]] == [
        ("broad", "completed"), ("curated", "completed"), ("anneal", "failed")]
    kinds = [e["type"] for e in events(onbox_home, "curr")]
    assert kinds.count("phase_started") == 3 and kinds.count("phase_completed") == 2
    assert kinds.count("phase_resumed") == 1 and kinds[-1] != "phase_failed" and "phase_failed" in kinds
    summary = (onbox_home / "runs" / "curr" / "training_status.md").read_text()
    assert "## Phases" in summary and "- curated: completed at step" in summary and "- anneal: failed" in summary
    st = onbox(onbox_home, "status", "curr")
    assert "phase: 3/3 anneal" in st.stdout
    assert json.loads(onbox(onbox_home, "status", "curr", "--json").stdout)["phase"]["name"] == "anneal"


def test_a_bad_phase_table_is_refused_before_anything_is_created(onbox_home, tmp_path):
    rf = tmp_path / "run.toml"
    rf.write_text('[run]\nname = "bad"\ncommand = ["true"]\n\n[[phase]]\nname = "a"\n\n[[phase]]\nname = "b"\n')
    r = onbox(onbox_home, "run", "-f", str(rf))
    assert r.returncode == 2 and "[[phase]] 'a' has no target" in r.stderr and "hint:" in r.stderr
    rf.write_text('[run]\nname = "bad"\ncommand = ["true"]\n\n[[phase]]\nname = "a"\ncommand = ["no-such-cmd"]\n')
    r = onbox(onbox_home, "run", "-f", str(rf))
    assert r.returncode == 2 and "cannot run no-such-cmd" in r.stderr
    assert not (onbox_home / "runs" / "bad").exists()
