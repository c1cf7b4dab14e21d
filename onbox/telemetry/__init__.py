"""Readings that are not about GPUs: the host (cgroup v1/v2 memory, CPU quota, disks, inodes), the trainer's
progress (metrics parsed from its output or ONBOX_METRICS_FILE), the tail of its output (logtail: bounded, secrets
redacted) and the alert rules over them.

GPU readings live in onbox.gpu, beside the NVML seam they share with the reaper. May import: onbox.errors only;
the supervisor, heartbeats and `onbox audit` read from here.
"""
