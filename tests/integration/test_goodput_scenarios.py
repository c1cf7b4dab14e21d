"""The goodput ledger on real runs: real agents (`onbox run`), a real trainer (goodput_trainer.py, keep_trainer.py,
slurm_trainer.py), a real tracker (`onboxctl tracker serve`) the agents send their beats to, then `onboxctl report`
and the tracker's `GET /api/v1/goodput`. Each scenario checks what the ledger must always hold (the parts sum to the
wall time, the segments tile it) and what the trainer's own trace says was trained: the steps kept (each once) and
the steps trained again.

- a preemption mid-interval: the trainer ignores the notice, the steps since its newest checkpoint are lost; the
  run relaunched on the same box resumes from the committed step;
- a crash loop: every start crashes a few steps in, the restarts run out and the run ends failed: every step past
  its final durable checkpoint is lost for good;
- a recovery onto a spare (tests/hosts/keeper_rig.py: netns boxes, sshd, `onboxctl keep`): the box dies, the keeper
  relaunches the run on the pool's spare;
- a fenced box: the box is cut off while it trains, the keeper recovers on the spare with --take-over, after the
  heal the old agent sees the newer lease and ends `fenced`; the time both trained at once is counted apart;
- a Slurm requeue (tests/hosts/slurm.py): USR1, the trainer saves, the job requeues and resumes.

With GOODPUT_CAPTURE=1 each scenario's timeline is saved to tests/fixtures/goodput/ (tests/goodput_timeline.py),
which tests/unit/test_goodput_scenarios.py replays in milliseconds.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from controller.goodput.fold import fold
from controller.goodput.ledger import ledger_of
from tests.conftest import REPO_ROOT, subprocess_env
from tests.goodput_timeline import check_ledger, save_fixture, trace_truth, tracker_timeline
from tests.hosts.tracker import TrackerProcess
from tests.integration.supervisor_helpers import env_for, state
from tests.polling import wait_for
from tests.processes import Started

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("cleanup")]
TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "goodput_trainer.py")


@pytest.fixture
def tracker(tmp_path):
    t = TrackerProcess(str(tmp_path / "tracker")).start()
    try:
        yield t
    finally:
        t.stop()


def goodput(tracker, run):
    import requests

    r = requests.get(tracker.url + "/api/v1/goodput", params={"run": run, "segments": 1}, headers=tracker.headers(),
                     timeout=30)
    r.raise_for_status()
    runs = r.json()["runs"]
    assert [x["run"] for x in runs] == [run], runs
    return runs[0]


def report(tracker, run, *args):
    env = subprocess_env({"ONBOX_TRACKER": tracker.url, "ONBOX_TRACKER_TOKEN": tracker.token,
                          "ONBOX_CONFIG_DIR": os.path.join(tracker.workdir, "cfg")})
    r = subprocess.run([sys.executable, "-m", "controller", "report", run, *args], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout


def same_as_offline(tracker, run, led):
    """The tracker's ledger (its SQL fold) is the one the pure function gives over the beats as any reader gets
    them: returns the timeline."""
    beats = tracker_timeline(tracker, run)
    mine = ledger_of(fold(beats).contexts, led["end"] if led["live"] or led["state"] == "preempted" else None)
    d = mine.to_dict()
    for part, seconds in led["parts"].items():
        assert abs(d["parts"][part] - seconds) < 0.05, (part, d["parts"], led["parts"])
    assert d["recomputed_steps"] == led["recomputed_steps"] and d["kept_steps"] == led["kept_steps"]
    return beats


def agent(started, home, name, tracker, trace, *trainer, opts=()):
    argv = [sys.executable, "-m", "onbox", "run", "--foreground", "--name", name, "--durable", str(home / "durable"),
            "--sync-interval", "0.2", "--settle-seconds", "0.1", "--heartbeat-interval", "0.25", "--tracker",
            tracker.url, "--tracker-token-file", tracker.token_file, *opts, "--", sys.executable, TRAINER,
            "--trace", str(trace), *trainer]
    return started.popen(argv, env=env_for(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)


def manifest_step(path):
    with open(path) as f:
        return json.load(f)["step"]


def steps_in(trace):
    try:
        with open(trace) as f:
            return [json.loads(x)["step"] for x in f if '"step"' in x]
    except OSError:
        return []


def test_a_preemption_mid_interval_loses_the_steps_since_the_newest_checkpoint_and_no_more(onbox_home, tmp_path,
                                                                                              tracker):
    trace = tmp_path / "trace.jsonl"
    trainer = ("--steps", "80", "--interval", "0.04", "--save-every", "10", "--ignore-term")
    with Started(onbox_home) as started:
        a = agent(started, onbox_home, "gpm", tracker, trace, *trainer, opts=("--grace", "0.3"))
        # mid-interval: past a committed checkpoint, several steps before the next
        wait_for(lambda: (lambda s: s and s[-1] >= 25 and s[-1] % 10 in (4, 5, 6))(steps_in(trace)), 60,
                 "the trainer between two checkpoints", 0.01)
        a.send_signal(signal.SIGTERM)  # the notice; the trainer ignores it and is killed at the grace's end
        _out, err = a.communicate(timeout=60)
        assert a.returncode == 75, err
        lost_at = steps_in(trace)[-1]
        b = agent(started, onbox_home, "gpm", tracker, trace, *trainer)  # relaunched on the same box
        _out, err = b.communicate(timeout=120)
        assert b.returncode == 0, err
    truth = trace_truth(str(trace))
    assert truth["recomputed_steps"] > 0 and truth["last_step"] == 80 and len(truth["starts"]) == 2
    led = wait_for(lambda: (lambda x: x if x["state"] == "done" else None)(goodput(tracker, "gpm")), 30, "the end")
    save_fixture("preempted_mid_interval", "gpm", tracker_timeline(tracker, "gpm"), None, truth,
                 {"losses": ["preempted"], "restarts": 1, "preemptions": 1})
    check_ledger(led)
    assert led["kept_steps"] == 80 == truth["kept_steps"]
    assert led["recomputed_steps"] == truth["recomputed_steps"] == lost_at - truth["starts"][1]
    assert [x["why"] for x in led["losses"]] == ["preempted"] and led["preemptions"] == 1 and led["restarts"] == 1
    p = led["parts"]
    assert p["recomputed"] > 0 and p["down"] > 0 and p["restoring"] > 0 and p["starting"] > 0 and p["productive"] > 0
    same_as_offline(tracker, "gpm", led)
    out = report(tracker, "gpm")
    assert "gpm" in out and "GOODPUT" in out and "%.1f%%" % (100 * led["goodput"]) in out, out


def test_a_crash_loop_that_ends_failed_loses_every_step_past_its_final_durable_checkpoint(onbox_home, tmp_path,
                                                                                           tracker):
    trace = tmp_path / "trace.jsonl"
    with Started(onbox_home) as started:
        a = agent(started, onbox_home, "gcl", tracker, trace, "--steps", "1000", "--interval", "0.03", "--save-every",
                  "8", "--crash-after", "13", "--crashes", "100", opts=("--restart", "on-failure", "--max-restarts",
                                                                         "3"))
        _out, err = a.communicate(timeout=120)
        assert a.returncode == 1, err
    assert state(onbox_home, "gcl")["state"] == "failed"
    final = max(manifest_step(os.path.join(root, "MANIFEST.json"))
                for root, _dirs, files in os.walk(onbox_home / "durable" / "gcl" / "checkpoints")
                if "MANIFEST.json" in files)
    truth = trace_truth(str(trace), final_durable=final)
    n = len(truth["starts"])  # the first and its restarts (the policy may call it a crash loop before the 3rd)
    assert n >= 3 and truth["recomputed_steps"] > 0
    led = wait_for(lambda: (lambda x: x if x["state"] == "failed" else None)(goodput(tracker, "gcl")), 30, "the end")
    whys = ["crashed"] * (n - 1) + ["failed"]
    save_fixture("crash_loop", "gcl", tracker_timeline(tracker, "gcl"), None, truth,
                 {"losses": whys, "restarts": n - 1, "preemptions": 0})
    check_ledger(led)
    assert led["kept_steps"] == truth["kept_steps"] == final
    assert led["recomputed_steps"] == truth["recomputed_steps"]
    assert [x["why"] for x in led["losses"]] == whys, led["losses"]
    assert led["restarts"] == n - 1 and led["preemptions"] == 0 and not led["live"]
    p = led["parts"]
    assert p["recomputed"] > 0 and p["down"] > 0 and p["restoring"] > 0  # the backoffs, each attempt's setup
    same_as_offline(tracker, "gcl", led)


# -- on netns boxes with the keeper (tests/hosts/keeper_rig.py) ----------------------------------------------------
@pytest.fixture
def rig(tmp_path, onbox_pyz):
    from tests.hosts.keeper_rig import Rig

    r = Rig(tmp_path, onbox_pyz)
    yield r
    r.close()


def box_steps(rig, name):
    """Every step the trainer printed on box `name` (its run's output.log: keep_trainer.py's JSON lines)."""
    path = os.path.join(rig.boxes[name].home, ".onbox", "runs", rig.run_on(name), "output.log")
    with open(path) as f:
        return [json.loads(x)["step"] for x in f if x.startswith('{"step"')]


def box_tracker(rig, box):
    tracker = TrackerProcess(str(rig.tmp / "tracker"), host=box.netns.host_addr).start()  # the boxes reach it
    rig.env["ONBOX_TRACKER_TOKEN"] = tracker.token
    return tracker


def newest_step(tracker, run):
    runs = [r for r in tracker.runs() if r["run"] == run]
    return ((runs[0].get("latest") or {}).get("progress") or {}).get("step") or 0 if runs else 0


def reported(beats, box):
    """The newest step a box's beats reported (a box that dies takes what it trained after its last beat along)."""
    return max((b.step for b in beats if b.box == box and b.step is not None), default=0)


