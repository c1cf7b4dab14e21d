"""What the box and the platform it is rented on are like, before any run starts.

  profiles.py     one TOML profile per platform (RunPod, vast.ai, AutoDL, Slurm, ...): schema, detection, defaults
  audit.py        `onbox audit`: is this box fit for a run (disks, inodes, cgroup, CPU quota, GPUs, torch)
  extractroot.py  where onbox.pyz unpacks itself, chosen before shiv runs (embedded in the pyz's __main__)

May import: the shared leaves, onbox.telemetry (host readings) and onbox.gpu (the GPU inventory, for audit).
extractroot.py imports nothing of onbox: it runs before onbox's libraries are unpacked.
"""
