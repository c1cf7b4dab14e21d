"""A real `onbox run --mlflow` with a real trainer, against a real MLflow tracking server (tests/hosts/mlflow.py):
every metric the trainer printed or wrote is read back through MLflow's REST API, none missing, none doubled —
through a partition (with the tracker sink beside it, undisturbed), an agent SIGKILLed in the middle of a beat
that takes several requests, a relaunch and a replacement box (the same MLflow run each time)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integration.supervisor_helpers import env_for, onbox, state
from tests.polling import wait_for
from tests.processes import Started, kill_test_processes, pid_alive, signal_own

pytestmark = pytest.mark.integration

TRAIN = r'''
import json, os, sys, time
finish, truth = sys.argv[1], sys.argv[2]
metrics = os.environ["ONBOX_METRICS_FILE"]
printed, written, step = [], [], 0
end = time.monotonic() + 90
while not os.path.exists(finish) and time.monotonic() < end:
    step += 1
    loss = float("%.6f" % (4.0 / (1 + 0.01 * step)))
    print("step %d loss %.6f" % (step, loss))
    printed.append([step, loss])
    if step % 5 == 0:
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": step, "tokens_per_s": 1000.0 + step}) + "\n")
        written.append([step, 1000.0 + step])
    time.sleep(0.02)
with open(truth, "w") as f:
    json.dump({"loss": printed, "tokens_per_s": written, "token_seen": "MLFLOW_TRACKING_TOKEN" in os.environ}, f)
'''


def backlog(run_dir, sink="mlflow"):
    try:
        return sum(1 for n in os.listdir(run_dir / "heartbeats" / ("spool-" + sink)) if n[0].isdigit())
    except FileNotFoundError:
        return 0


def sink_down(home, name):
    return [w for w in state(home, name).get("warnings") or [] if w.get("code") == "sink_down"]


@pytest.mark.slow
def test_partition_every_printed_metric_once_and_the_tracker_undisturbed(mlflow, tracker, tmp_path):
    home = tmp_path / "home"
    script, finish, truth = tmp_path / "train.py", tmp_path / "finish", tmp_path / "truth.json"
    script.write_text(TRAIN)
    run_dir = home / "runs" / "mlrun"
    env = env_for(home, MLFLOW_TRACKING_TOKEN="tok-123", ONBOX_BOX="boxA")
    argv = [sys.executable, "-m", "onbox", "run", "--foreground", "--name", "mlrun", "--restart", "never",
            "--heartbeat-interval", "0.2", "--mlflow", mlflow.relay.url, "--mlflow-experiment", mlflow.experiment,
            "--tracker", tracker.url, "--tracker-token-file", tracker.token_file,
            "--", sys.executable, str(script), str(finish), str(truth)]
    with Started(home) as started:  # the end (a failed test too) stops the agent and the job it started
        with open(tmp_path / "onbox.log", "wb") as log:
            proc = started.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: len(mlflow.relay.metrics_sent(key="loss")) >= 20, timeout=60, what="metrics in MLflow")
        mlflow.relay.cut()
        at_cut = len(tracker.all_heartbeats("mlrun"))
        wait_for(lambda: sink_down(home, "mlrun"), timeout=30, what="the sink_down warning in state.json")
        status = onbox(home, "status", "mlrun")
        assert "heartbeats to mlflow are failing: mlflow unreachable" in status.stdout, status.stdout
        # the tracker's sender does not wait for MLflow's: beats go on arriving, carrying the alert
        beats = wait_for(lambda: [b for b in tracker.all_heartbeats("mlrun")[at_cut:]
                                  if "sink_down" in [a["code"] for a in b["alerts"]]], timeout=30,
                         what="tracker beats with the sink_down alert")
        assert backlog(run_dir, "tracker") <= 2
        wait_for(lambda: backlog(run_dir) >= 10, timeout=30, what="beats spooled for MLflow meanwhile")
        assert len(mlflow.relay.metrics_sent(key="loss")) < wait_for(lambda: json.loads(
            (run_dir / "progress.json").read_text())["step"], what="progress")
        assert beats[0]["seq"] > min(b["seq"] for b in tracker.all_heartbeats("mlrun")[at_cut:]) - 1
        mlflow.relay.restore()
        wait_for(lambda: backlog(run_dir) == 0 and not sink_down(home, "mlrun"), timeout=60,
                 what="the MLflow backlog drained and the warning gone")
        finish.write_text("")
        assert proc.wait(60) == 0, (tmp_path / "onbox.log").read_text()[-3000:]
        status = onbox(home, "status", "mlrun").stdout
    printed = json.loads(truth.read_text())
    assert printed["token_seen"] is False  # U34: the agent's MLflow token is not the child's
    [run] = mlflow.runs()
    run_id = run["info"]["run_id"]
    for key in ("loss", "tokens_per_s"):
        got = sorted((m["step"], m["value"]) for m in mlflow.history(run_id, key))
        assert got == [tuple(p) for p in printed[key]], key  # none missing, none doubled
        sent = mlflow.relay.metrics_sent(run_id, key)
        assert len(sent) == len(set(sent)) == len(printed[key])  # and none sent twice
    info, data = run["info"], run["data"]
    assert info["status"] == "FINISHED" and info["run_name"] == "mlrun"
    params = {p["key"]: p["value"] for p in data["params"]}
    tags = {t["key"]: t["value"] for t in data["tags"]}
    assert params["box"] == "boxA" and params["command"].endswith("train.py %s %s" % (finish, truth))
    assert tags["onbox.run"] == "mlrun" and tags["onbox.state"] == "done"
    assert {r["authorization"] for r in mlflow.relay.records} == {"Bearer tok-123"}
    assert len(mlflow.history(run_id, "system/system_memory_usage_megabytes")) > 10
    assert "mlflow: %s/#/experiments/%s/runs/%s" % (mlflow.relay.url, info["experiment_id"], run_id) in status


TRAIN_BURSTS = r'''
import json, os, sys, time
ctl, metrics = sys.argv[1], os.environ["ONBOX_METRICS_FILE"]
def write(first, n):  # one write: the agent reads the burst as a whole
    data = "".join(json.dumps({"step": s, "loss": 1.0 / s, "lr": s * 1e-6}) + "\n" for s in range(first, first + n))
    fd = os.open(metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, data.encode())
    os.close(fd)
def wait(name):
    end = time.monotonic() + 120
    while not os.path.exists(os.path.join(ctl, name)) and time.monotonic() < end:
        time.sleep(0.02)
nxt = os.path.join(ctl, "next")
if os.path.exists(os.path.join(ctl, "finish")):  # relaunched, or on another box: ten more steps, then done
    first = int(open(nxt).read())
    write(first, 10)
    open(nxt, "w").write(str(first + 10))
    sys.exit(0)
write(1, 50)
wait("go")
write(51, 1500)  # 3,000 metric points in one beat: several runs/log-batch requests
open(nxt, "w").write("1551")
wait("finish")
'''


def test_agent_killed_mid_beat_relaunch_and_replacement_box_share_one_run(mlflow, tmp_path):
    home, home2, ctl = tmp_path / "home", tmp_path / "home2", tmp_path / "ctl"
    ctl.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAIN_BURSTS)
    flags = ["--mlflow", mlflow.relay.url, "--mlflow-experiment", mlflow.experiment, "--heartbeat-interval", "0.2"]
    cmd = ["--", sys.executable, str(script), str(ctl)]
    try:
        r = onbox(home, "run", "--name", "mlr", *flags, *cmd, env_extra={"ONBOX_BOX": "boxA"})
        assert r.returncode == 0, r.stderr
        wait_for(lambda: len(mlflow.relay.metrics_sent(key="loss")) == 50, timeout=60, what="the first 50 steps")
        mlflow.relay.cut_after(lambda rec: len((rec["body"] or {}).get("metrics") or []) > 500)
        (ctl / "go").write_text("")
        wait_for(lambda: mlflow.relay.is_cut, timeout=60, what="the first request of the burst")

        def cursor():
            return json.loads((home / "runs" / "mlr" / "heartbeats" / "mlflow.json").read_text())["cursor"]

        # the answer to that request recorded: part of the beat delivered, the rest not (killing the agent before
        # it wrote the cursor down would be the documented window: that request sent again)
        wait_for(lambda: 500 < cursor()[1] < 3000, timeout=30, what="the cursor in the middle of the burst's beat")
        agent, child = state(home, "mlr")["agent_pid"], state(home, "mlr")["child_pid"]
        signal_own(home, agent, signal.SIGKILL)
        wait_for(lambda: not pid_alive(agent), what="the agent gone")
        assert pid_alive(child)
        r = onbox(home, "adopt", "mlr")
        assert r.returncode == 0, r.stderr
        mlflow.relay.restore()
        wait_for(lambda: len(mlflow.relay.metrics_sent(key="loss")) >= 1550, timeout=60, what="the rest of the burst")
        (ctl / "finish").write_text("")
        wait_for(lambda: state(home, "mlr").get("state") == "done" and not pid_alive(state(home, "mlr")["agent_pid"]),
                 timeout=60, what="the run done")
        # a relaunch of the same run, then the same run on a replacement box (a fresh run dir)
        r = onbox(home, "run", "--foreground", "--name", "mlr", env_extra={"ONBOX_BOX": "boxA"})
        assert r.returncode == 0, r.stderr
        r = onbox(home2, "run", "--foreground", "--name", "mlr", *flags, *cmd, env_extra={"ONBOX_BOX": "boxB"})
        assert r.returncode == 0, r.stderr
    finally:
        kill_test_processes(home)
        kill_test_processes(home2)
    [run] = mlflow.runs()
    run_id = run["info"]["run_id"]
    # every step any attempt wrote (the adopted child's exit 0 is known to the new agent through the child's keeper:
    # no extra attempt; the relaunch and the replacement box ten steps each), once
    last = int((ctl / "next").read_text()) - 1
    assert last == 1570
    assert sorted(m["step"] for m in mlflow.history(run_id, "loss")) == list(range(1, last + 1))
    assert sorted(m["step"] for m in mlflow.history(run_id, "lr")) == list(range(1, last + 1))
    sent = mlflow.relay.metrics_sent(run_id)
    assert len(sent) == len(set(sent))  # the cursor: nothing sent twice across the kill and the relaunches
    statuses = [r["body"]["status"] for r in mlflow.relay.records if r["path"].endswith("runs/update")]
    assert statuses == ["FINISHED", "RUNNING", "FINISHED", "RUNNING", "FINISHED"]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert params["box"] == "boxA" and tags["onbox.box"] == "boxB" and run["info"]["status"] == "FINISHED"
    assert not [t for t in tags if t.startswith("onbox.changed.")]
