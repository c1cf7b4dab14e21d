"""Heartbeats: the schema (onbox.heartbeat/1), the on-disk spool, the sinks (tracker, file, ping URL, MLflow) and
the TelemetryHook that collects a beat from onbox.telemetry and onbox.gpu on each tick.

  schema.py       the heartbeat document, onbox.heartbeat/1 (heartbeat.schema.json documents it)
  schemacheck.py  heartbeat.schema.json compiled into the validator the tracker runs on every beat
  spool.py        the on-disk spool: written first, pushed in order, removed only on acknowledgement
  sinks.py        the tracker (HTTP), a JSONL file, a ping URL; mlflow.py + mlflow_rest.py: the MLflow sink
  points.py       the trainer's own metric records since the previous beat, as the beat's `points` section
  metricshint.py  whether the trainer's output is recognised as metrics, said once either way
  collect.py      the box readings a beat carries (host, disks, GPUs), each a seam
  times.py        the beat's `times`: when its agent started, its attempt's setup began, its child was spawned
  hook.py         HeartbeatHook: the TelemetryHook the supervisor calls

May import: the shared leaves, onbox.telemetry, onbox.gpu, onbox.slurm.job, onbox.multinode.role (a node's rank),
the seam onbox.supervisor.hooks and onbox.supervisor.childenv (the job's secrets, kept out of the log tail).
"""