def test_a_recovery_onto_a_spare_loses_the_dead_boxs_steps_since_its_newest_commit(netns_boxes, rig):
    from tests.goodput_timeline import steps_truth

    b0, s0 = netns_boxes(2)
    tracker = box_tracker(rig, b0)
    try:
        rig.add("b0", b0)
        rig.add("s0", s0, pool="p")
        rig.ctl("push", "b0", "--pyz", rig.pyz)
        rig.launch("b0", "--tracker", tracker.url, "--tracker-token-file", tracker.token_file, heartbeat=0.3,
                   save_every=40, step_interval=0.1)
        # the box dies mid-interval: its beats said steps past its newest checkpoint (a checkpoint every 4 s, the
        # beats ~5 steps behind the trainer: the next commit is seconds away when it dies)
        wait_for(lambda: (lambda s: s > 40 and 10 <= s % 40 <= 25)(newest_step(tracker, rig.run)), 90,
                 "b0 between two checkpoints", 0.02)
        rig.kill_box("b0")  # the box dies: its agent and trainer killed, its sshd gone
        cut = newest_step(tracker, rig.run)  # what b0's beats said; what it trained after them died with it
        rig.keeper()
        wait_for(rig.recovered, 90, "the run to train again on the spare", 0.3)
        resumed = rig.starts()[-1]["start"]
        wait_for(lambda: max(box_steps(rig, "s0") or [0]) >= cut + 10, 60, "the spare past b0's last step")
        rig.kill_run("s0", signal.SIGTERM)  # ends it: the trainer saves the step it is in, the run ends preempted
        wait_for(lambda: rig.state("s0").get("state") == "preempted", 60, "the spare's run preempted")
        led = wait_for(lambda: (lambda x: x if x["state"] == "preempted" else None)(goodput(tracker, rig.run)), 30,
                       "its last beat")
        beats = tracker_timeline(tracker, rig.run)
        assert reported(beats, "b0") == cut
        truth = steps_truth([s for s in box_steps(rig, "b0") if s <= cut] + box_steps(rig, "s0"),
                            starts=[x["start"] for x in rig.starts()])
        save_fixture("recovery_onto_a_spare", rig.run, beats, led["end"], truth,
                     {"losses": ["lost", "preempted"], "restarts": 1, "preemptions": 1, "boxes": ["b0", "s0"]})
        check_ledger(led)
        assert truth["recomputed_steps"] == cut - resumed > 0
        assert led["kept_steps"] == truth["kept_steps"] and led["recomputed_steps"] == truth["recomputed_steps"]
        assert [(x["why"], x["box"]) for x in led["losses"]] == [("lost", "b0"), ("preempted", "s0")], led["losses"]
        assert set(led["by_box"]) == {"b0", "s0"} and led["by_box"]["s0"]["down"] > 0  # detection, push, relaunch
        assert led["by_box"]["b0"]["recomputed"] > 0 and led["by_box"]["s0"]["restoring"] > 0
        assert led["restarts"] == 1 and led["overlap_s"] == {}
        same_as_offline(tracker, rig.run, led)
    finally:
        tracker.stop()


