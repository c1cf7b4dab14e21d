"""`onboxctl run BOX [BOX...] [--name] [run options] -- CMD`: start supervised runs, return at once. The launch is
controller/launch/plan.py's prepare() (every refusal, before any box is asked) and runs.py's start()."""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import click

from controller.commands.params import Duration, HangAfter, Seconds
from controller.launch.plan import RunPlan, prepare
from controller.launch.runs import start
from onbox.clikit import LaidOut, echo_json
from onbox.errors import UsageError


class DashDashCommand(LaidOut):
    """Everything after the first `--` is the command to run, kept verbatim in ctx.meta["cmd"]."""

    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        if "--" in args:
            i = args.index("--")
            ctx.meta["cmd"] = args[i + 1:]
            args = args[:i]
        else:
            ctx.meta["cmd"] = []
        return super().parse_args(ctx, args)


def _provision_timeout(ctx: click.Context, param: click.Parameter, value: Optional[float]) -> Optional[float]:
    """--provision-timeout in its range (1s to 24h): at 0 every try of the keeper would fail (issue 30.13)."""
    if value is None:
        return None
    from controller.keeper.policy import check_provision_timeout

    try:
        return check_provision_timeout(value, what="")
    except UsageError as e:
        raise click.BadParameter(e.message, ctx=ctx, param=param)


# `onboxctl run --help`: the common options first (those not named here), then these under their headings
RUN_SECTIONS = [
    ("Recovery (onboxctl keep)", ["--recover", "--provision", "--provision-timeout", "--lost-after",
                                  "--max-recoveries", "--max-at-risk", "--backoff", "--recover-tries", "--code",
                                  "--include-secret", "--take-over"]),
    ("Restarts, hangs and preemption", ["--restart", "--max-restarts", "--grace", "--checkpoint-signal",
                                        "--hang-after", "--on-hang"]),
    ("Heartbeats and tracking", ["--tracker", "--tunnel", "--tracker-token-file", "--heartbeat-interval", "--mlflow",
                                 "--mlflow-experiment", "--mlflow-token-file"]),
    ("Many boxes and multi-node", ["--nodes", "--master-addr", "--fanout", "--parallel"]),
    ("Advanced", ["--sync-interval", "--set", "--onbox-arg", "--timeout"]),
]
RUN_EXAMPLES = [
    "onboxctl run gpu1 --durable /workspace/durable -- python3 train.py --lr 3e-4",
    "onboxctl run gpu1 gpu2 --nodes --name big --durable remote:ckpt -- torchrun --nproc-per-node=8 train.py",
    "onboxctl run gpu1 --durable remote:ckpt --recover pool:spares -- python3 train.py",
]


@click.command("run", cls=DashDashCommand, usage="[OPTIONS] BOX [BOX...] -- CMD [ARGS]...", examples=RUN_EXAMPLES,
               sections=RUN_SECTIONS)
@click.argument("boxes", nargs=-1)
@click.option("--name", default=None,
              help="Run name (default: the run of this same command the box or the durable target knows, "
                   "continued; else a new <program>-<UTC time>).")
@click.option("--new", "new", is_flag=True,
              help="Always a new run, even when an earlier run of the same command could be resumed (not with "
                   "--name).")
@click.option("--take-over", "take_over", is_flag=True,
              help="On a replacement box while the lost box's lease is still live: supersede it (the old agent, "
                   "if it still runs, is fenced). Only when that box is gone for good.")
@click.option("--fanout", type=click.Path(dir_okay=False), default=None,
              help="File with one `BOX` or `BOX -- CMD ...` a line.")
@click.option("--parallel", type=click.IntRange(1, 64), default=8, show_default=True, help="Boxes launched at once.")
@click.option("--workdir", default=None, help="Directory on the box to run in (default: the last pushed code dir).")
@click.option("--profile", default=None, help="Platform profile for the run.")
@click.option("--durable", default=None, help="Durable storage (mounted path or rclone remote:path).")
@click.option("--ckpt-dir", default=None, help="Where the trainer writes checkpoints on the box.")
@click.option("--restart", type=click.Choice(["on-failure", "always", "never"]), default=None)
@click.option("--max-restarts", type=click.IntRange(0, 1000000), default=None)
@click.option("--grace", type=Seconds(0, 86400), default=None, help="Seconds from a preemption notice to the hard kill.")
@click.option("--checkpoint-signal", default=None, help="Signal forwarded to the trainer on preemption.")
@click.option("--hang-after", type=HangAfter(), metavar="DUR", help="No step, output or checkpoint write this long "
              "(90s, 5m; off: never) and the trainer is hung; default: learned from its cadence (`onbox run --help`).")
