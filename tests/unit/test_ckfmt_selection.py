"""--ckpt-pattern and --ckpt-ignore (issue 32, item 2): what the user says a checkpoint is, checked as it is given
(a glob of a name at the top of the checkpoint dir), used by the agent's scans, and shown in `onbox status`."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.commands.runs import _checkpoint_line
from onbox.config import RunConfig
from onbox.errors import UsageError
from tests.conftest import subprocess_env
from tests.fakes.run_context import run_context


@pytest.mark.parametrize("key,flag", [("ckpt_pattern", "--ckpt-pattern"), ("ckpt_ignore", "--ckpt-ignore")])
@pytest.mark.parametrize("glob", ["", " ", "out/*.json", "a\0b"])
def test_a_glob_that_is_no_name_in_the_checkpoint_dir_is_refused(key, flag, glob):
    with pytest.raises(UsageError) as e:
        RunConfig(name="r", command=["x"], **{key: [glob]}).validate()
    assert flag in e.value.message


def test_good_globs_pass():
    cfg = RunConfig(name="r", command=["x"], ckpt_pattern=["state_*.json", "*.npz"], ckpt_ignore=["samples_*"])
    assert cfg.validate().ckpt_pattern == ["state_*.json", "*.npz"]


def test_onbox_run_refuses_a_bad_pattern_in_one_line_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "onbox", "run", "--name", "r", "--ckpt-dir", str(tmp_path / "ck"),
                        "--ckpt-pattern", "out/*.json", "--", "true"], capture_output=True, text=True,
                       env=subprocess_env({"ONBOX_HOME": str(tmp_path / "home")}), timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "--ckpt-pattern 'out/*.json'" in r.stderr
    assert not os.path.exists(tmp_path / "home" / "runs" / "r")


def test_the_agent_commits_only_what_the_patterns_name_and_onbox_status_says_them(tmp_path):
    ctx = run_context(tmp_path, durable=str(tmp_path / "durable"), settle_seconds=0.0,
                      ckpt_pattern=["state_*.json"], ckpt_ignore=["state_*_draft.json"])
    for n in ("state_10.json", "state_20_draft.json", "model.npz.json", "other.json"):
        (tmp_path / "ckpt" / n).write_text('{"step": 1}')
    hook = CheckpointCommitHook(ctx)
    assert [c.name for c in hook.scan_now()] == ["state_10.json"]
    line = _checkpoint_line(hook.status)
    assert "--ckpt-pattern 'state_*.json'" in line and "--ckpt-ignore 'state_*_draft.json'" in line
    assert _checkpoint_line(CheckpointCommitHook(run_context(tmp_path / "b")).status) == \
        "newest local none · durable none"
