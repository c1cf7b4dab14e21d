"""Everything that talks about GPUs: the NVML seam, readings for heartbeats and `onbox gpu`, Xid events, the scan
for processes holding GPU memory, who owns them, and the reaper that frees memory pinned by a dead run's workers.

  nvml.py       the one seam over pynvml: lazy init, not-available sentinels, a hint on a fatal init error
  readings.py   utilisation, clocks, power, memory, throttling per GPU (GpuMonitor, inventory)
  xid.py        Xid critical errors from NVML events and the kernel log
  holders.py    HolderScan: processes with /dev/nvidia* open, cross-checked with NVML's process list
  ownership.py  which run and attempt a holder belongs to
  reaper.py     decide and kill (TERM, then KILL) what earlier attempts left; the ReapHook

May import: the shared leaves (errors, clock, fsutil, proc, toolrun, paths). Never the supervisor, heartbeats or checkpoints: the
reaper plugs into the supervisor through onbox.supervisor.hooks, wired by onbox.subsystems.
"""
