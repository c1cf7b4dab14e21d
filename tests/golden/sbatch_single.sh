#!/bin/bash
# Written by `onbox sbatch` (onbox 1.2.3). Submit with: sbatch THIS_FILE
#
# Self-requeueing: SIGUSR1 arrives 120 s before the time limit (or from `scancel --signal=USR1 --batch JOB`);
# the agent sends the checkpoint signal to the trainer, commits the newest checkpoint and runs
# `scontrol requeue`. The job comes back with SLURM_RESTART_COUNT set and the run resumes from that
# checkpoint. A job that finishes, or fails for its own reasons, is not requeued.
#SBATCH --job-name=exp1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --output=onbox-%j.out
#SBATCH --time=4:00:00
#SBATCH --partition=gpu
#SBATCH --gres=gpu:1
#SBATCH --mem=64G
set -u
export ONBOX_PREEMPT_SIGNAL=USR1  # the signal asked for above
export ONBOX_GRACE="${ONBOX_GRACE:-120}"  # seconds from that signal to the end of the job
export ONBOX_REQUEUE="${ONBOX_REQUEUE:-1}"
# Named after the job: every requeue continues the same run; each array task is its own run.
if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
  ONBOX_SLURM_RUN=exp1-"$SLURM_ARRAY_TASK_ID"
else
  ONBOX_SLURM_RUN=exp1
fi
echo "onbox: job $SLURM_JOB_ID run $ONBOX_SLURM_RUN restart ${SLURM_RESTART_COUNT:-0} on $(hostname)"
# exec: the agent becomes the batch shell's process and receives the signal itself (bash runs a
# trap only after its foreground command ends).
exec python3 /shared/onbox.pyz run --foreground --name "$ONBOX_SLURM_RUN" --durable /shared/ckpt --restart never --env 'A=$HOME' -- python train.py --lr 3e-4 'two words'
