"""MLflow sink benchmarks (`python -m tests.bench mlflow`), against a real `mlflow server` (SQLite backend) from
build/out/mlflow-venv (`make mlflow-venv`; skipped, saying so, without it).

1. Delivery: BEATS heartbeats (each: one trainer record of loss/lr/tokens/s, 8 GPUs, host memory = 45 metric
   points) spooled, then pushed by the real Sender + MlflowSink; heartbeats/s from the first send to an empty
   spool (fsynced spool reads, acks and cursor writes included). Side by side, the `mlflow` Python client's own
   `MlflowClient.log_batch` with the same metric points, 100 beats a call (run in the mlflow venv as a
   subprocess, only the calls timed). Three rounds each, alternated; the best round of each is shown (the load
   average is printed: the 2-core machine is shared).
2. Agent CPU per heartbeat (all threads: beat, spool writes, senders, HTTP): the tracker sink alone (a real
   `onboxctl tracker serve`) vs the tracker and the MLflow sink together.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict

BEATS = 1000
CPU_BEATS = 300
GPUS = 8

CLIENT = r'''
import json, sys, time
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
url, experiment, path = sys.argv[1:4]
groups = json.load(open(path))
client = MlflowClient(tracking_uri=url)
eid = client.create_experiment(experiment)
run = client.create_run(eid, run_name="mlflow-client")
groups = [[Metric(m["key"], float(m["value"]), m["timestamp"], m["step"]) for m in g] for g in groups]
t0 = time.perf_counter()
for g in groups:
    client.log_batch(run.info.run_id, metrics=g)
print(json.dumps({"seconds": time.perf_counter() - t0, "run_id": run.info.run_id}))
'''


def _beat(seq: int, t0: float) -> Dict[str, Any]:
    gpus = [{"index": i, "util_percent": 97.0, "memory_used_bytes": 7e10 + seq, "memory_total_bytes": 8.5e10,
             "power_w": 650.0, "temperature_c": 71, "name": "H100", "throttle_reasons": [], "xid_events": []}
            for i in range(GPUS)]
    return {"seq": seq, "time": t0 + seq, "state": "running", "attempt": 0, "box": "bench", "child": {"restarts": 0},
            "progress": {"step": seq}, "alerts": [], "slurm": None, "host": {"memory_current_bytes": 1e10 + seq},
            "gpus": {"available": True, "gpus": gpus}}


def bench_delivery(server: Any, tmp: str) -> None:
    from onbox.heartbeat.mlflow import MlflowSink, metric_entries, mlflow_doc
    from onbox.heartbeat.sinks import Sender
    from tests.hosts.mlflow import VENV

    t0 = 1.75e9
    docs = [mlflow_doc(_beat(s, t0), [[int((t0 + s) * 1000), s, {"loss": 2.0 / (1 + s), "lr": 3e-4,
                                                                 "tokens_per_s": 5e4}]], 0) for s in range(BEATS)]
    per_beat = len(metric_entries(docs[0]))
    groups = [[m for d in docs[i:i + 100] for m in metric_entries(d)] for i in range(0, BEATS, 100)]
    data = os.path.join(tmp, "groups.json")
    with open(data, "w") as f:
        json.dump(groups, f)

    def sink_round(n: int) -> float:
        from onbox.heartbeat.spool import Spool

        spool = Spool(os.path.join(tmp, "spool-%d" % n), max_entries=10 ** 6)
        for d in docs:
            spool.put(d["seq"], d)
        sink = MlflowSink(server.url, "bench-sink-%d" % n, "bench", {"command": "bench"},
                          os.path.join(tmp, "mlflow-%d.json" % n))
        sink._attach(docs[0])  # find/create the experiment and the run: once per agent, not timed
        save = sink._save

        def timed_save() -> None:  # the fsynced cursor write after every request: how much of the time it is
            c = time.perf_counter()
            save()
            cursor_s[n] = cursor_s.get(n, 0.0) + time.perf_counter() - c

        sink._save = timed_save  # type: ignore[method-assign]
        sender = Sender(sink, spool, batch_size=100)
        w0 = time.perf_counter()
        sender.start()
        if not sender.flush(600):
            raise RuntimeError("the sink did not deliver: %s" % sender.last_error)
        took = time.perf_counter() - w0
        sender.stop()
        return took

    def client_round(n: int) -> float:
        out = subprocess.run([os.path.join(VENV, "bin", "python"), "-c", CLIENT, server.url, "bench-client-%d" % n,
                              data], capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError("mlflow client failed: %s" % out.stderr[-2000:])
        return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])

    sink_s, client_s = [], []
    cursor_s: Dict[int, float] = {}
    for n in range(3):  # alternated (sink first, then client first, ...): a busy machine hurts both alike
        for which in ((0, 1) if n % 2 == 0 else (1, 0)):
            if which == 0:
                sink_s.append(sink_round(n))
            else:
                client_s.append(client_round(n))
    points = BEATS * per_beat
    print("delivery to a real MLflow server (SQLite), %d heartbeats of %d metric points each (%d points; load "
          "average %.1f on %d CPUs):" % (BEATS, per_beat, points, os.getloadavg()[0], os.cpu_count() or 0))
    print("  %-58s %10s %12s %8s" % ("", "beats/s", "points/s", "s"))
    for label, xs in (("onbox MLflow sink (spool -> Sender -> runs/log-batch)", sink_s),
                      ("mlflow client MlflowClient.log_batch, 100 beats a call", client_s)):
        best = min(xs)
        print("  %-58s %10.0f %12.0f %8.2f" % (label, BEATS / best, points / best, best))
    print("  rounds (s): sink %s (of which fsynced cursor writes %s), client %s" % (
        ", ".join("%.2f" % x for x in sink_s), ", ".join("%.2f" % cursor_s.get(n, 0.0) for n in range(len(sink_s))),
        ", ".join("%.2f" % x for x in client_s)))


def bench_agent_cpu(server: Any, tmp: str) -> None:
    from onbox.clock import SystemClock
    from onbox.config import RunConfig
    from onbox.heartbeat.collect import BoxReaders
    from onbox.heartbeat.hook import HeartbeatHook
    from tests.fakes.supervisor import loop_step
    from tests.hosts.tracker import TrackerProcess

    tr = TrackerProcess(os.path.join(tmp, "tracker"))
    tr.start()
    gpus = {"available": True, "reason": None, "gpus": _beat(0, 0)["gpus"]["gpus"]}
    results = []
    try:
        for label, mlflow in (("tracker sink alone", None), ("tracker + MLflow sinks", server.url),
                              ("tracker sink alone (again)", None)):
            from onbox.supervisor.hooks import RunContext

            run_dir = os.path.join(tmp, "cpu-%d" % len(results))
            os.makedirs(run_dir)
            cfg = RunConfig(name="cpu%d" % len(results), command=["bench"], heartbeat_interval=30.0,
                            tracker=tr.url, tracker_token_file=tr.token_file, mlflow=mlflow,
                            mlflow_experiment="bench-cpu")
            ctx = RunContext(name=cfg.name, run_dir=run_dir, ckpt_dir=run_dir, config=cfg, clock=SystemClock(),
                             emit=lambda *a, **k: None, attempt=lambda: 0)
            hook = HeartbeatHook(ctx, readers=BoxReaders(gpu=lambda: gpus, host=lambda: {"memory_current_bytes": 1e10},
                                                         disks=lambda p: []))
            state = {"run": cfg.name, "state": "running", "attempt": 0, "child_pid": os.getpid(), "restarts": 0,
                     "attempts": [], "last_exit": None}
            for i in range(20):  # warm up: connections, the MLflow run, first-time code paths
                loop_step(hook, "step %d loss %.4f lr 3e-4" % (i, 2.0 / (1 + i)))
                hook.beat(state, "interval")
            for s in hook.senders:
                s.flush(60)
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(CPU_BEATS):
                loop_step(hook, "step %d loss %.4f lr 3e-4" % (100 + i, 1.0 / (1 + i)))
                hook.beat(state, "interval")
                time.sleep(0.002)  # beats come one at a time, as in a run (each is sent on its own)
            for s in hook.senders:
                if not s.flush(120):
                    raise RuntimeError("%s did not drain: %s" % (s.sink.name, s.last_error))
            cpu = (time.process_time() - c0) / CPU_BEATS * 1000
            wall = (time.perf_counter() - w0) / CPU_BEATS * 1000
            hook.close(dict(state, state="done"))
            results.append((label, cpu, wall))
    finally:
        tr.stop()
    print("agent CPU per heartbeat, %d beats (8 GPUs, one trainer line each; all threads of the agent: beat, "
          "fsynced spools, senders, HTTP):" % CPU_BEATS)
    print("  %-44s %10s %10s" % ("", "CPU ms", "wall ms"))
    for label, cpu, wall in results:
        print("  %-44s %10.3f %10.3f" % (label, cpu, wall))


def main() -> int:
    from tests.hosts.mlflow import MlflowServer, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print("skipped: %s" % reason)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        server = MlflowServer(os.path.join(tmp, "mlflow"))
        t0 = time.perf_counter()
        server.start()
        print("mlflow server (%s) ready in %.1f s" % (_mlflow_version(), time.perf_counter() - t0))
        try:
            bench_delivery(server, tmp)
            bench_agent_cpu(server, tmp)
        finally:
            server.stop()
    return 0


def _mlflow_version() -> str:
    from tests.hosts.mlflow import VENV

    out = subprocess.run([os.path.join(VENV, "bin", "python"), "-c", "import importlib.metadata as m; "
                          "print(m.version('mlflow'))"], capture_output=True, text=True, timeout=60)
    return "mlflow " + out.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
