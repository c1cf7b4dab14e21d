"""The MLflow sink's parts without a server: what a beat becomes (metrics, tags, status), the point log and the
metrics file's saved position, the options and credentials (U34), a sink that is down said out loud."""
from __future__ import annotations

import base64
import json
import os
import threading

import pytest

from onbox.config import RunConfig, agent_only_vars, resolve
from onbox.errors import UsageError
from onbox.heartbeat.collect import BoxReaders
from onbox.heartbeat.hook import HeartbeatHook
from onbox.heartbeat.mlflow import beat_tags, metric_entries, mlflow_doc, run_status
from onbox.heartbeat.mlflow_rest import auth_header
from onbox.heartbeat.sinks import Backoff, Sender, SinkError
from onbox.heartbeat.spool import Spool
from onbox.supervisor.childenv import child_env
from onbox.supervisor.notes import RunNotes
from onbox.telemetry.alerts import AlertEngine
from onbox.telemetry.progress import MetricsFileTail, PointLog
from tests.fakes.run_context import run_context
from tests.fakes.supervisor import loop_step


def beat(**kw):
    doc = {"seq": 7, "time": 1000.5, "state": "running", "attempt": 2, "box": "b1", "child": {"restarts": 1},
           "progress": {"step": 40}, "alerts": [{"code": "stall"}, {"code": "gpu_throttle"}],
           "slurm": {"job_id": "55", "array_job_id": "50", "array_task_id": "3"},
           "host": {"memory_current_bytes": 3e9},
           "gpus": {"gpus": [{"index": 1, "util_percent": 99.0, "memory_used_bytes": 4e10, "memory_total_bytes": 8e10,
                              "power_w": 300.0, "temperature_c": None, "name": "H100"}]}}
    doc.update(kw)
    return doc


def test_a_beat_becomes_points_at_the_trainers_step_then_system_metrics():
    points = [[5000, 3, {"loss": 2.5, "lr": 1e-4}], [5001, None, {"eval_loss": "NaN", "tokens_per_s": True}]]
    doc = mlflow_doc(beat(), points, 0)
    entries = metric_entries(json.loads(json.dumps(doc)))  # what the spool gives back
    assert [(e["key"], e["value"], e["timestamp"], e["step"]) for e in entries] == [
        ("loss", 2.5, 5000, 3), ("lr", 1e-4, 5000, 3), ("eval_loss", "NaN", 5001, 0),
        ("system/gpu_1_utilization_percentage", 99.0, 1000500, 40),
        ("system/gpu_1_memory_usage_megabytes", 40000.0, 1000500, 40),
        ("system/gpu_1_power_usage_watts", 300.0, 1000500, 40),
        ("system/gpu_1_memory_usage_percentage", 50.0, 1000500, 40),
        ("system/system_memory_usage_megabytes", 3000.0, 1000500, 40)]
    assert metric_entries(mlflow_doc(beat(progress={"step": 10 ** 30}), [], 0))[0]["step"] == 2 ** 63 - 1
    assert beat_tags(doc, 4) == {"onbox.state": "running", "onbox.attempt": "2", "onbox.box": "b1",
                                 "onbox.restarts": "1", "onbox.alerts": "gpu_throttle,stall",
                                 "onbox.slurm_job": "50_3", "onbox.points_dropped": "4"}


def test_statuses_a_preempted_run_stays_running():
    assert [run_status(s) for s in ("done", "failed", "stopped", "preempted", "running", "backoff")] == [
        "FINISHED", "FAILED", "KILLED", "RUNNING", "RUNNING", "RUNNING"]


def test_point_log_keeps_every_record_bounded():
    log = PointLog(limit=3)
    log.add({"step": 1}, 1, 1.0)  # a step alone is no metric
    for i in range(5):
        log.add({"step": i, "loss": float("nan") if i == 4 else i}, i, 2.0 + i)
    points, dropped = log.take()
    assert dropped == 2 and [p[1] for p in points] == [2, 3, 4] and points[-1][2] == {"loss": "NaN"}
    assert log.take() == ([], 0)


