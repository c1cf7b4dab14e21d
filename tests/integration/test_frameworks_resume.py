"""Real trainers of five frameworks, unmodified, each saving as its docs show (tests/frameworks/), under the real
agent (issue 32, "Tests"): each trains, a save of its is killed midway (inside the framework's own writer) and
never committed nor restored, it is preempted (SIGTERM to the agent it started, by PID and start time), and on a
replacement box (a fresh ONBOX_HOME and checkpoint dir, the same durable storage) it resumes at the newest committed
step by its own printed step; `onbox verify` passes on what was committed. JAX/Orbax is preempted inside an async
save: its `<step>.orbax-checkpoint-tmp*` dir is never committed, and the replacement resumes from the newest
committed step, not from 0.

Before issue 32 only torch-named files and known dirs were candidates: the JSON, .npz, .ubj and .keras trainers had
nothing committed and their replacement boxes trained from step 0; Orbax's tmp dir was committed when quiet and
restored, and Orbax trained from 0.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pytest

from onbox.proc import is_alive, start_time
from tests.frameworks import venv
from tests.hosts import require_built
from tests.integration.supervisor_helpers import env_for, events, onbox, state
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
PY = sys.executable
QUIET_ENV = {"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


@dataclasses.dataclass
class Case:
    script: str
    box1: List[str]  # the first box's arguments (trains long: it is preempted)
    box2: str  # the replacement's, with {end}: how far it trains from the newest committed step
    die_at: Optional[str]  # a save killed midway in the framework's own writer (tests/frameworks/seam.py)
    resumed_after_crash: Optional[int]  # the step the restarted attempt resumes at: the save before the torn one
    steps_per_save: int
    local: str  # what a committed checkpoint's local name looks like


CASES: Dict[str, Case] = {
    "json-rename": Case("json_rename.py", ["--steps", "5000", "--save-every", "10", "--sleep", "0.03"],
                        "--steps={end}", "own-save@3", 20, 10, r"^state_\d{6}\.json$"),
    "numpy-savez": Case("numpy_savez.py", ["--steps", "5000", "--save-every", "10", "--sleep", "0.03"],
                        "--steps={end}", "zip-close@3", 20, 10, r"^ckpt_\d{6}\.npz$"),
    "xgboost": Case("xgb_train.py", ["--rounds", "2000", "--interval", "5", "--sleep", "0.05"],
                    "--rounds={end}", "own-save@3", 11, 5, r"^model_\d+\.ubj$"),
    "keras-modelcheckpoint": Case("keras_fit.py", ["--mode", "model", "--epochs", "500", "--sleep", "0.03"],
                                  "--epochs={end}", "zip-close@3", 2, 1, r"^model\.\d{2}\.keras$"),
    "keras-backupandrestore": Case("keras_fit.py", ["--mode", "backup", "--epochs", "500", "--sleep", "0.03"],
                                   "--epochs={end}", "h5-close@3", 2, 1, r"^backup$"),
    "jax-orbax": Case("jax_orbax.py", ["--steps", "5000", "--save-every", "5", "--sleep", "0.02",
                                       "--ballast-mb", "160"], "--steps={end}", None, None, 5, r"^\d+$"),
}


def launch(home, name: str, ckpt, durable, argv: List[str], env: Dict[str, str], foreground: bool = False,
           timeout: float = 60) -> subprocess.CompletedProcess:
    return onbox(home, "run", *(["--foreground"] if foreground else ["--json"]), "--name", name,
                 "--ckpt-dir", str(ckpt), "--durable", str(durable), "--sync-interval", "0.3", "--settle-seconds",
                 "1", "--restart", "on-failure", "--max-restarts", "3", "--", venv.PYTHON, *argv,
                 env_extra=dict(QUIET_ENV, **env), timeout=timeout)


def committed(durable, name: str) -> List[Tuple[int, str, str]]:
    """(step, durable name, local name) of every committed checkpoint (a MANIFEST.json is the commit point)."""
    root = os.path.join(str(durable), name, "checkpoints")
    out = []
    for n in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, n, "MANIFEST.json")) as f:
                m = json.load(f)
        except (OSError, ValueError):
            continue
        out.append((m["step"], n, m["local_name"]))
    return sorted(out)


def output(home, name: str) -> str:
    try:
        with open(os.path.join(str(home), "runs", name, "output.log"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def resumed_steps(home, name: str) -> List[int]:
    return [int(m) for m in re.findall(r"onbox-test: resumed at step (\d+)", output(home, name))]


@pytest.fixture
def frameworks_venv():
    require_built(venv.unavailable_reason())


@pytest.mark.parametrize("case", sorted(CASES), ids=str)
def test_a_real_framework_resumes_on_a_replacement_box_at_the_newest_committed_step(frameworks_venv, tmp_path,
                                                                                    case):
    c = CASES[case]
    durable, name = tmp_path / "durable", "fw"
    home1, ck1, once = tmp_path / "home1", tmp_path / "ck1", tmp_path / "died-once"
    home1.mkdir()
    env = {"ONBOX_TEST_DIE_AT": c.die_at, "ONBOX_TEST_DIE_ONCE": str(once)} if c.die_at else {}
    r = launch(home1, name, ck1, durable, [venv.script(c.script), *c.box1], env)
    assert r.returncode == 0, r.stderr
    agent = json.loads(r.stdout)["agent_pid"]
    agent_start = start_time(agent)
    try:
        if c.die_at:
            # the save killed midway: the restarted attempt resumes at the save before it, never the torn one
            wait_for(lambda: resumed_steps(home1, name), timeout=90, what="the restart after the torn save")
            # the save before the torn one, or an older one when the trainer rewrote its checkpoint before a scan saw
            # the newer (Keras' BackupAndRestore rewrites its dir every epoch): what onbox restored, never the torn
            [restored] = [e["step"] for e in events(home1, name) if e["type"] == "checkpoint_resume"]
            assert resumed_steps(home1, name) == [restored], output(home1, name)[-3000:]
            assert restored <= c.resumed_after_crash, output(home1, name)[-3000:]
            assert "onbox-test: SIGKILL at %s" % c.die_at.split("@")[0] in output(home1, name)
        floor = (c.resumed_after_crash or 0) + 2 * c.steps_per_save
        wait_for(lambda: [s for s, _n, _l in committed(durable, name) if s >= floor], timeout=90,
                 what="commits past step %d" % floor)
        if case == "jax-orbax":  # preempted inside an async save: its tmp dir is there when the agent is stopped
            wait_for(lambda: [n for n in os.listdir(str(ck1)) if ".orbax-checkpoint-tmp" in n], timeout=60,
                     interval=0.005, what="an Orbax async save under way")
        assert start_time(agent) == agent_start  # the agent this test started, still: signal it by its PID
        os.kill(agent, signal.SIGTERM)
        wait_for(lambda: not is_alive(agent, agent_start), timeout=120, what="the preempted agent's end")
    finally:
        if is_alive(agent, agent_start):
            os.kill(agent, signal.SIGKILL)
    assert state(home1, name)["state"] == "preempted", output(home1, name)[-3000:]
    done = committed(durable, name)
    assert all(re.match(c.local, local) for _s, _n, local in done), done  # never a temp name, never a torn save
    newest = done[-1][0]
    if case == "jax-orbax":
        left = [n for n in os.listdir(str(ck1)) if ".orbax-checkpoint-tmp" in n]
        assert left, "the preemption did not land inside an async save (raise --ballast-mb)"
        assert newest < int(left[0].split(".")[0])  # the interrupted step was never committed
    # a replacement box: a fresh ONBOX_HOME and checkpoint dir, the same durable storage
    home2, ck2 = tmp_path / "home2", tmp_path / "ck2"
    home2.mkdir()
    end = newest + 2 * c.steps_per_save
    argv2 = [venv.script(c.script), *_replacement_args(c, end)]
    r = launch(home2, name, ck2, durable, argv2, {}, foreground=True, timeout=300)
    assert r.returncode == 0, (r.stderr[-2000:], output(home2, name)[-3000:])
    assert resumed_steps(home2, name) == [newest], output(home2, name)[-3000:]
    v = subprocess.run([PY, "-m", "onbox", "verify", os.path.join(str(durable), name), "--json"],
                       env=env_for(home2), capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout[-3000:] + v.stderr[-2000:]
    assert json.loads(v.stdout)["ok"] is True


def _replacement_args(c: Case, end: int) -> List[str]:
    """The first box's arguments with the run's length set to `end` (the replacement trains a little further)."""
    out, skip = [], False
    key = c.box2.split("=")[0]
    for a in c.box1:
        if skip:
            skip = False
            continue
        if a == key:
            skip = True
            continue
        out.append(a)
    return [*out, c.box2.format(end=end)]
