"""`onboxctl run BOX [BOX...] [--name] [run options] -- CMD`: start supervised runs, return at once."""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Set, Tuple

import click

from controller.boxes.inventory import Box, Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from controller.commands.params import Duration, HangAfter, Seconds
from controller.launch.relaunch import Choice
from controller.launch.start import LaunchResult, check_job_options, check_name, launch_many, read_fanout
from controller.userconfig import check_tracker_url
from onbox.clikit import LaidOut, echo_json
from onbox.errors import OnboxError, UsageError
from onbox.paths import default_run_name

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


def _forward(flag: str, value: Any) -> List[str]:
    if value is None or value == () or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, tuple):
        out: List[str] = []
        for v in value:
            out += [flag, str(v)]
        return out
    return [flag, str(value)]


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
def run(ctx: click.Context, boxes: Tuple[str, ...], name: Optional[str], fanout: Optional[str], parallel: int,
        workdir: Optional[str], as_json: bool, timeout: float, onbox_args: Tuple[str, ...],
        tracker: Optional[str], tunnel: Optional[bool], tracker_token_file: Optional[str],
        heartbeat_interval: Optional[float], sync_interval: Optional[float], settings: Tuple[str, ...],
        as_nodes: bool, master_addr: Optional[str], recover: Optional[str], **opts: Any) -> None:
    """Launch CMD under `onbox run` on each BOX, detached; prints the run names and returns at once.

    Without --name the same line again continues its run (same command, working dir, durable target and checkpoint
    dir) and says `resuming RUN from step S`; on a replacement box this machine's launch log and the durable target
    find it (--take-over while the lost box's lease is live). A run still alive is refused (exit 2); one that ended
    done, or none, gives a new run, as --new does. --json carries the decision under `match`.

    With --nodes the boxes run one job (node 0 first); the same line again relaunches the whole group from node 0's
    newest committed checkpoint. With --recover pool:NAME, `onboxctl keep` brings the run back without you
    (README.md, "Leave it running").
    """
    cmd: List[str] = ctx.meta.get("cmd", [])
    keep_opts = {k: opts.pop(k) for k in ("provision", "lost_after", "max_recoveries", "max_at_risk", "backoff",
                                          "recover_tries", "provision_timeout", "code", "include_secret")}
    new = opts.pop("new")
    # --take-over is for this launch only: never in what the keeper records and relaunches with
    take_over = ["--take-over"] if opts.pop("take_over") else []
    if new and name is not None:
        raise UsageError("--new and --name together: --name names the run (an existing one is continued), --new "
                         "asks for a new run with the default name",
                         hint="drop --new to launch the run named by --name, or drop --name for a new run named "
                              "<program>-<UTC time>")
    if new and as_nodes:
        raise UsageError("--new goes with single-box and fan-out launches: a --nodes group is new unless --name "
                         "names a recorded one", hint="drop --new")
    if as_nodes:
        _check_nodes(boxes, fanout, name, cmd, opts, settings, onbox_args)
    elif master_addr is not None:
        raise UsageError("--master-addr goes with --nodes")
    planned: List[Tuple[str, List[str]]] = [(b, list(cmd)) for b in boxes]
    if fanout:
        planned += [(b, c or list(cmd)) for b, c in read_fanout(fanout)]
    if not planned:
        raise UsageError("no box given", hint="onboxctl run BOX [BOX...] -- CMD  (or --fanout FILE)")
    missing = [b for b, c in planned if not c]
    if missing and not as_nodes:
        raise UsageError("no command to run on %s" % ", ".join(missing), hint="put it after `--`: onboxctl run BOX -- python train.py")
    if name is not None:
        check_name(name)
    if workdir is not None and (not workdir or workdir.startswith("-") or any(ord(c) < 32 for c in workdir)):
        raise UsageError("invalid --workdir %r" % workdir, hint="a directory on the box, e.g. /workspace/code")
    for kv in opts.get("env") or ():
        if not ENV_NAME_RE.fullmatch(kv.partition("=")[0]) or "=" not in kv:
            raise UsageError("--env must look like KEY=VAL (KEY letters, digits and _), not %r" % kv)
    check_job_options(opts)
    if tracker is not None:
        tracker = check_tracker_url(tracker, "--tracker")
    elif tunnel:
        raise UsageError("--tunnel needs --tracker", hint="e.g. --tracker http://127.0.0.1:8787")
    from controller.boxes.tunnel import is_local

    tunnel_to = tracker if tracker and (tunnel or (tunnel is None and is_local(tracker))) else None
    if tunnel_to:
        from controller.boxes.tunnel import WatchKnobs

        WatchKnobs.from_env()  # its supervisor's settings, refused now rather than after the launch
    onbox_env = {}
    for field, value in (("tracker", tracker), ("tracker_token_file", tracker_token_file),
                         ("heartbeat_interval", heartbeat_interval), ("sync_interval", sync_interval)):
        if value is not None:
            onbox_env["ONBOX_" + field.upper()] = str(value)
    for kv in settings:
        field, sep, value = kv.partition("=")
        if not sep or not ENV_NAME_RE.fullmatch(field.replace("-", "_")):
            raise UsageError("--set must look like FIELD=VALUE, not %r" % kv)
        onbox_env["ONBOX_" + field.replace("-", "_").upper()] = value
    forwarded: List[str] = []
    for key, value in sorted(opts.items()):
        forwarded += _forward("--" + key.replace("_", "-"), value)
    forwarded += list(onbox_args)
    inv = Inventory()
    policy = None
    recorded = dict(opts, **keep_opts)
    recorded["durable"] = opts.get("durable") or onbox_env.get("ONBOX_DURABLE")
    if recover is not None or any(v not in (None, ()) for v in keep_opts.values()):
        from controller.keeper.enrol import check_recovery

        policy = check_recovery(recover, recorded, cmd if as_nodes else list(planned[0][1]), recorded["durable"],
                                inv.load())

    def enrol(run_name: str, run_boxes: List[str], run_cmd: List[str]) -> None:
        if policy is None:
            return
        from controller.keeper.enrol import enrol_checked
        enrol_checked(policy, run_name, run_boxes, run_cmd, as_nodes, forwarded, onbox_env, workdir, recorded, tracker,
                      tunnel_to is not None, timeout, warn=lambda text: click.echo("onboxctl: warning: " + text, err=True))

    if as_nodes:
        from controller.launch.nodes import launch_group

        group = check_name(name or default_run_name(cmd))
        results = launch_group(Ssh(settings_from_env()), [inv.resolve(b) for b in boxes], cmd,
                               group, forwarded + take_over, workdir=workdir,
                               parallel=parallel, timeout=timeout, onbox_env=onbox_env, tunnel_to=tunnel_to,
                               master_addr=master_addr)
        if all(r.ok for r in results):
            enrol(group, list(boxes), cmd)
        _report(ctx, results, as_json)
        return
    several = len(planned) > 1
    resolved = [(inv.resolve(box_name), box_cmd) for box_name, box_cmd in planned]
    choices: List[Any] = []
    for box, box_cmd in resolved:
        base = name or default_run_name(box_cmd)
        run_name = check_name("%s-%s" % (base, box.name) if several else base)
        choices.append(Choice(box.name, "named" if name else "new", run_name,
                              why="named by --name" if name else "asked for with --new"))
    ssh = Ssh(settings_from_env())
    if name is None:
        choices = _find_runs(ssh, resolved, choices, forwarded, workdir, onbox_env, parallel, timeout,
                             bool(take_over), new)
    for c in choices:
        if not as_json and isinstance(c, Choice) and c.decision != "named":
            click.echo("%s: %s" % (c.box, c.line()))
    jobs = [(box, box_cmd, c.run) for (box, box_cmd), c in zip(resolved, choices) if isinstance(c, Choice)]
    launched = iter(launch_many(ssh, jobs, forwarded + take_over, workdir=workdir, parallel=parallel, timeout=timeout,
                                onbox_env=onbox_env, tunnel_to=tunnel_to) if jobs else [])
    started: List[LaunchResult] = []
    for c in choices:
        res = next(launched) if isinstance(c, Choice) else c  # a box whose run could not be found failed there
        if isinstance(c, Choice):
            res.match = c.to_dict()
        started.append(res)
    for (box_name, box_cmd), res in zip(planned, started):
        if res.ok:
            enrol(res.name, [box_name], box_cmd)
    _record_launches(started)
    _report(ctx, started, as_json)