def test_a_fenced_box_trains_beside_its_replacement_and_that_time_is_counted_apart(netns_boxes, rig):
    from tests.goodput_timeline import steps_truth
    from tests.hosts.sshd_box import BridgeNet

    b0, s0 = netns_boxes(2)
    tracker = box_tracker(rig, b0)
    try:
        rig.add("b0", b0)
        rig.add("s0", s0, pool="p")
        rig.ctl("push", "b0", "--pyz", rig.pyz)
        rig.launch("b0", "--tracker", tracker.url, "--tracker-token-file", tracker.token_file)
        wait_for(lambda: len(rig.committed()) >= 1, 60, "a durable commit")
        ns = b0.netns
        subprocess.run(["ip", "-n", ns.ns, "link", "set", BridgeNet.IFNAME, "down"], check=True, timeout=30)  # the cut
        try:
            keep = rig.keeper()
            wait_for(rig.recovered, 120, "the recovery on the spare", 0.3)
        finally:
            subprocess.run(["ip", "-n", ns.ns, "link", "set", BridgeNet.IFNAME, "up"], check=True, timeout=30)
        wait_for(lambda: rig.state("b0").get("state") == "fenced", 60, "b0 fenced after the heal")
        resumed = rig.starts()[-1]["start"]
        wait_for(lambda: max(box_steps(rig, "s0") or [0]) >= resumed + 20, 60, "20 steps on the spare")
        # the keeper goes first: it would relaunch the preempted run on s0 at once (the scenario ends preempted)
        keep.terminate()
        keep.wait(timeout=30)
        rig.kill_run("s0", signal.SIGTERM)
        wait_for(lambda: rig.state("s0").get("state") == "preempted", 60, "the spare's run preempted")
        # b0's spooled beats (sent after the heal) and s0's: every beat of both is in
        seen = []

        def both_in():
            seen[:] = [goodput(tracker, rig.run)]
            return seen[0] if seen[0]["state"] == "preempted" and "b0" in seen[0]["overlap_s"] else None
        try:
            led = wait_for(both_in, 60, "b0's beats after the heal")
        except AssertionError as e:  # what the tracker folded instead: the state, the overlap, the losses
            raise AssertionError("%s: %s" % (e, {k: seen[0].get(k) for k in ("state", "live", "overlap_s", "losses",
                                                                               "restarts")} if seen else None))
        beats = tracker_timeline(tracker, rig.run)
        truth = steps_truth(box_steps(rig, "b0") + box_steps(rig, "s0"), starts=[x["start"] for x in rig.starts()])
        save_fixture("fenced_box", rig.run, beats, led["end"], truth,
                     {"losses": ["fenced", "preempted"], "restarts": 1, "preemptions": 1, "boxes": ["b0", "s0"],
                      "overlap": ["b0"]})
        check_ledger(led)
        assert truth["recomputed_steps"] > 0 and max(box_steps(rig, "b0")) > resumed  # b0 trained on, cut off
        assert led["kept_steps"] == truth["kept_steps"] and led["recomputed_steps"] == truth["recomputed_steps"]
        assert [(x["why"], x["box"]) for x in led["losses"]] == [("fenced", "b0"), ("preempted", "s0")], led["losses"]
        assert led["overlap_s"]["b0"] > 0 and led["losses"][0]["overlap_s"] > 0  # both trained at once
        same_as_offline(tracker, rig.run, led)
    finally:
        tracker.stop()


