"""Bringing results home and the gate before a box goes: a run's committed checkpoints pulled and verified, and the
teardown that refuses until the newest one is home.

  pull.py      per-checkpoint rsync --partial, retried, then verified here; pulls.json records what came home
  teardown.py  the teardown gate: every run's newest durable checkpoint pulled and verified, else a refusal

May import controller.boxes and onbox's library.
"""
