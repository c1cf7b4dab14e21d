"""A run's default name: one rule (onbox/paths.py) that `onbox run`, `onbox queue add` and `onboxctl run` share.
Before issue 20 the controller named runs in UTC with 40 characters and the agent in local time with 60 and its
pid: the same command got two different names depending on who named it."""
from __future__ import annotations

import pytest

from onbox.paths import command_base, default_run_name, valid_run_name

T = 1_767_225_600.0  # 2026-01-01T00:00:00Z


@pytest.mark.parametrize("command, name", [
    (["python", "train.py", "--lr", "3"], "train"),
    (["python3.11", "/src/train.py"], "train"),
    (["/usr/bin/python3", "-u", "train.py"], "train"),
    (["python", "-m", "onbox.examples.charlm"], "charlm"),  # was "onbox.examples" on the box
    (["uv", "run", "train.py"], "train"),  # was "run" on the controller, "uv" on the box
    (["uv", "run", "torchrun", "--nproc-per-node", "8", "train.py"], "train"),  # never the option's value
    (["accelerate", "launch", "--num_processes", "2", "finetune.py"], "finetune"),
    (["env", "CUDA_VISIBLE_DEVICES=0", "python", "train.py"], "train"),
    (["bash", "scripts/run.sh"], "run"),
    (["./bin/trainer", "--config", "a.yaml"], "trainer"),
    (["python", "-c", "print(1)"], "python"),
    (["python", "train.v2.py"], "train-v2"),  # no '.': it marks a node's run (`<run>.node1`)
    (["python", "_private.py"], "private"),  # a run name starts with a letter or digit
    (["sleep", "2"], "sleep"),
    (["python"], "python"),
    (["++"], "run"),
])
def test_the_program_a_command_runs_names_it(command, name):
    assert command_base(command) == name


def test_a_default_name_is_the_program_and_the_utc_time_nothing_random():
    assert default_run_name(["python", "train.py"], now=T) == "train-20260101-000000"
    assert default_run_name(["python", "train.py"], now=T) == default_run_name(["python", "train.py"], now=T)
    long = default_run_name(["x" * 200], now=T)
    assert long == "x" * 40 + "-20260101-000000" and valid_run_name(long)


def test_the_controller_names_runs_with_the_agents_own_function():
    import controller.launch.plan as ctl_plan

    assert ctl_plan.default_run_name is default_run_name