def test_a_slurm_requeue_is_down_while_it_waits_and_loses_nothing_the_trainer_saved(slurm_cluster, tmp_path, tracker):
    from tests.goodput_timeline import steps_truth
    from tests.integration.test_slurm_e2e import submit

    job = submit(slurm_cluster, tmp_path, ["--steps", "40", "--interval", "0.1"],
                 run_args=("--restart", "never", "--keep-last", "100", "--heartbeat-interval", "0.5"),
                 extra_env={"ONBOX_TRACKER": tracker.url, "ONBOX_TRACKER_TOKEN": tracker.token})
    job.wait_output(r"^step 8$")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.id])
    slurm_cluster.wait_job(job.id, ("COMPLETED",), timeout=90, restarts=1)
    assert job.state().get("state") == "done"
    led = wait_for(lambda: (lambda x: x if x["state"] == "done" else None)(goodput(tracker, job.run)), 30, "the end")
    beats = tracker_timeline(tracker, job.run)
    truth = steps_truth(job.steps())
    save_fixture("slurm_requeue", job.run, beats, None, truth, {"losses": ["preempted"], "restarts": 1,
                                                                 "preemptions": 1})
    check_ledger(led)
    assert truth["recomputed_steps"] == 0 and truth["kept_steps"] == 40
    assert led["kept_steps"] == 40 and led["recomputed_steps"] == 0
    assert [x["why"] for x in led["losses"]] == ["preempted"] and led["restarts"] == 1
    assert led["parts"]["down"] > 0 and led["parts"]["restoring"] > 0  # the requeue's wait, the restore
    same_as_offline(tracker, job.run, led)
