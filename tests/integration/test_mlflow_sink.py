"""The MLflow sink against a real MLflow tracking server (tests/hosts/mlflow.py), driven in-process: MLflow's
batch limits, the delivery cursor across a cut and a restart, the one copy MLflow keeps of a resent request, run
reuse (replacement box, changed params), statuses, a deleted run, two boxes creating the run at once.

What went over the wire is read from the relay (the SQL store would hide a double send); what MLflow kept is read
back through its REST API."""
from __future__ import annotations

import threading
import time

import pytest

from onbox.heartbeat.mlflow import MlflowSink, mlflow_doc
from onbox.heartbeat.sinks import SinkError

pytestmark = pytest.mark.integration

T0 = 1_750_000_000.0


def beat(seq, state="running", box="boxA", points=(), step=0, gpus=0):
    doc = {"seq": seq, "time": T0 + seq, "state": state, "attempt": 0, "box": box, "child": {"restarts": 0},
           "progress": {"step": step}, "alerts": [], "slurm": None, "host": {"memory_current_bytes": 2e9},
           "gpus": {"gpus": [{"index": i, "util_percent": 90.0 + i, "memory_used_bytes": 7e10,
                              "memory_total_bytes": 8e10, "power_w": 500.0, "temperature_c": 70} for i in range(gpus)]}}
    return mlflow_doc(doc, list(points), 0)


def sink(mlflow, tmp_path, state="a.json", box="boxA", **params):
    return MlflowSink(mlflow.relay.url, mlflow.experiment, "run1", {"command": "python train.py", "box": box,
                                                                   **params}, str(tmp_path / state))


def points(first_step, n, t_ms):
    return [[t_ms + k, first_step + k, {"loss": 1.0 / (first_step + k), "lr": 1e-4 * k}] for k in range(n)]


def test_a_big_beat_is_split_within_the_limits_and_a_restart_resumes_at_the_cursor(mlflow, tmp_path):
    big = beat(10, points=points(1, 2500, int(T0 * 1000)), step=2500, gpus=2)  # 5000 + 2 x 5 + 1 points
    s = sink(mlflow, tmp_path, **{"p%03d" % i: str(i) for i in range(150)})  # 152 params: two requests
    mlflow.relay.cut_after(lambda r: r["path"].endswith("log-batch") and len(r["body"].get("metrics") or []) > 500)
    with pytest.raises(SinkError):
        s.send([big])
    assert s.cursor is not None and 0 < s.cursor[1] < 5011 and s.cursor[0] == 10
    mlflow.relay.restore()
    again = sink(mlflow, tmp_path, **{"p%03d" % i: str(i) for i in range(150)})  # a restarted agent
    again.send([big])
    assert again.run_id == s.run_id and again.cursor == (10, 5011)
    again.send([big])  # the spool lost the ack: nothing is sent twice
    batches = mlflow.relay.log_batches(s.run_id)
    for r in batches:
        b = r["body"]
        n_m, n_p, n_t = len(b.get("metrics") or []), len(b.get("params") or []), len(b.get("tags") or [])
        assert n_m <= 1000 and n_p <= 100 and n_t <= 100 and n_m + n_p + n_t <= 1000
        assert len(str(b)) < 1_000_000
    assert sum(1 for r in batches if r["body"].get("metrics")) >= 6
    sent = mlflow.relay.metrics_sent(s.run_id)
    assert len(sent) == len(set(sent)) == 5011
    loss = mlflow.history(s.run_id, "loss")
    assert sorted((m["step"], m["value"]) for m in loss) == [(k, 1.0 / k) for k in range(1, 2501)]
    assert len(mlflow.history(s.run_id, "system/gpu_1_utilization_percentage")) == 1
    run = mlflow.server.run(s.run_id)
    assert len(run["data"]["params"]) == 152


def test_an_answer_lost_after_the_server_stored_it_is_resent_and_mlflow_keeps_one_copy(mlflow, tmp_path):
    s = sink(mlflow, tmp_path)
    s.send([beat(1, points=points(1, 5, int(T0 * 1000)))])
    mlflow.relay.lose_answer(lambda r: r["path"].endswith("log-batch") and bool(r["body"].get("metrics")))
    b2 = beat(2, points=points(6, 5, int(T0 * 1000) + 10))
    with pytest.raises(SinkError):
        s.send([b2])
    s.send([b2])
    sent = mlflow.relay.metrics_sent(s.run_id, "loss")
    assert len(sent) == 15 and len(set(sent)) == 10  # the documented window: sent twice...
    assert [m["step"] for m in mlflow.history(s.run_id, "loss")] == list(range(1, 11))  # ...stored once