def _find_runs(ssh: Ssh, resolved: List[Tuple[Box, List[str]]], defaults: List[Any], forwarded: List[str],
               workdir: Optional[str], onbox_env: Dict[str, str], parallel: int, timeout: float,
               take_over: bool, new: bool) -> List[Any]:
    """For each box, the run this launch continues (controller/launch/relaunch.py): a Choice, or the failed LaunchResult
    of a box whose agent could not be asked or whose run is still alive (that box is not launched). `new`
    (--new): a new run on each box, under a name none of its runs has."""
    import concurrent.futures

    from controller.launch.launchlog import LaunchLog
    from controller.launch.relaunch import ask, candidate_names, decide, free_name

    # newest first; a damaged log is refused here, before any box is asked
    log = [] if new else LaunchLog().load()[::-1]
    boxes = {box.name for box, _ in resolved}
    logs = [[e for e in log if e["command"] == list(box_cmd)] for _, box_cmd in resolved]

    def one(i: int) -> Any:
        box, box_cmd = resolved[i]
        return ask(ssh, box, box_cmd, forwarded, workdir, onbox_env,
                   candidate_names(logs[i], box.name, boxes - {box.name}), timeout=timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [pool.submit(one, i) for i in range(len(resolved))]
        answers: List[Any] = []
        for f in futures:
            try:
                answers.append(f.result())
            except OnboxError as e:
                answers.append(e)
    out: List[Any] = []
    claimed: Set[str] = set()
    for i, ((box, _), default, answer) in enumerate(zip(resolved, defaults, answers)):
        try:
            if isinstance(answer, OnboxError):
                raise answer
            if new:
                choice = dataclasses.replace(default, run=free_name(default.run, set(answer.get("names") or [])))
            else:
                choice = decide(box, answer, logs[i], default.run, take_over, claimed)
        except OnboxError as e:
            out.append(LaunchResult(box=box.name, name=getattr(e, "run", default.run), ok=False, error=e.message,
                                    hint=e.hint, exit_code=int(e.exit_code)))
            continue
        if choice.decision == "resume":
            claimed.add(choice.run)
        out.append(choice)
    return out


def _record_launches(results: List[LaunchResult]) -> None:
    """Every run a box started, into this machine's launch log (what its agent recorded as making it this run)."""
    from controller.launch.launchlog import LaunchLog

    rows = [dict(r.recorded, run=r.name, box=r.box) for r in results
            if r.ok and isinstance(r.recorded, dict) and isinstance(r.recorded.get("command"), list)]
    if not rows:
        return
    problem = LaunchLog().record(rows)
    if problem:
        click.echo("onboxctl: warning: %s: the launch is not recorded (a relaunch on another box will not find "
                   "it by itself; --name names it)" % problem, err=True)


def _check_nodes(boxes: Tuple[str, ...], fanout: Optional[str], name: Optional[str], cmd: List[str],
                 opts: Dict[str, Any], settings: Tuple[str, ...], onbox_args: Tuple[str, ...]) -> None:
    """--nodes: two boxes or more on the command line, a durable target (the other nodes restore from it), a
    command or a --name to relaunch from the boxes' records (which hold the durable target)."""
    if fanout:
        raise UsageError("--nodes takes its boxes on the command line, in node order, not from --fanout")
    if len(boxes) < 2:
        raise UsageError("--nodes needs two boxes or more", hint="onboxctl run gpu1 gpu2 --nodes -- torchrun ...")
    if not cmd and not name:
        raise UsageError("no command to run", hint="onboxctl run gpu1 gpu2 --nodes -- torchrun ... (or --name RUN "
                                                   "to relaunch a group from its records)")
    if cmd and not opts.get("durable") and not any(s.replace("-", "_").startswith("durable=") for s in settings) and \
            not any(a == "--durable" or a.startswith("--durable=") for a in onbox_args):
        raise UsageError("--nodes needs --durable", hint="node 0 commits there and the other nodes restore from "
                                                         "it: an rclone remote, or a mount every node shares")
    words = " ".join(cmd)
    if "c10d" in words and "rdzv" in words:
        click.echo("onboxctl: warning: torchrun's c10d rendezvous ignores --node-rank and may put rank 0 (the rank "
                   "that saves) on another node than node 0 (the node that commits); onbox sets torchrun's static "
                   "rendezvous through PET_* variables: drop the --rdzv-* flags", err=True)


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
                click.echo("%s: FAILED to start %s: %s" % (r.box, r.name, r.error), err=True)
                if r.hint:
                    click.echo("hint: %s" % r.hint, err=True)
    failed = [r for r in results if not r.ok]
    if failed:
        ctx.exit(failed[0].exit_code or 1)
