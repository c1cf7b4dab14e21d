#!/bin/bash
# Written by `onbox sbatch` (onbox 1.2.3). Submit with: sbatch THIS_FILE
#
# Self-requeueing: SIGUSR2 arrives 300 s before the time limit (or from `scancel --signal=USR2 --batch JOB`);
# the agent sends the checkpoint signal to the trainer, commits the newest checkpoint and runs
# `scontrol requeue`. The job comes back with SLURM_RESTART_COUNT set and the run resumes from that
# checkpoint. A job that finishes, or fails for its own reasons, is not requeued.
#SBATCH --job-name=onbox
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR2@300
#SBATCH --output=onbox-%A_%a.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --array=0-3%2
set -u
export ONBOX_PREEMPT_SIGNAL=USR2  # the signal asked for above
export ONBOX_GRACE="${ONBOX_GRACE:-300}"  # seconds from that signal to the end of the job
export ONBOX_REQUEUE="${ONBOX_REQUEUE:-1}"
# Named after the job: every requeue continues the same run; each array task is its own run.
if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
  ONBOX_SLURM_RUN="slurm-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
else
  ONBOX_SLURM_RUN="slurm-${SLURM_JOB_ID}"
fi
echo "onbox: job $SLURM_JOB_ID run $ONBOX_SLURM_RUN restart ${SLURM_RESTART_COUNT:-0} on $(hostname)"
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="${MASTER_PORT:-29500}"
# One agent per node; srun forwards the signal to each. Node 0 commits checkpoints and requeues;
# the others run as <run>.node<N> without --durable, requeue off, and report heartbeats.
exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c 'run="$1"; if [ "${SLURM_NODEID:-0}" != 0 ]; then export ONBOX_REQUEUE=0; unset ONBOX_DURABLE; exec /usr/bin/python3 -m onbox run --foreground --name "$run.node$SLURM_NODEID" --restart never -- torchrun --nnodes=2 train.py; fi; exec /usr/bin/python3 -m onbox run --foreground --name "$run" --durable /shared/ckpt --restart never -- torchrun --nnodes=2 train.py' onbox-node "$ONBOX_SLURM_RUN"