def test_replacement_box_reuses_the_run_params_stay_statuses_follow_the_state(mlflow, tmp_path):
    a = sink(mlflow, tmp_path, "a.json", box="boxA", profile="generic")
    a.send([beat(1), beat(2, state="done")])
    run_id = a.run_id
    assert mlflow.server.run(run_id)["info"]["status"] == "FINISHED"
    b = sink(mlflow, tmp_path, "b.json", box="boxB", profile="vastai")  # a fresh run dir on another box
    statuses = []
    for seq, state in ((3, "running"), (4, "preempted"), (5, "failed"), (6, "starting"), (7, "stopped")):
        b.send([beat(seq, state=state, box="boxB")])
        statuses.append(mlflow.server.run(run_id)["info"]["status"])
    assert b.run_id == run_id and len(mlflow.runs()) == 1
    assert statuses == ["RUNNING", "RUNNING", "FAILED", "RUNNING", "KILLED"]
    run = mlflow.server.run(run_id)
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert params == {"command": "python train.py", "box": "boxA", "profile": "generic"}
    assert tags["onbox.changed.profile"] == "vastai" and "onbox.changed.box" not in tags
    assert tags["onbox.box"] == "boxB" and tags["onbox.state"] == "stopped" and tags["onbox.run"] == "run1"


def test_a_whole_life_delivered_in_one_request_still_reads_running_then_finished_with_its_own_end(mlflow, tmp_path):
    a = sink(mlflow, tmp_path, "a.json")
    a.send([beat(1), beat(2, state="done")])
    first_end = mlflow.server.run(a.run_id)["info"]["end_time"]
    # the same run relaunched on a slow link: its starting, running and done beats reach the sink together
    b = sink(mlflow, tmp_path, "b.json")
    b.send([beat(13, state="starting"), beat(14), beat(15, state="done")])
    updates = [(r["body"]["status"], r["body"].get("end_time")) for r in mlflow.relay.records
               if r["path"].endswith("runs/update")]
    assert [u[0] for u in updates] == ["FINISHED", "RUNNING", "FINISHED"]
    assert updates[-1][1] == int((T0 + 15) * 1000)
    info = mlflow.server.run(a.run_id)["info"]
    assert info["status"] == "FINISHED" and int(info["end_time"]) == int((T0 + 15) * 1000) > int(first_end)


def test_a_run_deleted_in_mlflow_is_replaced_by_a_new_one(mlflow, tmp_path):
    s = sink(mlflow, tmp_path)
    s.send([beat(1, points=points(1, 3, int(T0 * 1000)))])
    old = s.run_id
    mlflow.server.api("POST", "runs/delete", {"run_id": old})
    b2 = beat(2, points=points(4, 3, int(T0 * 1000) + 10))
    with pytest.raises(SinkError, match="gone"):
        s.send([b2])
    s.send([b2])
    assert s.run_id != old and [r["info"]["run_id"] for r in mlflow.runs()] == [s.run_id]
    assert [m["step"] for m in mlflow.history(s.run_id, "loss")] == [4, 5, 6]


def test_two_boxes_starting_at_once_end_in_one_experiment_and_one_run(mlflow, tmp_path):
    sinks = [sink(mlflow, tmp_path, "s%d.json" % i, box="box%d" % i) for i in range(3)]
    errors = []
    go = threading.Event()

    def first_send(s, i):
        go.wait(10)
        try:
            s.send([beat(100 * i + 1, box="box%d" % i)])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=first_send, args=(s, i)) for i, s in enumerate(sinks)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    go.set()
    for t in threads:
        t.join(30)
    assert not errors
    assert len({s.run_id for s in sinks}) == 1
    assert [r["info"]["run_id"] for r in mlflow.runs()] == [sinks[0].run_id]


def test_a_beat_resent_after_its_delivery_does_not_count_its_dropped_points_twice(mlflow, tmp_path):
    b1 = mlflow_doc(dict(beat(1), gpus=None), points(1, 3, int(T0 * 1000)), 2)  # the point log dropped 2
    b2 = mlflow_doc(dict(beat(2), gpus=None), points(4, 3, int(T0 * 1000) + 10), 5)  # then 5
    s = sink(mlflow, tmp_path)
    s.send([b1, b2])
    again = sink(mlflow, tmp_path)  # the agent died between the cursor's save and the spool's ack
    again.send([b1, b2])
    again.send([b2])
    tags = {t["key"]: t["value"] for t in mlflow.server.run(s.run_id)["data"]["tags"]}
    assert tags["onbox.points_dropped"] == "7" and again.dropped_total == 7
    assert [m["step"] for m in mlflow.history(s.run_id, "loss")] == list(range(1, 7))
    assert len(mlflow.relay.metrics_sent(s.run_id, "loss")) == 6
