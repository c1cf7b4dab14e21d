"""Readings of the box: host (cgroups, disks), GPUs (NVML), metrics, alerts."""
