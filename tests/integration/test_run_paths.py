"""`~` in a path option means the home directory wherever it is given (issue 19: `durable = "~/durable"` in a run file
created a literal `./~/durable` beside the job): a real `onbox run`, its recorded config.json, the directories."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.supervisor_helpers import env_for

pytestmark = [pytest.mark.integration]
PY = sys.executable


@pytest.fixture
def sandbox(tmp_path, onbox_home, cleanup):
    me, work = tmp_path / "me", tmp_path / "work"
    me.mkdir()
    work.mkdir()
    yield tmp_path, me, work


SOURCES = {  # where `~/durable` (and `~/ck`) are given: (argv options, environment, files under the tmp dir)
    "run-file": ([("-f", "{tmp}/run.toml")], {}, {"run.toml": "[run]\ndurable = '~/durable'\nckpt_dir = '~/ck'\n"}),
    "flag": ([("--durable=~/durable",), ("--ckpt-dir=~/ck",)], {}, {}),
    "environment": ([("--ckpt-dir=~/ck",)], {"ONBOX_DURABLE": "~/durable"}, {}),
    "profile": ([("--profile", "local")], {}, {"onbox-home/profiles/local.toml": "[run]\ndurable = '~/durable'\n"
                                                                               "ckpt_dir = '~/ck'\n"}),
}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_tilde_in_a_path_option_is_the_home_directory_and_no_tilde_dir_appears(sandbox, onbox_home, source):
    tmp, me, work = sandbox
    opts, env, files = SOURCES[source]
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    argv = [a.replace("{tmp}", str(tmp)) for group in opts for a in group]
    r = subprocess.run([PY, "-m", "onbox", "run", "--foreground", "--name", "t", *argv, "--", PY, "-c", "0"],
                       env=env_for(onbox_home, HOME=str(me), **env), cwd=str(work), capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    with open(onbox_home / "runs" / "t" / "config.json") as f:
        recorded = json.load(f)
    assert recorded["durable"] == str(me / "durable")
    assert recorded["ckpt_dir"] == str(me / "ck")
    tildes = [os.path.join(d, n) for d, dirs, names in os.walk(tmp) for n in dirs + names if n.startswith("~")]
    assert tildes == []
