"""A run name is not silently reused: observed, `onbox run --name X -- <another command>` on a finished run
continued the old run and handed it the old checkpoint. The real CLI, real foreground runs."""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.integration.supervisor_helpers import onbox

pytestmark = pytest.mark.integration
PY = sys.executable


def fg(home, name, *argv, extra=()):
    return onbox(home, "run", "--foreground", "--restart", "never", "--name", name, *extra, "--", *argv)


def recorded(home, name):
    with open(os.path.join(str(home), "runs", name, "config.json")) as f:
        return json.load(f)


def test_another_command_under_an_existing_name_is_refused_the_same_one_resumes(onbox_home, tmp_path):
    first = fg(onbox_home, "exp", PY, "-c", "print('one')")
    assert first.returncode == 0, first.stderr
    before = recorded(onbox_home, "exp")
    other = fg(onbox_home, "exp", PY, "-c", "print('two')")
    assert other.returncode == 2
    err = other.stderr.splitlines()
    assert err[0].startswith("onbox: run exp already exists with another command (command was %s -c " % PY)
    assert err[1].startswith("hint: give this run a new --name, or pass --resume")
    assert recorded(onbox_home, "exp") == before  # nothing rewritten
    # a different checkpoint dir or durable target is another run too
    ck = tmp_path / "ck"
    ck.mkdir()
    r = fg(onbox_home, "exp", PY, "-c", "print('one')", extra=("--ckpt-dir", str(ck)))
    assert r.returncode == 2 and "another ckpt_dir (ckpt_dir was unset)" in r.stderr
    # the same command resumes as before (a requeued sbatch script, a relaunch)
    again = fg(onbox_home, "exp", PY, "-c", "print('one')")
    assert again.returncode == 0, again.stderr
    # --resume: on purpose, with the new command, recorded as the run's from now on
    meant = fg(onbox_home, "exp", PY, "-c", "print('two')", extra=("--resume",))
    assert meant.returncode == 0, meant.stderr
    assert recorded(onbox_home, "exp")["command"] == [PY, "-c", "print('two')"]
    with open(os.path.join(str(onbox_home), "runs", "exp", "output.log")) as f:
        log = f.read()
    assert log.count("one\n") == 2 and log.count("two\n") == 1


def test_a_missing_ckpt_dir_is_one_line_of_warning_not_an_error(onbox_home, tmp_path):
    r = fg(onbox_home, "w1", PY, "-c", "pass")
    assert r.returncode == 0
    [line] = [ln for ln in r.stderr.splitlines() if "--ckpt-dir" in ln]
    assert line.startswith("onbox: warning: no --ckpt-dir: onbox commits and restores only what the trainer writes to "
                           "$ONBOX_CKPT_DIR (%s)" % os.path.join(str(onbox_home), "runs", "w1", "checkpoints"))
    ck = tmp_path / "ck"
    ck.mkdir()
    r = fg(onbox_home, "w2", PY, "-c", "pass", extra=("--ckpt-dir", str(ck)))
    assert r.returncode == 0 and "--ckpt-dir" not in r.stderr


def test_a_run_without_a_name_is_named_in_utc_with_no_pid(onbox_home, tmp_path):
    """The box's default name is the controller's: the program and the UTC time (it was local time and a pid)."""
    import calendar
    import re
    import time

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    before = time.time()
    r = onbox(onbox_home, "run", "--foreground", "--restart", "never", "--", PY, str(script),
              env_extra={"TZ": "Pacific/Kiritimati"})  # UTC+14: local time would name another day
    after = time.time()
    assert r.returncode == 0, r.stderr
    [name] = os.listdir(os.path.join(str(onbox_home), "runs"))
    m = re.fullmatch(r"train-(\d{8}-\d{6})", name)
    assert m, name
    stamp = calendar.timegm(time.strptime(m.group(1), "%Y%m%d-%H%M%S"))
    assert int(before) <= stamp <= after, (name, before, after)
