"""The box's run queue (`onbox queue add/ls/rm/run`): ablations run one after another, or N at a time, or one per
GPU, each as its own `onbox run` (own run name, run dir, durable prefix, heartbeats).

  journal.py  the queue on disk: an append-only JSONL journal under a file lock; the last record of an entry wins
  runner.py   the queue runner: one loop that starts each entry's agent, forwards a preemption, records outcomes
  render.py   the text of `onbox queue ls` (and `onboxctl queue BOX`), from the queue's --json document
  slots.py    where entries run: N slots, or one per GPU (NVML inventory) with CUDA_VISIBLE_DEVICES set

Imports: the leaves, onbox.config, onbox.supervisor (signals, notices, detach, the run dir), onbox.gpu.
"""
