"""Readings that are not about GPUs: the host (cgroup v1/v2 memory, CPU quota, disks, inodes), the trainer's
progress (metrics parsed from its output or ONBOX_METRICS_FILE), the tail of its output (logtail: bounded, secrets
redacted) and the alert rules over them.

  host.py         cgroup (v1, v2, hybrid) memory and CPU quota, disks and inodes, load average
  metrics.py      step, loss, eval loss, lr, tokens/s from the job's output or ONBOX_METRICS_FILE
  progress.py     the ProgressFeed: the trainer's progress parsed once, its newest values (progress.json), the
                  incremental metrics file reader
  logtail.py      the last lines of the job's output, bounded, secrets redacted
  alerts.py       the alert rules: NaN/spikes, stall, disks, GPUs, OOM kills, sync failures, crash loops, and the
                  warnings the agent's records hold (state.json, checkpoint_status.json) as alerts
  resumecheck.py  a resume that went backwards: the trainer's first step after a restore far below the checkpoint's
  cadence.py      the hang rule: the trainer's step cadence per phase (startup, train, eval) and when it is hung

GPU readings live in onbox.gpu, beside the NVML seam they share with the reaper. May import: onbox.errors and
onbox.vocab (the alert kinds) only; the supervisor, heartbeats and `onbox audit` read from here, and onboxctl reads
the alerts of a box's records (alerts.recorded_alerts) from here too.
"""
