"""`onbox`: the on-box agent's command line. Commands stay thin; each lives in onbox/commands/ and is imported
only when it runs, so `onbox --version` starts fast (issue 2 benchmark)."""
from __future__ import annotations

from typing import List, Optional

import click

from onbox import __version__
from onbox.clikit import LazyGroup, run_cli

C = "onbox.commands."
COMMANDS = {
    # name: (module, attribute, one-line help)
    "audit": (C + "audit", "audit", "Pre-flight check of this box: disks, inodes, cgroup, CPU quota, GPUs, torch."),
    "profiles": (C + "profiles", "profiles", "List, show and detect platform profiles."),
    "run": (C + "run", "run", "Start a supervised run (detached by default) of CMD."),
    "adopt": (C + "run", "adopt", "Re-adopt a run whose child outlived its agent."),
    "match": (C + "match", "match", "The runs here a launch of CMD would continue (what onboxctl run asks)."),
    "status": (C + "runs", "status", "State of one run or of all runs."),
    "ls": (C + "runs", "ls", "List runs on this box."),
    "logs": (C + "runs", "logs", "Show (or follow) a run's output log."),
    "stop": (C + "runs", "stop", "Stop a run gracefully: checkpoint, commit, exit (no restart)."),
    "sync": (C + "checkpoints", "sync", "Commit a run's newest complete checkpoint to durable storage."),
    "checkpoints": (C + "checkpoints", "checkpoints", "List a run's checkpoints, local and durable."),
    "verify": (C + "checkpoints", "verify", "Verify a checkpoint (manifest hashes, format checks, --load)."),
    "gpu": (C + "gpu", "gpu", "GPU health: utilisation, clocks, power, memory, throttling, Xid."),
    "reap": (C + "gpu", "reap", "Find processes pinning GPU memory; kill them with --force."),
    "sbatch": (C + "sbatch", "sbatch", "Write or submit a self-requeueing sbatch script for CMD."),
    "queue": (C + "queue", "queue", "The box's run queue: add, ls, rm, run (in turn, N at a time or one per GPU)."),
    "init": (C + "init", "init", "Write a training template (plain, nanogpt, hf, litgpt) that onbox can keep alive."),
    "node": (C + "node", "node", "A box as a node of a multi-node group (what onboxctl probes before a launch)."),
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="onbox")
def cli() -> None:
    """onbox keeps a long training job alive on a box you rent but don't own.

    It detaches the job from your SSH session, turns preemption signals into checkpoint-then-exit, commits
    checkpoints atomically to durable storage, reaps processes that pin GPU memory and reports heartbeats.

    Exit codes: 0 done, 1 job failed, 2 bad usage, 3 environment unfit, 75 preempted (restart expected).
    """


def main(argv: Optional[List[str]] = None) -> None:
    run_cli(cli, "onbox", argv)