@click.option("--on-hang", type=click.Choice(["alert", "restart", "stop"]), help="What a hang does, its stacks saved.")
@click.option("--resume-arg", multiple=True, help="Appended to CMD when a checkpoint exists ({ckpt} = its path).")
@click.option("--env", "env", multiple=True, metavar="KEY=VAL", help="Environment for the job (repeatable).")
@click.option("--secret", "secret", multiple=True, metavar="NAME|VAR=NAME",
              help="The job gets VAR (default NAME) from the box's .onbox/secrets/NAME (`onboxctl secrets push`), "
                   "never in an argv (repeatable).")
@click.option("--env-file", "env_file", multiple=True, metavar="PATH",
              help="KEY=VAL file on the box for the job's environment, read at each attempt (repeatable).")
@click.option("--mlflow", default=None, help="MLflow tracking server URL the agent sends the run to (the box must "
                                             "reach it).")
@click.option("--mlflow-experiment", default=None, help="MLflow experiment name (created when missing).")
@click.option("--mlflow-token-file", default=None, help="Bearer token file on the box for MLflow.")
@click.option("--tracker", default=None,
              help="Tracker URL. One on this machine (127.0.0.1, localhost, ::1) is reached through an ssh tunnel.")
@click.option("--tunnel/--no-tunnel", "tunnel", default=None,
              help="Reverse ssh tunnel from the box's 127.0.0.1 to the tracker (default: when the tracker is on this "
                   "machine). With --no-tunnel the box must reach --tracker itself.")
@click.option("--tracker-token-file", default=None,
              help="Token file on the box, e.g. .onbox/secrets/tracker (see `onboxctl secrets push`).")
@click.option("--heartbeat-interval", type=Seconds(0, 86400, open_lo=True), default=None,
              help="Seconds between heartbeats.")
@click.option("--sync-interval", type=Seconds(0, 86400, open_lo=True), default=None,
              help="Seconds between checkpoint commits.")
@click.option("--set", "settings", multiple=True, metavar="FIELD=VALUE",
              help="Any run setting (onbox/config.py field), sent as ONBOX_<FIELD> (repeatable).")
@click.option("--onbox-arg", "onbox_args", multiple=True, help="Any other `onbox run` option, passed verbatim.")
@click.option("--nodes", "as_nodes", is_flag=True,
              help="The boxes are the nodes of ONE multi-node job (node 0 first): each agent gets NNODES, NODE_RANK, "
                   "MASTER_ADDR/PORT and torchrun's rendezvous; a preemption of any node stops all. Needs --durable.")
@click.option("--master-addr", default=None, help="With --nodes: node 0's address as the others reach it "
                                                   "(default: picked from the boxes' own addresses).")
@click.option("--timeout", type=Seconds(0, 3600, open_lo=True), default=60.0, show_default=True,
              help="Seconds each launch may take.")
@click.option("--recover", default=None, metavar="pool:NAME",
              help="`onboxctl keep` brings the run back: on its box after a preemption, else on an idle spare of "
                   "pool NAME (or a box --provision brings up). Needs --durable.")
@click.option("--provision", default=None, metavar="CMD",
              help="Your command that rents a box and prints one JSON line {host, port, user, name}.")
@click.option("--lost-after", type=Duration(), default=None, metavar="DUR",
              help="How long the box fails ssh probes, its beats late, before it is lost (default: 3 heartbeat "
                   "intervals, at least 5s).")
@click.option("--max-recoveries", type=click.IntRange(0, 1000000), default=None,
              help="Recoveries before the keeper gives up (default 10).")
