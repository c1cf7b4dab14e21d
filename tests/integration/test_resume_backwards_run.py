"""A resume that went backwards, under the real agent (issue 32, item 6): a plain JSON trainer saves by rename,
crashes, and its restarted attempt is handed the newest checkpoint (ONBOX_RESUME_FROM). One that ignores it and
trains from step 1 is said at once: the event `resume_backwards` (the restored step, the first step) and a critical
alert in the attempt's beats (a heartbeat file sink). One that loads it and goes on says nothing."""
from __future__ import annotations

import json
import sys

import pytest

from tests.integration.supervisor_helpers import events, onbox, state

pytestmark = pytest.mark.integration

TRAINER = r'''
import json, os, sys, time
ck = os.environ["ONBOX_CKPT_DIR"]
os.makedirs(ck, exist_ok=True)
loads, resume = sys.argv[1] == "loads", os.environ.get("ONBOX_RESUME_FROM")
step = 0
if loads and resume:
    with open(resume) as f:
        step = json.load(f)["step"]
stop_at = step + 15 if os.environ["ONBOX_RESTART_COUNT"] != "0" else 10 ** 9
while step < stop_at:
    step += 1
    print(json.dumps({"step": step, "loss": 1.0 / step}), flush=True)
    if step % 10 == 0:  # a save: a temp name, renamed into place
        path = os.path.join(ck, "state_%06d.json" % step)
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step}, f)
        os.replace(path + ".tmp", path)
    if os.environ["ONBOX_RESTART_COUNT"] == "0" and step == 60:
        sys.exit(1)  # the first attempt crashes after its saves of steps 10 to 60
    time.sleep(0.02)
'''


def run(tmp_path, onbox_home, how):
    (tmp_path / "train.py").write_text(TRAINER)
    beats = tmp_path / "beats.jsonl"
    r = onbox(onbox_home, "run", "--foreground", "--name", "rb", "--ckpt-dir", str(tmp_path / "ck"), "--durable",
              str(tmp_path / "durable"), "--sync-interval", "0.2", "--settle-seconds", "0.5", "--restart",
              "on-failure", "--max-restarts", "1", "--heartbeat-file", str(beats), "--heartbeat-interval", "0.2",
              "--", sys.executable, str(tmp_path / "train.py"), how, timeout=120)
    assert r.returncode == 0 and state(onbox_home, "rb")["state"] == "done", (r.stdout, r.stderr)
    with open(str(beats)) as f:
        return [json.loads(x) for x in f], events(onbox_home, "rb")


def test_a_restarted_trainer_that_ignores_the_restored_checkpoint_is_said_at_once(tmp_path, onbox_home, cleanup):
    beats, evs = run(tmp_path, onbox_home, "ignores")
    [resumed] = [e for e in evs if e["type"] == "checkpoint_resume"]
    [back] = [e for e in evs if e["type"] == "resume_backwards"]
    assert back["restored_step"] == resumed["step"] >= 10 and back["first_step"] == 1 and back["attempt"] == 1
    alerted = [b for b in beats if any(a["code"] == "resume_backwards" for a in b["alerts"])]
    assert alerted and all(b["attempt"] == 1 for b in alerted)
    [alert] = [a for a in alerted[0]["alerts"] if a["code"] == "resume_backwards"]
    assert alert["severity"] == "critical" and "reported step 1 first, far below step %d" % resumed["step"] in \
        alert["message"]
    # and state.json (`onbox status`, training_status.md) says it too, with what to do
    [warned] = [w for w in state(onbox_home, "rb").get("warnings") or [] if w["code"] == "resume_backwards"]
    assert warned["severity"] == "critical" and "ONBOX_RESUME_FROM" in warned["hint"]


def test_a_restarted_trainer_that_loads_it_says_nothing(tmp_path, onbox_home, cleanup):
    beats, evs = run(tmp_path, onbox_home, "loads")
    assert [e for e in evs if e["type"] == "checkpoint_resume"]
    assert [e for e in evs if e["type"] == "resume_backwards"] == []
    assert not [b for b in beats if any(a["code"] == "resume_backwards" for a in b["alerts"])]
