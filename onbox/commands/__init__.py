"""Thin click commands of `onbox`, one module per concept; each is imported only when used (fast `--version`).

clikit.py is what both CLIs (onbox and onboxctl) share: the lazy command group, the one mapping of domain errors
to a message, a hint and an exit code, and the JSON printer. This package is the only place in onbox that imports
click; nothing outside it (and onbox/cli.py) imports it.

  run.py          `onbox run`, `onbox adopt` and the run options `queue add` shares (the launch: onbox.launch)
  runs.py         `onbox status`, `ls`, `logs`, `stop`
  checkpoints.py  `onbox sync`, `onbox checkpoints`, `onbox verify`
  queue.py        `onbox queue add|ls|rm|run`
  sbatch.py       `onbox sbatch`: a self-requeueing sbatch script
  audit.py        `onbox audit`; profiles.py: `onbox profiles list|show|detect`
  gpu.py          `onbox gpu` and `onbox reap`
  match.py        `onbox match`: the runs a launch of a command would continue (what onboxctl run asks first)
  node.py         `onbox node probe` (what onboxctl asks before a multi-node group)
  init.py         `onbox init KIND DIR`: a training script that survives preemption
  clikit.py       what both CLIs share (lazy group, error mapping, strict JSON)
"""