@click.option("--max-at-risk", type=Duration(), default=None, metavar="DUR",
              help="Alert when the training since the newest durable checkpoint passes this (e.g. 30m).")
@click.option("--backoff", type=Duration(), default=None, metavar="DUR",
              help="The wait after a failed try to find a box or to launch; doubles (default 30s).")
@click.option("--recover-tries", type=click.IntRange(1, 1000), default=None,
              help="Tries to find a box (or to launch) before the run ends failed_no_resource (default 3).")
@click.option("--provision-timeout", type=Duration(), default=None, metavar="DUR", callback=_provision_timeout,
              help="How long --provision may take, 1s to 24h (default 10m).")
@click.option("--code", "code", type=click.Path(file_okay=False), default=None,
              help="The local code dir the keeper pushes to a replacement box.")
@click.option("--include-secret", "include_secret", multiple=True, metavar="PATH", help="A secret-looking file of --code "
              "the keeper sends too (as `onboxctl push --include-secret`).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def run(ctx: click.Context, as_json: bool, **values: Any) -> None:
    """Launch CMD under `onbox run` on each BOX, detached; prints the run names and returns at once.

    Without --name the same line again continues its run (same command, working dir, durable target and checkpoint
    dir) and says `resuming RUN from step S`; on a replacement box this machine's launch log and the durable target
    find it (--take-over while the lost box's lease is live). A run still alive is refused (exit 2); one that ended
    done, or none, gives a new run, as --new does. --json carries the decision under `match`.

    With --nodes the boxes run one job (node 0 first); the same line again relaunches the whole group from node 0's
    newest committed checkpoint. With --recover pool:NAME, `onboxctl keep` brings the run back without you
    (README.md, "Leave it running").
    """
    plan = prepare(values, ctx.meta.get("cmd", []), _check_recovery)
    for line in plan.warnings:
        _warn(line)
    results = start(plan, functools.partial(_enrol, plan), say=None if as_json else click.echo, warn=_warn)
    _report(ctx, results, as_json)


def _warn(text: str) -> None:
    click.echo("onboxctl: warning: " + text, err=True)


def _check_recovery(recover: Optional[str], opts: Dict[str, Any], cmd: List[str], durable: Optional[str],
                    boxes: Dict[str, Any]) -> Any:
    """--recover and its companions, checked by the keeper (imported only then)."""
    from controller.keeper.enrol import check_recovery

    return check_recovery(recover, opts, cmd, durable, boxes)


def _enrol(plan: RunPlan, run_name: str, run_boxes: List[str], run_cmd: List[str]) -> None:
    """A started run's records for `onboxctl keep`, with --recover."""
    if plan.policy is None:
        return
    from controller.keeper.enrol import enrol_checked

    enrol_checked(plan.policy, run_name, run_boxes, run_cmd, plan.nodes, plan.forwarded, plan.onbox_env, plan.workdir,
                  plan.recorded, plan.tracker, plan.tunnel_to is not None, plan.timeout, warn=_warn)


def _report(ctx: click.Context, results: List[Any], as_json: bool) -> None:
    if as_json:
        echo_json({"runs": [r.to_dict() for r in results]})
    else:
        for r in results:
            if r.ok:
                click.echo("%s: started run %s (pid %s, %s) in %s" % (r.box, r.name, r.pid or "?", r.state or "state unknown",
                                                                  r.workdir))
                if r.tunnel:
                    sup = r.tunnel.get("supervisor")
                    how = ("kept up by its supervisor, pid %s: `onboxctl tunnel %s` shows it" % (sup, r.box) if sup
                           else "not supervised (%s): `onboxctl tunnel %s` re-opens it" % (r.tunnel.get("unsupervised"),
                                                                                          r.box))
                    click.echo("%s: heartbeats go to %s, tunnelled over ssh to %s (%s)" % (r.box, r.tracker,
                                                                                         r.tunnel["to"], how))
            else:
                click.echo("%s: %s" % (r.box, r.not_started()), err=True)
                if r.hint:
                    click.echo("hint: %s" % r.hint, err=True)
    failed = [r for r in results if not r.ok]
    if failed:
        ctx.exit(failed[0].exit_code or 1)
