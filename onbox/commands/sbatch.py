"""`onbox sbatch [sbatch options] [run options] -- CMD`: write or submit a self-requeueing sbatch script."""
from __future__ import annotations

import shlex
from typing import Any, List, Optional, Tuple

import click

from onbox.clikit import LaidOut, PathValue, echo_json
from onbox.errors import UsageError


class _CommandAfterDashes(LaidOut):
    """Splits argv at the first `--` before click sees it: CMD is everything after it, verbatim; options before
    it that are not ours are `onbox run` options and pass through in order."""

    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        if "--" in args:
            i = args.index("--")
            ctx.meta["onbox.sbatch.command"] = list(args[i + 1:])
            args = args[:i]
        else:
            ctx.meta["onbox.sbatch.command"] = []
        return super().parse_args(ctx, args)


EXAMPLES = [
    "onbox sbatch --time 4:00:00 --durable /shared/ckpt --restart never -- python3 train.py",
    "onbox sbatch -t 4:00:00 -p gpu --sbatch-arg=--gres=gpu:1 --durable /shared/ckpt -- python3 train.py",
    "onbox sbatch --print --time 4:00:00 --durable /shared/ckpt -- python3 train.py   # the script, not submitted",
]
SECTIONS = [("More sbatch options", ["--array", "--job-name", "--output", "--sbatch-arg"]),
            ("The time-limit warning", ["--signal", "--signal-lead"]), ("Advanced", ["--agent"])]


@click.command(cls=_CommandAfterDashes, options_metavar="[SBATCH OPTIONS] [RUN OPTIONS]", examples=EXAMPLES,
               sections=SECTIONS,
               context_settings={"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]})
@click.option("--time", "-t", "time_", metavar="LIMIT", help="sbatch --time (e.g. 4:00:00).")
@click.option("--partition", "-p", help="sbatch --partition.")
@click.option("--nodes", "-N", type=int, default=1, show_default=True,
              help="Nodes; > 1 runs one agent per node under srun (torchrun rendezvous via MASTER_ADDR).")
@click.option("--array", help="sbatch --array (a sweep): each task is its own run, named <run>-<task>.")
@click.option("--job-name", "-J", help="sbatch --job-name (default: the run name, else 'onbox').")
@click.option("--output", "-o", type=PathValue(), help="sbatch --output (default onbox-%j.out, onbox-%A_%a.out for arrays).")
@click.option("--sbatch-arg", "sbatch_args", multiple=True, metavar="OPT",
              help="Any other sbatch option, as --sbatch-arg=--mem=64G (repeatable).")
@click.option("--signal", "signal_", metavar="SIG", help="The warning signal (default from the slurm profile, "
              "else USR1). Use USR2 when the trainer uses NCCL: it catches USR1.")
@click.option("--signal-lead", type=int, metavar="SECONDS",
              help="How long before the time limit the signal comes (default from the slurm profile, else 120).")
@click.option("--name", help="Run name base (default slurm-<job id>; array tasks add -<task>). Passed to run.")
@click.option("--agent", metavar="WORDS", help="How the node starts the agent, e.g. 'python3 /shared/onbox.pyz' "
              "(default: this pyz with python3, else this python -m onbox).")
@click.option("--print", "print_", is_flag=True, help="Write the script to stdout instead of submitting it.")
@click.option("--json", "as_json", is_flag=True, help="Print {job_id, script} (or {script}) as JSON.")
@click.argument("run_args", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def sbatch(ctx: click.Context, time_: Optional[str], partition: Optional[str], nodes: int, array: Optional[str],
           job_name: Optional[str], output: Optional[str], sbatch_args: Tuple[str, ...], signal_: Optional[str],
           signal_lead: Optional[int], name: Optional[str], agent: Optional[str], print_: bool, as_json: bool,
           run_args: Tuple[str, ...]) -> None:
    """Write (--print) or submit a self-requeueing sbatch script that runs CMD under the agent.

    The script asks for --requeue --open-mode=append --signal=B:SIG@LEAD and execs `onbox run --foreground`,
    so on the signal the agent checkpoints, commits and requeues the job; the requeued job continues the same run
    and resumes from the committed checkpoint. Options that are not sbatch's go to `onbox run` unchanged.
    """
    from onbox import __version__
    from onbox.slurm.script import SbatchScript, default_agent, profile_defaults, submit

    command = ctx.meta.get("onbox.sbatch.command") or []
    stray = [a for a in run_args if not a.startswith("-")]
    if not command and stray:
        raise UsageError("put the command after --: `onbox sbatch [options] -- %s`" % " ".join(run_args))
    prof = profile_defaults()
    agent_words: List[str] = default_agent()
    if agent is not None:
        try:
            agent_words = shlex.split(agent)
        except ValueError as e:
            raise UsageError("--agent %r: %s" % (agent, e))
    spec = SbatchScript(command=list(command), agent=agent_words, run_args=list(run_args), name=name,
                        job_name=job_name, signal=signal_ or prof.get("signal") or "USR1",
                        lead=signal_lead if signal_lead is not None else int(prof.get("lead", 120)),
                        time=time_, partition=partition, nodes=nodes, array=array, output=output,
                        sbatch_args=list(sbatch_args), version=__version__).validate()
    from onbox.commands.run import check_run_options

    check_run_options(list(run_args))  # a bad --grace fails here, not on the node after the queue wait
    text = spec.render()
    result: Any
    if print_:
        if as_json:
            echo_json({"script": text})
        else:
            click.echo(text, nl=False)
        return
    job_id = submit(text)
    if as_json:
        result = {"job_id": job_id, "script": text, "run": (name or "slurm-%s" % job_id) if not array else None}
        echo_json(result)
    else:
        click.echo(job_id)
