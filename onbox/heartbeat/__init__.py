"""Heartbeats: the schema (onbox.heartbeat/1), the on-disk spool, the sinks (tracker, file, ping URL, MLflow) and
the TelemetryHook that collects a beat from onbox.telemetry and onbox.gpu on each tick.

May import: the shared leaves, onbox.telemetry, onbox.gpu, onbox.slurm.job, onbox.multinode.role (a node's rank),
the seam onbox.supervisor.hooks and onbox.supervisor.childenv (the job's secrets, kept out of the log tail).
"""
