"""A real `onbox run` pushes heartbeats to a real tracker that is SIGKILLed and restarted mid-run: every seq
arrives exactly once, in order, with the job's progress (parsed from its output and ONBOX_METRICS_FILE)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.supervisor_helpers import env_for
from tests.polling import wait_for
from tests.processes import Started

TRAIN = r'''
import json, os, sys, time
metrics = os.environ["ONBOX_METRICS_FILE"]
finish = sys.argv[1]
end = time.monotonic() + 90
i = 0
while not os.path.exists(finish) and time.monotonic() < end:
    i += 1
    print("iter %d: loss %.4f, time 20.00ms, mfu 1.00%%" % (i, 4.0 / (1 + 0.01 * i)))
    if i % 10 == 0:
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": i, "tokens_per_s": 1000.0 + i}) + "\n")
    time.sleep(0.02)
print("done after %d iterations" % i)
'''


@pytest.mark.integration
def test_onbox_run_heartbeats_survive_a_tracker_restart(tracker, tmp_path):
    home = tmp_path / "home"
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    finish = tmp_path / "finish"
    run_dir = home / "runs" / "hbrun"
    env = env_for(home, ONBOX_TRACKER=tracker.url, ONBOX_TRACKER_TOKEN_FILE=tracker.token_file,
                  ONBOX_HEARTBEAT_INTERVAL="0.1")
    with Started(home) as started:  # the end (a failed test too) stops the agent and the job it started
        with open(tmp_path / "onbox.log", "wb") as log:
            proc = started.popen([sys.executable, "-m", "onbox", "run", "--foreground", "--name", "hbrun",
                                  "--restart", "never", "--", sys.executable, str(script), str(finish)],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: len(tracker.all_heartbeats("hbrun")) >= 5, timeout=60, what="beats from onbox run")
        tracker.kill()
        spool = run_dir / "heartbeats" / "spool-tracker"
        wait_for(lambda: sum(1 for n in os.listdir(spool) if n[0].isdigit()) >= 5, timeout=30,
                 what="beats spooled while the tracker is down")
        tracker.start()
        wait_for(lambda: not any(n[0].isdigit() for n in os.listdir(spool)), timeout=60, what="the backlog drained")
        finish.write_text("")
        assert proc.wait(90) == 0, (tmp_path / "onbox.log").read_text()[-3000:]
    counter = json.loads((run_dir / "heartbeats" / "seq.json").read_text())
    first, n = counter["first_seq"], counter["next_seq"] - counter["first_seq"]
    beats = wait_for(lambda: (lambda b: b if len(b) >= n else None)(tracker.all_heartbeats("hbrun")), timeout=30,
                     what="all %d beats" % n)
    assert [b["seq"] for b in beats] == list(range(first, first + n))
    last = beats[-1]
    assert last["reason"] == "final" and last["state"] == "done"
    assert last["progress"]["step"] > 10 and last["progress"]["tokens_per_s"] > 1000
    assert {b["state"] for b in beats} >= {"running", "done"}
    progress = json.loads((run_dir / "progress.json").read_text())
    assert progress["step"] == last["progress"]["step"]
    [run] = [r for r in tracker.runs() if r["run"] == "hbrun"]
    assert run["liveness"] == "ended" and run["seq"] == first + n - 1


@pytest.mark.integration
@pytest.mark.root
def test_onbox_run_in_a_partitioned_box(netns_host, tmp_path):
    """`onbox run` on a box (network namespace) cut off from the tracker for a while: the job keeps training,
    the beats taken during the cut arrive after the link returns, each once and in order."""
    from tests.hosts.tracker import TrackerProcess

    tr = TrackerProcess(str(tmp_path / "tracker"), host=netns_host.host_ip)
    tr.start()
    home = tmp_path / "home"
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    finish = tmp_path / "finish"
    run_dir = home / "runs" / "hbnet"
    env = env_for(home, ONBOX_TRACKER=tr.url, ONBOX_TRACKER_TOKEN_FILE=tr.token_file, ONBOX_HEARTBEAT_INTERVAL="0.1")
    started = Started(home)  # the end (a failed test too) stops the agent and the job it started
    try:
        with open(tmp_path / "onbox.log", "wb") as log:
            proc = started.adopt(netns_host.popen(
                [sys.executable, "-m", "onbox", "run", "--foreground", "--name", "hbnet", "--restart", "never", "--",
                 sys.executable, str(script), str(finish)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        wait_for(lambda: len(tr.all_heartbeats("hbnet")) >= 5, timeout=60, what="beats from the box")
        netns_host.cut()
        at_cut = len(tr.all_heartbeats("hbnet"))

        def step():
            try:
                return json.loads((run_dir / "progress.json").read_text()).get("step") or 0
            except (OSError, ValueError):
                return 0

        step_at_cut = step()
        spool = run_dir / "heartbeats" / "spool-tracker"
        wait_for(lambda: sum(1 for n in os.listdir(spool) if n[0].isdigit()) >= 20, timeout=60,
                 what="beats queued behind the cut")
        wait_for(lambda: step() > step_at_cut + 50, timeout=60, what="the job training on during the cut")
        assert proc.poll() is None
        assert len(tr.all_heartbeats("hbnet")) <= at_cut + 1  # nothing crossed (one may have been in flight)
        netns_host.restore()
        wait_for(lambda: not any(n[0].isdigit() for n in os.listdir(spool)), timeout=60, what="the backlog drained")
        finish.write_text("")
        assert proc.wait(90) == 0, (tmp_path / "onbox.log").read_text()[-3000:]
        counter = json.loads((run_dir / "heartbeats" / "seq.json").read_text())
        first, n = counter["first_seq"], counter["next_seq"] - counter["first_seq"]
        beats = wait_for(lambda: (lambda b: b if len(b) >= n else None)(tr.all_heartbeats("hbnet")), timeout=30,
                         what="all %d beats" % n)
        assert [b["seq"] for b in beats] == list(range(first, first + n))
        assert beats[-1]["state"] == "done"
    finally:
        started.stop()
        tr.stop()


EVERY_STEP = r'''
import os, sys, time
go, finish = sys.argv[1:3]
for step in range(1, 1301):
    if step == 651:  # half-way: wait until the test has taken the tracker down
        end = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < end:
            time.sleep(0.02)
    print("step %d loss %.6f" % (step, 4.0 / (1 + step / 100.0)), flush=True)
    time.sleep(0.01)
end = time.monotonic() + 120
while not os.path.exists(finish) and time.monotonic() < end:  # trained: wait to be let go
    time.sleep(0.02)
'''


@pytest.mark.integration
@pytest.mark.slow
def test_every_step_the_trainer_printed_reaches_the_tracker_across_an_outage(tracker, tmp_path):
    """A real `onbox run` of a pure-Python trainer printing a metric line per step (1,300 of them, 100 a second)
    while it beats every 0.5 s: every step is in the tracker's trainer points, once, the second half of them sent
    by beats that waited in the spool while the tracker was down."""
    import requests

    home = tmp_path / "home"
    script = tmp_path / "train.py"
    script.write_text(EVERY_STEP)
    go, finish = tmp_path / "go", tmp_path / "finish"
    run_dir = home / "runs" / "every"
    spool = run_dir / "heartbeats" / "spool-tracker"
    env = env_for(home, ONBOX_TRACKER=tracker.url, ONBOX_TRACKER_TOKEN_FILE=tracker.token_file,
                  ONBOX_HEARTBEAT_INTERVAL="0.5")

    def parsed_step():
        try:
            return json.loads((run_dir / "progress.json").read_text()).get("step") or 0
        except (OSError, ValueError):
            return 0

    def stored_step():
        runs = [r for r in tracker.runs() if r["run"] == "every" and r["latest"]]
        return (runs[0]["latest"].get("progress") or {}).get("step") or 0 if runs else 0

    with Started(home) as started:
        with open(tmp_path / "onbox.log", "wb") as log:
            proc = started.popen([sys.executable, "-m", "onbox", "run", "--foreground", "--name", "every",
                                  "--restart", "never", "--", sys.executable, str(script), str(go), str(finish)],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: stored_step() == 650, timeout=90, what="the first half in the tracker")
        tracker.kill()
        go.write_text("")
        wait_for(lambda: parsed_step() == 1300, timeout=90, what="the second half trained while the tracker is down")
        wait_for(lambda: sum(1 for n in os.listdir(spool) if n[0].isdigit()) >= 3, timeout=30,
                 what="the beats spooled")
        tracker.start()
        wait_for(lambda: not any(n[0].isdigit() for n in os.listdir(spool)), timeout=60, what="the backlog drained")
        finish.write_text("")
        assert proc.wait(90) == 0, (tmp_path / "onbox.log").read_text()[-3000:]
    steps, after = [], -1
    while True:
        r = requests.get(tracker.url + "/api/v1/runs/every/series",
                         params={"points_after": after, "points_limit": 10_000}, headers=tracker.headers(), timeout=30)
        trainer = r.json()["trainer"]
        steps += [[s, loss] for s, loss in zip(trainer["points"]["step"], trainer["points"]["loss"])]
        after = trainer["next_after"]
        if not trainer["more"]:
            break
    assert steps == [[s, round(4.0 / (1 + s / 100.0), 6)] for s in range(1, 1301)]
    beats = tracker.all_heartbeats("every")
    assert sum(b["points"]["records"] for b in beats) == 1300 and not any(b["points"]["thinned"] for b in beats)
    assert len(beats) < 200  # a beat every 0.5 s: far fewer beats than steps
