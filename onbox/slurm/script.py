"""The self-requeueing sbatch script `onbox sbatch` writes or submits.

What it asks Slurm for, and why (Slurm's sbatch and slurm.conf docs):
  --requeue                 so `scontrol requeue` may put the job back in the queue
  --open-mode=append        without it the requeued job truncates its own log
  --signal=B:<SIG>@<lead>   the warning <lead> s (up to 60 s more) before the time limit, to the batch shell only
and it `exec`s the agent in `--foreground`: the agent IS the batch shell's process and receives the signal itself
(bash would run a trap only after its foreground command ended). The run is named after the job so every requeue
continues the same run (run dir, durable path, next attempt); each array task is its own run.
Multi-node (--nodes N > 1): one agent per node under `srun --ntasks-per-node=1` (srun forwards the signal to each);
MASTER_ADDR/MASTER_PORT are exported for torchrun's rendezvous; node 0 commits and requeues, the others run as
`<run>.node<N>` without --durable and with requeue off.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import sys
from typing import Any, Dict, List, Optional

from onbox.config import parse_catchable_signal
from onbox.errors import UnfitError, UsageError
from onbox.toolrun import Runner, Says, Tool, stderr_tail

DEFAULT_LEAD = 120  # seconds before the time limit; a final commit of a multi-GB checkpoint needs that much
DEFAULT_SIGNAL = "USR1"  # the agent's default preempt_signal; USR2 where the trainer uses NCCL (it catches USR1)
MAX_LEAD = 65535  # Slurm's limit for --signal's time
SUBMIT_TIMEOUT = 60.0
# sbatch --time, as its man page lists the formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; and UNLIMITED/INFINITE (Slurm's parser also takes -1).
TIME_RE = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$|^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$", re.ASCII)
TIME_FORMATS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"


def time_limit_seconds(text: str) -> Optional[int]:
    """Seconds of an sbatch --time value; None for no limit (UNLIMITED, INFINITE, -1, 0). UsageError otherwise:
    sbatch would reject it only after the script was written, or worse, on submission from a requeue."""
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    m = TIME_RE.match(value)
    if not m:
        raise UsageError("--time %r is not a Slurm time limit" % text, hint="use %s (sbatch's formats)" % TIME_FORMATS)
    if m.group(1) is not None:
        a, b, c = (int(g or 0) for g in m.group(1, 2, 3))
        # hours:minutes:seconds, else minutes[:seconds]
        seconds = a * 3600 + b * 60 + c if m.group(3) is not None else a * 60 + b
    else:
        d, h, mi, s = (int(g) if g is not None else 0 for g in m.group(4, 5, 6, 7))
        seconds = d * 86400 + h * 3600 + mi * 60 + s
    return seconds or None  # "A time limit of zero requests that no time limit be imposed"


@dataclasses.dataclass
class SbatchScript:
    """Everything the generated script depends on; render() is a pure function of it (golden-file tested)."""

    command: List[str]
    agent: List[str]  # how to start the agent on the node: ["python3", "/shared/onbox.pyz"] or [py, "-m", "onbox"]
    run_args: List[str] = dataclasses.field(default_factory=list)  # `onbox run` options, passed through verbatim
    name: Optional[str] = None  # the user's --name: the run's base name (array tasks add -<task>)
    job_name: Optional[str] = None
    signal: str = DEFAULT_SIGNAL
    lead: int = DEFAULT_LEAD
    time: Optional[str] = None
    partition: Optional[str] = None
    nodes: int = 1
    array: Optional[str] = None
    output: Optional[str] = None
    sbatch_args: List[str] = dataclasses.field(default_factory=list)  # any other sbatch option, one per line
    version: str = ""

    def validate(self) -> "SbatchScript":
        if not self.command:
            raise UsageError("no command to run", hint="put the training command after --, e.g. "
                             "`onbox sbatch --time 4:00:00 -- python train.py`")
        if not self.agent:
            raise UsageError("--agent is empty", hint="e.g. --agent 'python3 /shared/onbox.pyz'")
        sig = parse_catchable_signal(self.signal, "--signal", also_refused=(signal.SIGCHLD,))
        self.signal = sig.name[3:]
        if not 0 < self.lead <= MAX_LEAD:
            raise UsageError("--signal-lead must be 1..%d seconds, not %r" % (MAX_LEAD, self.lead))
        if self.time is not None:
            limit = time_limit_seconds(self.time)
            if limit is not None and limit <= self.lead:
                raise UsageError("--time %s (%d s) is not longer than --signal-lead (%d s): the warning would come "
                                 "at once, and every requeue would be preempted again" % (self.time, limit, self.lead),
                                 hint="give a longer --time or a shorter --signal-lead (Slurm may signal up to 60 s "
                                      "early)")
        if self.nodes < 1:
            raise UsageError("--nodes must be >= 1, not %r" % self.nodes)
        for arg in self.sbatch_args:
            if not arg.startswith("-") or "\n" in arg:
                raise UsageError("--sbatch-arg %r is not an sbatch option" % arg,
                                 hint="give it as --sbatch-arg=--mem=64G (one option each)")
        for arg in self.run_args:
            if arg == "--preempt-signal" or arg.startswith("--preempt-signal="):
                raise UsageError("--preempt-signal is set by onbox sbatch from --signal (the agent must listen "
                                 "for the signal Slurm sends)", hint="use --signal USR2")
            if arg in ("--foreground", "--detach"):
                raise UsageError("%s is not a run option for onbox sbatch: the script always runs the agent in "
                                 "--foreground" % arg)
        return self

    # -- rendering ------------------------------------------------------------------------------------------------
    def sbatch_lines(self) -> List[str]:
        default_out = "onbox-%A_%a.out" if self.array else "onbox-%j.out"
        lines = ["--job-name=%s" % (self.job_name or self.name or "onbox"),
                 "--requeue",
                 "--open-mode=append",
                 "--signal=B:%s@%d" % (self.signal, self.lead),
                 "--output=%s" % (self.output or default_out)]
        if self.time:
            lines.append("--time=%s" % self.time)
        if self.partition:
            lines.append("--partition=%s" % self.partition)
        if self.nodes > 1:
            lines += ["--nodes=%d" % self.nodes, "--ntasks-per-node=1"]
        if self.array:
            lines.append("--array=%s" % self.array)
        lines += list(self.sbatch_args)
        return lines

    def agent_line(self, name_expr: str, primary: bool = True) -> str:
        words = [*self.agent, "run", "--foreground"]
        args = self.run_args if primary else without_option(self.run_args, "--durable")
        return " ".join([*map(shlex.quote, words), "--name", name_expr,
                         *map(shlex.quote, [*args, "--", *self.command])])

    def render(self) -> str:
        q = shlex.quote
        out = ["#!/bin/bash",
               "# Written by `onbox sbatch`%s. Submit with: sbatch THIS_FILE" % (
                   " (onbox %s)" % self.version if self.version else ""),
               "#",
               "# Self-requeueing: SIG%s arrives %d s before the time limit (or from `scancel --signal=%s --batch JOB`);"
               % (self.signal, self.lead, self.signal),
               "# the agent sends the checkpoint signal to the trainer, commits the newest checkpoint and runs",
               "# `scontrol requeue`. The job comes back with SLURM_RESTART_COUNT set and the run resumes from that",
               "# checkpoint. A job that finishes, or fails for its own reasons, is not requeued.",
               *("#SBATCH %s" % line for line in self.sbatch_lines()),
               "set -u",
               "export ONBOX_PREEMPT_SIGNAL=%s  # the signal asked for above" % self.signal,
               'export ONBOX_GRACE="${ONBOX_GRACE:-%d}"  # seconds from that signal to the end of the job' % self.lead,
               'export ONBOX_REQUEUE="${ONBOX_REQUEUE:-1}"',
               "# Named after the job: every requeue continues the same run; each array task is its own run.",
               'if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then']
        if self.name:
            out += ["  ONBOX_SLURM_RUN=%s-\"$SLURM_ARRAY_TASK_ID\"" % q(self.name), "else",
                    "  ONBOX_SLURM_RUN=%s" % q(self.name), "fi"]
        else:
            out += ['  ONBOX_SLURM_RUN="slurm-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"', "else",
                    '  ONBOX_SLURM_RUN="slurm-${SLURM_JOB_ID}"', "fi"]
        out.append('echo "onbox: job $SLURM_JOB_ID run $ONBOX_SLURM_RUN restart ${SLURM_RESTART_COUNT:-0}'
                   ' on $(hostname)"')
        if self.nodes == 1:
            out += ["# exec: the agent becomes the batch shell's process and receives the signal itself (bash runs a",
                    "# trap only after its foreground command ends).",
                    "exec " + self.agent_line('"$ONBOX_SLURM_RUN"')]
        else:
            inner = ('run="$1"; if [ "${SLURM_NODEID:-0}" != 0 ]; then export ONBOX_REQUEUE=0; unset ONBOX_DURABLE; '
                     'exec ' + self.agent_line('"$run.node$SLURM_NODEID"', primary=False) + '; fi; '
                     'exec ' + self.agent_line('"$run"'))
            out += ['export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
                    'export MASTER_PORT="${MASTER_PORT:-29500}"',
                    "# One agent per node; srun forwards the signal to each. Node 0 commits checkpoints and requeues;",
                    "# the others run as <run>.node<N> without --durable, requeue off, and report heartbeats.",
                    "exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c %s onbox-node \"$ONBOX_SLURM_RUN\""
                    % q(inner)]
        return "\n".join(out) + "\n"


def without_option(args: List[str], option: str) -> List[str]:
    """args without `option VALUE` / `option=VALUE` (a non-primary node must not commit checkpoints)."""
    out: List[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def default_agent(argv0: Optional[str] = None) -> List[str]:
    """How the node starts this agent: the pyz this process runs from (with the node's python3), else
    `<this python> -m onbox`."""
    path = os.path.abspath(argv0 if argv0 is not None else sys.argv[0])
    if path.endswith(".pyz") and os.path.isfile(path):
        return ["python3", path]
    return [sys.executable, "-m", "onbox"]


def profile_defaults(profile_file: Optional[str] = None) -> Dict[str, Any]:
    """{"lead", "signal"} from the slurm profile: [preemption] signal_lead, and [run] preempt_signal (else
    [preemption] signal). A user's $ONBOX_HOME/profiles/slurm.toml overrides the built-in one."""
    from onbox.platform import profiles

    prof = profiles.load("slurm", profile_file)
    pre, run = prof.table("preemption"), prof.table("run")
    out: Dict[str, Any] = {}
    if pre.get("signal_lead") is not None:
        out["lead"] = int(pre["signal_lead"])
    sig = run.get("preempt_signal") or pre.get("signal")
    if sig:
        out["signal"] = str(sig)
    return out


def submit(script: str, workdir: Optional[str] = None, timeout: float = SUBMIT_TIMEOUT,
           runner: Optional[Runner] = None) -> str:
    """`sbatch --parsable` the script on stdin; return the job id. Errors carry sbatch's stderr."""
    from onbox.slurm.job import SlurmError

    sbatch = Tool("sbatch", SlurmError,
                  # the box cannot submit at all: unfit (3), not a failed job
                  missing=Says("sbatch not found on PATH", "run this on a Slurm login node, or use --print",
                               error=UnfitError),
                  timed_out=Says("sbatch did not answer within {timeout:.0f} s", "is slurmctld up? `scontrol ping`"),
                  failed=Says("sbatch refused the job (exit {rc}): {stderr}",
                              "check the sbatch options; `onbox sbatch --print ...` shows the script"),
                  tail=stderr_tail())
    cp = sbatch.run(["sbatch", "--parsable"], timeout, input=script, cwd=workdir, runner=runner)
    return cp.stdout.strip().split(";")[0]
