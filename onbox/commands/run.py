"""`onbox run` and `onbox adopt`: thin commands over onbox.launch (prepare, then start). The option table of
`onbox run` is here, once: `onbox queue add` takes the same options, `onbox sbatch` checks them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import click

from onbox.clikit import LaidOut, PathValue, echo_json
from onbox.config import RANGES

if TYPE_CHECKING:
    from onbox.launch.plan import LaunchPlan


def _r(key: str) -> str:
    """The documented range of a number, as `onbox run --help` shows it (config.RANGES)."""
    low, high, _unit = RANGES[key]
    return "-".join(str(int(x)) if float(x).is_integer() else str(x) for x in (low, high))


def run_options(f: Any) -> Any:
    """The options of `onbox run`, for `onbox run` and `onbox queue add`."""
    opts = [
        click.option("--name", help="Run name (default: <program>-<UTC time> for a run, as onboxctl run names it; "
                                     "q<ID>-<script> for a queue entry)."),
        click.option("--profile", help="Platform profile whose defaults apply (grace, paths, notices)."),
        click.option("-f", "--run-file", "run_file", type=PathValue(click.Path(dir_okay=False)),
                     help="A TOML run file holding the same options (a [run] table)."),
        click.option("--ckpt-dir", type=PathValue(), help="Where the trainer writes checkpoints (ONBOX_CKPT_DIR)."),
        click.option("--durable", type=PathValue(), help="Durable target: a mounted path or an rclone remote:path."),
        click.option("--sync-interval", type=float, help="Seconds between commits of a new complete checkpoint "
                     "(%s, default 60)." % _r("sync_interval")),
        click.option("--lease-ttl", type=float, help="Seconds the run's lease on durable storage stays live after "
                     "a renewal (%s; default max(60, 3 x --sync-interval))." % _r("lease_ttl")),
        click.option("--settle-seconds", type=float, help="A checkpoint untouched this long (and format-valid) "
                     "counts as complete (%s s, default 10)." % _r("settle_seconds")),
        click.option("--keep-last", type=int, help="Committed checkpoints kept newest-first (%s, default 3)."
                     % _r("keep_last")),
        click.option("--keep-best", "keep_best", metavar="METRIC[:min|max]",
                     help="Also keep the best checkpoint by this metric (default direction: min)."),
        click.option("--keep-every", "keep_every_steps", type=int, metavar="STEPS",
                     help="Also keep every checkpoint whose step is a multiple of STEPS (%s)." % _r("keep_every_steps")),
        click.option("--prune-local/--no-prune-local", default=None,
                     help="Delete committed local copies (never the newest) when the local disk runs low."),
        click.option("--final-sync-timeout", type=float, help="Seconds the final commit may take when the job "
                     "ends (%s, default 300)." % _r("final_sync_timeout")),
        click.option("--restore-probation", type=float, help="A resumed attempt that fails this soon, before "
                     "passing its step, quarantines that checkpoint (%s, default 900; 0: never)."
                     % _r("restore_probation")),
        click.option("--restart", type=click.Choice(["on-failure", "always", "never"]), help="Restart policy."),
        click.option("--hang-after", metavar="DUR", help="Hung after this long with no step, output or checkpoint "
                     "write (90s, 5m; 0 or `off`: never). Default: learned from the step cadence."),
        click.option("--on-hang", type=click.Choice(["alert", "restart", "stop"]),
                     help="What a hang does once the stacks are saved (hang-stacks.<attempt>.txt): alert; restart "
                     "(default) from the newest checkpoint; stop: the run ends failed (hung)."),
        click.option("--max-restarts", type=int, help="Restarts after failures before giving up (%s, default 5)."
                     % _r("max_restarts")),
        click.option("--checkpoint-signal", help="Signal forwarded to the child on preemption (default TERM; "
                     "never KILL or STOP: the child could not checkpoint)."),
        click.option("--preempt-signal", help="Scheduler signal the agent treats as preemption (default USR1; "
                     "never KILL, STOP or CHLD)."),
        click.option("--grace", type=float, help="Seconds from a preemption notice to the hard kill (%s; default "
                     "from the profile, else 30)." % _r("grace")),
        click.option("--deadline", metavar="WHEN", help="When the session ends: a time (2026-11-25T18:00Z), a "
                     "duration (11h40m), `slurm` or `none` (default: the platform's). The checkpoint comes in "
                     "time; the run exits 75."),
        click.option("--ckpt-pattern", "ckpt_pattern", multiple=True, metavar="GLOB",
                     help="Which names in --ckpt-dir are checkpoints (e.g. '*.json'). Repeatable; default: any "
                     "name but logs, TensorBoard events and images."),
        click.option("--ckpt-ignore", "ckpt_ignore", multiple=True, metavar="GLOB",
                     help="Names in --ckpt-dir that are never checkpoints, e.g. 'samples_*'. Repeatable."),
        click.option("--resume-arg", "resume_args", multiple=True,
                     help="Argument appended when a checkpoint exists; {ckpt} expands to its path. Repeatable."),
        click.option("--env", "env", multiple=True, help="KEY=VAL for the child. Repeatable. Recorded in "
                     "config.json and visible in `ps`: secrets go in --secret or --env-file."),
        click.option("--env-file", "env_files", multiple=True, metavar="PATH", type=PathValue(),
                     help="KEY=VAL lines for the child, read when each attempt starts; only the path is "
                     "recorded. Repeatable."),
        click.option("--secret", "secrets", multiple=True, metavar="[VAR=]NAME",
                     help="The child gets VAR (default NAME) from $ONBOX_HOME/secrets/NAME (`onboxctl secrets "
                     "push`), never recorded. Repeatable."),
        click.option("--workdir", type=PathValue(click.Path(file_okay=False)), help="Child's working directory."),
        click.option("--notice-source", type=click.Choice(["auto", "aws", "gcp", "azure", "none"]),
                     help="Cloud preemption notices from the metadata service."),
        click.option("--metadata-url", help="Base URL of the metadata service (override)."),
        click.option("--requeue/--no-requeue", default=None, help="Under Slurm: scontrol requeue on preemption."),
        click.option("--tracker", help="Tracker URL heartbeats go to (or ONBOX_TRACKER)."),
        click.option("--tracker-token-file", type=PathValue(click.Path(dir_okay=False)),
                     help="File holding the tracker's bearer token (or ONBOX_TRACKER_TOKEN; never a flag value)."),
        click.option("--heartbeat-interval", type=float, help="Seconds between heartbeats (%s, default 30)."
                     % _r("heartbeat_interval")),
        click.option("--heartbeat-file", type=PathValue(click.Path(dir_okay=False)),
                     help="Also append every heartbeat to this JSONL file (e.g. on the durable dir)."),
        click.option("--ping-url", help="healthchecks.io-style ping URL (/start, success pings, /fail)."),
        click.option("--mlflow", metavar="URL", help="Also send heartbeats and metrics to this MLflow tracking "
                     "server (or ONBOX_MLFLOW): one MLflow run per onbox run, found again by its tag onbox.run."),
        click.option("--mlflow-experiment", metavar="NAME", help="MLflow experiment of the run (or "
                     "ONBOX_MLFLOW_EXPERIMENT; default onbox; created when missing)."),
        click.option("--mlflow-token-file", type=PathValue(click.Path(dir_okay=False)), help="File holding the MLflow "
                     "bearer token (else MLflow's variables; never given to the child)."),
        click.option("--metrics-regex", "metrics_regex", multiple=True, metavar="REGEX",
                     help="A regex with named groups (step, loss, eval_loss, lr, tokens_per_s, samples_per_s, "
                     "epoch) for output lines the built-in formats miss. Repeatable."),
        click.option("--resume", "resume_existing", is_flag=True,
                     help="Continue run NAME although CMD, --ckpt-dir or --durable differ from its record."),
        click.option("--node-group", "node_group", metavar="PATH|-", type=PathValue(stdin_dash=True),
                     help="This run is one node of a multi-node group: the group file (`-`: stdin, as `onboxctl "
                          "run --nodes` sends it)."),
        click.option("--docker", "docker_image", metavar="IMAGE",
                     help="Run CMD in a container of IMAGE (its dirs mounted at the same paths)."),
        click.option("--docker-arg", "docker_args", multiple=True, metavar="OPT",
                     help="An extra `docker run` option, e.g. --docker-arg=--volume=/data:/data. Repeatable."),
        click.option("--shm-size", "docker_shm_size", help="/dev/shm of the --docker container (default 16g)."),
        click.option("--foreground", is_flag=True, help="Stay in the foreground (sbatch, containers, systemd)."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


# `onbox run --help`: the common options first (those not named here), then these under their headings
RUN_SECTIONS = [
    ("Checkpoints", ["--sync-interval", "--settle-seconds", "--keep-last", "--keep-best", "--keep-every",
                     "--prune-local", "--final-sync-timeout", "--restore-probation", "--ckpt-pattern", "--ckpt-ignore",
                     "--lease-ttl", "--take-over", "--resume"]),
    ("Restarts, hangs and preemption", ["--restart", "--max-restarts", "--hang-after", "--on-hang",
                                        "--checkpoint-signal", "--preempt-signal", "--grace", "--deadline",
                                        "--notice-source", "--metadata-url", "--requeue"]),
    ("Heartbeats and tracking", ["--tracker", "--tracker-token-file", "--heartbeat-interval", "--heartbeat-file",
                                 "--ping-url", "--mlflow", "--mlflow-experiment", "--mlflow-token-file",
                                 "--metrics-regex"]),
    ("Containers and multi-node", ["--docker", "--docker-arg", "--shm-size", "--node-group"]),
]
RUN_EXAMPLES = [
    "onbox run --durable /mnt/durable -- python3 train.py --lr 3e-4",
    "onbox run --name big --durable remote:bucket/ckpt -- torchrun --nproc-per-node=8 train.py",
    "onbox run --name big        # relaunch `big` as recorded (a requeued sbatch script, onstart.sh)",
]


@click.command(cls=LaidOut, usage="[OPTIONS] -- CMD [ARGS]...", examples=RUN_EXAMPLES, sections=RUN_SECTIONS,
               context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@run_options
@click.option("--take-over", "take_over", is_flag=True,
              help="Supersede the live lease another agent holds on --durable (its box was lost): that agent "
                   "writes nothing more and stops.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(command: List[str], run_file: Optional[str], foreground: bool, as_json: bool, resume_existing: bool,
        take_over: bool, **flags: Any) -> int:
    """Start a supervised run of CMD, detached: prints the run name, its directory and the PID once the child runs.

    Starting an existing run again re-adopts its child if it is still alive (no double launch); `onbox run --name X`
    without a command re-launches X from its recorded config.json. Every number must be finite and inside its range
    (shown with each option; the ranges of the run-file and ONBOX_* knobs are in onbox/supervisor/README.md). Booleans
    are true/false, never numbers.

    With --durable the run's lease there keeps a second agent off it (--take-over supersedes a lost box's). A hung
    trainer (no step, output or checkpoint write past --hang-after) gets its stacks saved, then --on-hang acts.

    Exit codes: 0 started (with --foreground, the run's own: 0 done/stopped, 1 failed or fenced, 75 preempted or
    session_limit); 2 bad input, nothing created, or another agent holds the run; 3 the box is unfit.
    """
    from onbox.launch.plan import prepare

    if take_over:
        click.echo("onbox: warning: --take-over: a live lease another agent holds on the durable storage is "
                   "superseded; that agent stops at its next check", err=True)
    plan = prepare(flags, command, run_file, resume_existing, take_over=take_over)
    say_warnings(plan.warnings)
    return _start(plan, foreground, as_json)


@click.command(cls=LaidOut, examples=["onbox adopt NAME                # re-attach to a child whose agent died",
                                      "onbox adopt NAME --foreground   # and supervise it from this shell"])
@click.argument("name")
@click.option("--foreground", is_flag=True, help="Stay in the foreground.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def adopt(name: str, foreground: bool, as_json: bool) -> int:
    """Re-adopt run NAME whose child outlived its agent (PID and start time must both match)."""
    from onbox.launch.plan import prepare_adopt

    return _start(prepare_adopt(name), foreground, as_json)


def say_warnings(lines: List[str]) -> None:
    """What prepare() found worth a warning, on stderr, before the run starts."""
    for line in lines:
        click.echo("onbox: warning: %s" % line, err=True)


def _start(plan: "LaunchPlan", foreground: bool, as_json: bool) -> int:
    """start(plan), saying what the agent reported: a detached start, or a child adopted in the foreground (a run
    started in the foreground speaks through its output log and exit code)."""
    from onbox.launch.start import start

    def ready(info: Dict[str, Any]) -> None:
        if foreground:
            if info.get("adopted"):
                _report(info, as_json)
        elif info.get("ok"):
            _report(info, as_json)
        else:
            # exit 2 is a refusal (a live lease, the run's lock, bad input): nothing was started, and it says so
            said = "refused, nothing started" if info.get("exit") == 2 else "failed to start"
            click.echo("onbox: run %s %s: %s" % (plan.rd.name, said, info.get("error")), err=True)
            if info.get("hint"):
                click.echo("hint: %s" % info["hint"], err=True)

    return start(plan, foreground, ready)


def _report(info: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(info)
    else:
        click.echo("%s %s %s %s" % ("adopted" if info.get("adopted") else "started", info["run"], info["run_dir"],
                                    info.get("pid")))


def check_run_options(args: List[str]) -> None:
    """`onbox run` options given to another command (`onbox sbatch` passes them through): parsed and their
    values validated now, not on a node after the queue wait. Files they name are not read here."""
    from onbox.config import RunConfig
    from onbox.launch.plan import cli_layer

    ctx = run.make_context("onbox run", [*args, "--", "true"])
    flags = {k: v for k, v in ctx.params.items()
             if k not in ("command", "run_file", "foreground", "as_json", "resume_existing", "take_over")}
    RunConfig.from_dict(cli_layer(flags), "the run options").validate()
