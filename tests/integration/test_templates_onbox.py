"""Each `onbox init` template, launched by its own train.sh under the real agent (`onbox run`, detached), on CPU:
preempted (SIGTERM to the agent: the trainer saves at the next step boundary, exits 75, the agent commits and
exits preempted), relaunched, resumed at the saved step on the same LR curve with its metrics in progress.json,
then stopped with `onbox stop`. The plain template also resumes on a "replacement box" (an empty checkpoint dir:
restored from durable storage, fp16 GradScaler state included) and its run is re-verified with `onbox verify`,
both recorded in checkpoints_index.json.

The schedules here stay inside their linear warm-up (1000 steps), where the rate is proportional to the step: a
resume that restarted the schedule would show at once.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from onbox import templates
from tests.conftest import REPO_ROOT
from tests.integration.supervisor_helpers import FAST, events, onbox, state
from tests.polling import wait_for
from tests.processes import signal_own

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("cleanup")]
torch = pytest.importorskip("torch")
PY = sys.executable
WARMUP = 1000

# per template: overrides for a tiny CPU run that cannot end by itself, and its schedule's (peak, warm-up, end,
# floor) as the template names them
TEMPLATES = {
    "plain": (["--max_steps=100000", "--warmup_steps=%d" % WARMUP, "--log_interval=5", "--save_interval=20",
               "--eval_interval=20", "--precision=fp16", "--threads=1"], (0.003, 100000, 0.0003)),
    "nanogpt": (["--max_iters=100000", "--lr_decay_iters=100000", "--warmup_iters=%d" % WARMUP, "--log_interval=5",
                 "--eval_interval=10", "--eval_iters=1", "--n_layer=1", "--n_embd=32", "--block_size=16",
                 "--batch_size=4", "--threads=1"], (0.001, 100000, 0.0001)),
    "hf": (["--max_steps=100000", "--warmup_steps=%d" % WARMUP, "--logging_steps=5", "--save_steps=10",
            "--eval_steps=10", "--n_layer=1", "--n_embd=32", "--seq_len=16", "--per_device_train_batch_size=4",
            "--eval_samples=8"], (0.0005, 100000, 0.00005)),
    "litgpt": (["--train.max_steps=100000", "--train.lr_warmup_steps=%d" % WARMUP, "--train.log_interval=5",
                "--train.save_interval=10", "--eval.interval=10", "--eval.max_iters=1", "--model_config.n_layer=1",
                "--model_config.n_embd=32", "--model_config.block_size=16", "--train.global_batch_size=4",
                "--train.micro_batch_size=2", "--threads=1"], (0.0004, 100000, 0.00004)),
}
LOG_EVERY = 5


def load_kit(tpl):
    spec = importlib.util.spec_from_file_location("kit_%s" % os.path.basename(str(tpl)), str(tpl / "onbox_trainkit.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def env_for(home, tmp_path, ckpt="ckpt"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONBOX_")}
    env.update(FAST)
    env.update({"ONBOX_HOME": str(home), "ONBOX": "%s -m onbox" % PY, "PYTHON": PY, "PYTHONPATH": REPO_ROOT,
                "DURABLE": str(tmp_path / "durable"), "CKPT_DIR": str(tmp_path / ckpt), "ONBOX_SYNC_INTERVAL": "0.1",
                "ONBOX_HEARTBEAT_INTERVAL": "0.2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
    return env


def output_lines(home, name):
    """The trainer's JSON lines in the run's output.log, in order."""
    out = []
    with open(os.path.join(str(home), "runs", name, "output.log"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def log_text(home, name):
    with open(os.path.join(str(home), "runs", name, "output.log"), encoding="utf-8") as f:
        return f.read()


def progress(home, name):
    try:
        with open(os.path.join(str(home), "runs", name, "progress.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def train_sh(tpl, env, args):
    r = subprocess.run([str(tpl / "train.sh"), *args], env=env, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("started "), r.stdout
    return r


def check_lr_curve(kit, lines, schedule, what):
    """Every logged rate is the template's schedule at the step it was used for (logged at step N: step N-1)."""
    peak, end, floor = schedule
    rates = [(d["step"], d["lr"]) for d in lines if isinstance(d.get("lr"), float) and "event" not in d]
    assert rates, what
    for step, lr in rates:
        assert math.isclose(lr, kit.lr_at(step - 1, peak, WARMUP, end, floor), rel_tol=1e-6), (what, step, lr)
    return rates


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_template_preempted_then_resumed_under_onbox(kind, onbox_home, tmp_path):
    if kind == "hf":
        pytest.importorskip("transformers")
    tpl = tmp_path / "tpl"
    templates.write(kind, str(tpl), name=kind)  # `onbox init` itself: tests/unit/test_templates.py
    kit = load_kit(tpl)
    args, schedule = TEMPLATES[kind]
    env = env_for(onbox_home, tmp_path)

    # 1. train.sh starts it detached; once a checkpoint is durable, the box is "preempted" (SIGTERM to the agent)
    train_sh(tpl, env, args)
    wait_for(lambda: [e for e in events(onbox_home, kind) if e["type"] == "checkpoint_committed"], timeout=120,
             what="the first committed checkpoint")
    agent = state(onbox_home, kind)["agent_pid"]
    signal_own(onbox_home, agent, signal.SIGTERM)
    wait_for(lambda: state(onbox_home, kind).get("state") == "preempted", timeout=90, what="state preempted")
    first = output_lines(onbox_home, kind)
    [stopped] = [d for d in first if d.get("event") == "stopped"]
    step = stopped["step"]
    # the step it stopped at is saved: on the signal, or just before it by the periodic save of that step
    assert [d for d in first if d.get("event") == "checkpoint" and d["step"] == step]
    assert "exit code 75" in log_text(onbox_home, kind)  # the trainer's own "checkpointed, restart me"
    committed = [e for e in events(onbox_home, kind) if e["type"] == "checkpoint_committed"]
    assert committed[-1]["step"] == step  # the final commit took the checkpoint saved on the signal
    check_lr_curve(kit, first, schedule, "before the preemption")

    # 2. relaunched: the same train.sh on this box, or (plain) a replacement box with an empty checkpoint dir
    if kind == "plain":
        env2 = env_for(onbox_home, tmp_path, ckpt="ckpt-box2")
        r = onbox(onbox_home, "run", "--name", kind, "--resume", "--ckpt-dir", env2["CKPT_DIR"], env_extra={
            k: v for k, v in env2.items() if k.startswith("ONBOX_") or k in ("PYTHONPATH", "OMP_NUM_THREADS")})
        assert r.returncode == 0, r.stderr
        check_restore_recorded(onbox_home, tmp_path, step)
    else:
        train_sh(tpl, env, args)
    n_before = len(first)
    wait_for(lambda: any("lr" in d and d.get("step", 0) > step for d in output_lines(onbox_home, kind)[n_before:])
             and (progress(onbox_home, kind).get("step") or 0) > step, timeout=120,
             what="a logged step past %d after the resume" % step)
    r = onbox(onbox_home, "stop", kind, "--wait", "90", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert state(onbox_home, kind)["state"] == "stopped"

    # 3. it continued at the saved step, on the same point of the LR curve; its metrics reached progress.json
    resumed_at = [e for e in events(onbox_home, kind) if e["type"] == "checkpoint_resume"]
    assert resumed_at and resumed_at[-1]["step"] == step
    second = output_lines(onbox_home, kind)[n_before:]
    [resumed] = [d for d in second if d.get("event") == "resumed"]
    assert resumed["step"] == step
    rates = check_lr_curve(kit, second, schedule, "after the resume")
    assert rates[0][0] == (step // LOG_EVERY + 1) * LOG_EVERY  # the next report after the saved step
    prog = progress(onbox_home, kind)
    assert prog["step"] > step and prog["lr"] in {lr for _s, lr in rates} and prog["loss"] is not None
    assert [d for d in second if d.get("event") == "stopped"]  # `onbox stop`: saved at a step boundary again
    r = onbox(onbox_home, "status", kind)  # what a person sees, with no --metrics-regex
    assert r.returncode == 0 and "progress: step %d, loss " % prog["step"] in r.stdout and "tokens/s" in r.stdout, \
        r.stdout

    # 4. the durable index lists them with step, time, metrics and verification
    index = json.loads((tmp_path / "durable" / kind / "checkpoints_index.json").read_text())
    steps = [e["step"] for e in index["checkpoints"]]
    assert step in steps or min(steps) > step  # kept, unless newer ones retired it
    for e in index["checkpoints"]:
        assert e["verified"] and e["committed_at"]
        # the metrics the agent knew when it first saw the checkpoint: never from a later step; none at all for a
        # checkpoint the trainer saved right after its first report, before that report reached progress.json
        assert e["metrics"] == {} or e["metrics"]["step"] <= e["step"], e
    assert [e for e in index["checkpoints"] if e["metrics"].get("step") is not None]
    if kind == "plain":
        check_replacement_box(onbox_home, tmp_path, step, index)


def check_restore_recorded(home, tmp_path, step):
    """On the replacement box the checkpoint came from durable storage, fetched and checked against its
    manifest before the trainer started: the index records that check (read before newer commits can retire
    the entry: the trainer has not even started)."""
    resumed = wait_for(lambda: [e for e in events(home, "plain") if e["type"] == "checkpoint_resume"],
                       timeout=60, what="the relaunch's restore")
    [restored] = [e for e in events(home, "plain") if e["type"] == "checkpoint_restored"]
    assert restored["step"] == step and resumed[0]["checkpoint"] == restored["checkpoint"]
    index = json.loads((tmp_path / "durable" / "plain" / "checkpoints_index.json").read_text())
    [entry] = [e for e in index["checkpoints"] if e["name"] == restored["checkpoint"]]
    [check] = entry["verification"]["checks"]
    assert (check["by"], check["result"], entry["verified"]) == ("restore", "passed", True)


def check_replacement_box(home, tmp_path, step, index):
    """The fp16 loss-scaler state went through save, commit, restore and resume; `onbox verify` of the run dir
    records a re-check of every checkpoint."""
    newest = index["checkpoints"][-1]
    ckpt = torch.load(str(tmp_path / "durable" / "plain" / "checkpoints" / newest["name"] / newest["local_name"]),
                      weights_only=True)
    assert ckpt["step"] == newest["step"] and ckpt["scaler"]["scale"] > 0 and ckpt["scaler"]["_growth_tracker"] > 0
    r = onbox(home, "verify", str(tmp_path / "durable" / "plain"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(json.loads(r.stdout)["index_recorded"]) == sorted(e["name"] for e in index["checkpoints"])
    after = json.loads((tmp_path / "durable" / "plain" / "checkpoints_index.json").read_text())
    for e in after["checkpoints"]:
        assert e["verification"]["checks"][-1]["by"] == "verify"
        assert e["verification"]["checks"][-1]["result"] == "passed"
