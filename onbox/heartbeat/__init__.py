"""Heartbeats: the schema (onbox.heartbeat/1), the on-disk spool, the sinks (tracker, file, ping URL) and the
TelemetryHook that collects a beat from onbox.telemetry and onbox.gpu on each tick.

May import: the shared leaves, onbox.telemetry, onbox.gpu, onbox.slurm.job and the seam onbox.supervisor.hooks.
"""