def test_metrics_file_position_resumes_and_rereads_a_partial_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1}\n{"step": 2, "lo')
    tail = MetricsFileTail(str(path))
    assert [r["step"] for r in tail.read_new()] == [1]
    pos = tail.position()
    with open(path, "a") as f:
        f.write('ss": 2}\n')
    again = MetricsFileTail(str(path))
    again.resume(json.loads(json.dumps(pos)))
    assert [r["step"] for r in again.read_new()] == [2]
    os.replace(str(path), str(tmp_path / "old"))
    path.write_text('{"step": 9, "loss": 1}\n')  # another file: from its top
    fresh = MetricsFileTail(str(path))
    fresh.resume(pos)
    assert [r["step"] for r in fresh.read_new()] == [9]


class PointsSink:
    name = "pts"
    wants_points = True

    def __init__(self):
        self.got = []

    def spool_doc(self, beat, points, dropped):
        return {"seq": beat["seq"], "points": points}

    def send(self, beats):
        self.got += beats

    def close(self):
        pass


def hook_with(tmp_path, sink):
    ctx = run_context(tmp_path, name="r", durable=None)
    run_dir = tmp_path / "run"
    readers = BoxReaders(gpu=lambda: {"available": False, "gpus": []}, host=lambda: {}, disks=lambda p: [])
    return HeartbeatHook(ctx, readers=readers, sinks=[sink], close_timeout=5.0), run_dir


def test_points_go_with_the_next_beat_and_a_restarted_agent_reads_the_metrics_file_on(tmp_path):
    state = {"state": "running", "attempt": 0, "child_pid": None}
    sink = PointsSink()
    hook, run_dir = hook_with(tmp_path, sink)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 3}\n{"step": 2, "loss": 2}\n')
    loop_step(hook, "step 3 loss 1.5")
    hook.tick(state)
    hook.close(state)
    first = sink.got[0]
    assert sorted((p[1], p[2]["loss"]) for p in first["points"]) == [(1, 3.0), (2, 2.0), (3, 1.5)]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1}\n')
    sink2 = PointsSink()
    hook2, _ = hook_with(tmp_path, sink2)  # the agent again: only the new record
    loop_step(hook2)
    hook2.tick(state)
    hook2.close(state)
    assert [p[1] for b in sink2.got for p in b["points"]] == [4]


def test_options_and_credentials_stay_with_the_agent(tmp_path):
    cfg = resolve({}, environ={"ONBOX_MLFLOW": "http://10.0.0.5:5000/", "ONBOX_MLFLOW_EXPERIMENT": "sweeps"})
    assert (cfg.mlflow, cfg.mlflow_experiment) == ("http://10.0.0.5:5000/", "sweeps")
    for bad, what in (({"mlflow": "ftp://x"}, "not an http"), ({"mlflow": "http://u:pw@host:5000"}, "credentials"),
                      ({"mlflow": "http://h", "mlflow_experiment": " "}, "one-line name")):
        with pytest.raises(UsageError, match=what):
            RunConfig.from_dict(bad).validate()
    base = {"MLFLOW_TRACKING_TOKEN": "t", "MLFLOW_TRACKING_PASSWORD": "p", "ONBOX_TRACKER_TOKEN": "x", "PATH": "/b"}
    on, off = RunConfig(mlflow="http://h"), RunConfig()
    env_on = child_env(base, "r", "/c", None, 0, "/m", "/p", {}, agent_only=agent_only_vars(on))
    env_off = child_env(base, "r", "/c", None, 0, "/m", "/p", {}, agent_only=agent_only_vars(off))
    assert not {"MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "ONBOX_TRACKER_TOKEN"} & set(env_on)
    assert env_off["MLFLOW_TRACKING_TOKEN"] == "t"  # without --mlflow it is the trainer's own, untouched
    token = tmp_path / "tok"
    token.write_text("from-file\n")
    env = {"MLFLOW_TRACKING_TOKEN": "env", "MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "p"}
    assert auth_header(str(token), env) == "Bearer from-file"
    assert auth_header(None, env) == "Basic " + base64.b64encode(b"u:p").decode()
    assert auth_header(None, {"MLFLOW_TRACKING_TOKEN": "env"}) == "Bearer env"
    assert auth_header(None, {}) is None


class DownSink:
    name = "mlflow"

    def __init__(self):
        self.up = threading.Event()

    def send(self, beats):
        if not self.up.is_set():
            raise SinkError("mlflow unreachable: ConnectionError")

    def close(self):
        pass


def test_a_sink_down_is_a_warning_an_alert_and_goes_when_it_answers(tmp_path):
    notes, events = RunNotes(), []
    sink = DownSink()
    spool = Spool(str(tmp_path / "spool"))
    spool.put(1, {"seq": 1})

    def health(ok, error):
        ev = {"type": "heartbeat_sink_up" if ok else "heartbeat_sink_down", "sink": "mlflow", "error": error,
              "hint": "check"}
        events.append(ev)
        notes.on_event(ev)

    sender = Sender(sink, spool, backoff=Backoff(base=0.001, cap=0.002, floor=0.001), on_health=health)
    sender.start()
    try:
        assert not sender.flush(0.3)
        assert [e["type"] for e in events] == ["heartbeat_sink_down"]  # once, not at every failure
        [w] = notes.to_state()["warnings"]
        assert w["code"] == "sink_down" and "mlflow unreachable" in w["message"]
        engine = AlertEngine()
        engine.evaluate(child_alive=True, state=notes.to_state())
        assert [a.code for a in engine.collect()] == ["sink_down"]
        sink.up.set()
        assert sender.flush(10)
    finally:
        sender.stop()
    assert [e["type"] for e in events] == ["heartbeat_sink_down", "heartbeat_sink_up"]
    assert notes.to_state()["warnings"] == []
