"""Slurm: the job the agent runs in, and the sbatch script that starts it.

  job.py     SlurmJob from the environment, KillWait, `scontrol requeue`, run naming, node-0-only commits
  script.py  a self-requeueing sbatch script for `onbox sbatch` (golden-file tested)

May import: the shared leaves and onbox.platform.profiles (a profile's Slurm defaults). The supervisor imports
job.py; nothing here imports the supervisor.
"""
