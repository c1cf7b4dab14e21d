"""Heartbeats: the schema (onbox.heartbeat/1), the on-disk spool, the sinks and the run hook."""
