"""On the box itself (issue 32, item 5): a plain JSON trainer whose saves onbox ignores by default (`*.txt`) is told
why none counts, with the fix, in `onbox status` within the settle period of its first save (not five sync
intervals later); `onbox stop --wait` then says why nothing was committed, and `onbox status NAME --json` carries
it. The same trainer saving `.json` is committed and `onbox stop` names its newest durable checkpoint."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.integration.supervisor_helpers import onbox
from tests.polling import wait_for

pytestmark = pytest.mark.integration

TRAINER = r'''
import json, os, sys, time
ck = os.environ["ONBOX_CKPT_DIR"]
os.makedirs(ck, exist_ok=True)
step = 0
while True:
    step += 1
    print(json.dumps({"step": step, "loss": 1.0 / step}), flush=True)
    if step % 10 == 0:  # a save: a temp name, renamed into place
        path = os.path.join(ck, "step_%06d" % step + sys.argv[1])
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(path + ".tmp", path)
    time.sleep(0.02)
'''


def start(tmp_path, home, suffix):
    (tmp_path / "train.py").write_text(TRAINER)
    r = onbox(home, "run", "--json", "--name", "nc", "--ckpt-dir", str(tmp_path / "ck"), "--durable",
              str(tmp_path / "durable"), "--sync-interval", "60", "--settle-seconds", "1", "--",
              sys.executable, str(tmp_path / "train.py"), suffix)
    assert r.returncode == 0, r.stderr
    return str(tmp_path / "ck"), os.path.join(str(tmp_path / "durable"), "nc")


def test_saves_onbox_ignores_are_said_on_the_box_and_by_stop(tmp_path, onbox_home, cleanup):
    ck, durable = start(tmp_path, onbox_home, ".txt")
    said = wait_for(lambda: (lambda r: r.stdout if "none a checkpoint" in r.stdout else None)(
        onbox(onbox_home, "status", "nc")), 30, "the warning in onbox status", 0.2)
    assert re.search(r"WARNING: \d+ files in %s, none a checkpoint: step_\d{6}\.txt, .* are \*\.txt, a name onbox "
                     r"ignores by default .* pass --ckpt-pattern '\*\.txt'" % re.escape(ck), said), said
    r = onbox(onbox_home, "stop", "nc", "--wait", "30")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "nc: stopped"
    assert re.match(r"  nothing committed to %s: \d+ files in %s, none a checkpoint: " % (
        re.escape(durable), re.escape(ck)), r.stdout.splitlines()[1]), r.stdout
    doc = json.loads(onbox(onbox_home, "status", "nc", "--json").stdout)
    assert doc["nothing_committed"] == r.stdout.splitlines()[1].strip()


def test_saves_onbox_takes_are_committed_and_stop_names_the_newest(tmp_path, onbox_home, cleanup):
    _, durable = start(tmp_path, onbox_home, ".json")
    wait_for(lambda: os.path.isdir(os.path.join(durable, "checkpoints")) and os.listdir(
        os.path.join(durable, "checkpoints")), 30, "a commit")
    assert "none a checkpoint" not in onbox(onbox_home, "status", "nc").stdout
    r = onbox(onbox_home, "stop", "nc", "--wait", "30")
    assert r.returncode == 0 and re.match(r"  newest durable checkpoint: step_\d{6}\.json \(step \d+\) in %s$" %
                                          re.escape(durable), r.stdout.splitlines()[1]), r.stdout
    assert "nothing_committed" not in json.loads(onbox(onbox_home, "status", "nc", "--json").stdout)
