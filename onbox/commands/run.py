"""`onbox run` and `onbox adopt`: thin commands over onbox.launch (prepare, then start). The option table of
`onbox run` is here, once: `onbox queue add` takes the same options, `onbox sbatch` checks them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import click

from onbox.clikit import PathValue, echo_json
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
        click.option("--name", help="Run name (default: <program>-<UTC time>, as onboxctl run names it)."),
        click.option("--profile", help="Platform profile whose defaults apply (grace, paths, notices)."),
        click.option("-f", "--run-file", "run_file", type=PathValue(click.Path(dir_okay=False)),
                     help="A TOML run file holding the same options (a [run] table)."),
        click.option("--ckpt-dir", type=PathValue(), help="Where the trainer writes checkpoints (ONBOX_CKPT_DIR)."),
        click.option("--durable", type=PathValue(), help="Durable target: a mounted path or an rclone remote:path."),
        click.option("--sync-interval", type=float, help="Seconds between commits of a new complete checkpoint "
                     "(%s, default 60)." % _r("sync_interval")),
        click.option("--lease-ttl", type=float, help="Seconds the run's lease on durable storage stays live after "
                     "a renewal: while it is, another launch of the run is refused (%s; default max(60, 3 x "
                     "--sync-interval))." % _r("lease_ttl")),
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
        click.option("--restore-probation", type=float, help="An attempt that resumed from a checkpoint and failed "
                     "within this many seconds, before getting past its step, quarantines it and the next attempt "
                     "falls back to an older one (%s, default 900; 0: never)." % _r("restore_probation")),
        click.option("--restart", type=click.Choice(["on-failure", "always", "never"]), help="Restart policy."),
        click.option("--hang-after", metavar="DUR", help="A trainer that reported steps is HUNG after this long "
                     "with no new step, no output and no checkpoint write (90s, 5m, seconds; 0 or `off`: never). "
                     "Default: learned from its cadence, max(hang_factor (10) x its median step interval, "
                     "hang_floor (120 s)); an eval it announces gets 2 x the longest eval silence seen; before "
                     "an attempt's first step, hang_startup (1200 s)."),
        click.option("--on-hang", type=click.Choice(["alert", "restart", "stop"]),
                     help="What a hang does, once the stacks of every process of the attempt and the GPU state are "
                     "saved (<run dir>/hang-stacks.<attempt>.txt, and with the logs on --durable): alert only; "
                     "restart (default) stops the whole attempt and restarts it from the newest checkpoint, "
                     "bounded by the restart policy; stop ends the run failed (`hung`)."),
        click.option("--max-restarts", type=int, help="Restarts after failures before giving up (%s, default 5)."
                     % _r("max_restarts")),
        click.option("--checkpoint-signal", help="Signal forwarded to the child on preemption (default TERM; "
                     "never KILL or STOP: the child could not checkpoint)."),
        click.option("--preempt-signal", help="Scheduler signal the agent treats as preemption (default USR1; "
                     "never KILL, STOP or CHLD)."),
        click.option("--grace", type=float, help="Seconds from a preemption notice to the hard kill (%s; default "
                     "from the profile, else 30)." % _r("grace")),
        click.option("--deadline", metavar="WHEN", help="When the session ends: an absolute time (2026-11-25T18:00Z, "
                     "or with an offset) or a duration from the launch (11h40m); `slurm`: the job's end time; "
                     "`none`: no deadline. Default: the platform's (Slurm's EndTime, a Kaggle session, the "
                     "profile's session hours). The checkpoint is asked for at deadline - (grace + commit + "
                     "deadline_margin); the run exits 75 session_limit."),
        click.option("--ckpt-pattern", "ckpt_pattern", multiple=True, metavar="GLOB",
                     help="Which names in --ckpt-dir are checkpoints (a glob, e.g. '*.json'): only those are "
                     "committed and restored; each is complete by its format, its rename into the dir, its close "
                     "or quiet. Repeatable; default: any name but logs, TensorBoard events and images."),
        click.option("--ckpt-ignore", "ckpt_ignore", multiple=True, metavar="GLOB",
                     help="Names in --ckpt-dir that are never checkpoints (logs, events, samples the trainer also "
                     "writes there), e.g. 'samples_*'. Repeatable."),
        click.option("--resume-arg", "resume_args", multiple=True,
                     help="Argument appended when a checkpoint exists; {ckpt} expands to its path. Repeatable."),
        click.option("--env", "env", multiple=True, help="KEY=VAL for the child. Repeatable. Recorded in "
                     "config.json and visible in `ps`: secrets go in --secret or --env-file."),
        click.option("--env-file", "env_files", multiple=True, metavar="PATH", type=PathValue(),
                     help="KEY=VAL lines for the child, read when each attempt starts; only the path is "
                     "recorded. Repeatable."),
        click.option("--secret", "secrets", multiple=True, metavar="[VAR=]NAME",
                     help="The child gets VAR (default NAME) from the file $ONBOX_HOME/secrets/NAME (where "
                     "`onboxctl secrets push` puts it), read when each attempt starts, never recorded. Repeatable."),
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
        click.option("--mlflow-token-file", type=PathValue(click.Path(dir_okay=False)), help="File holding the MLflow bearer "
                     "token (else MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN from the agent's "
                     "environment; never a flag value, never given to the child)."),
        click.option("--metrics-regex", "metrics_regex", multiple=True, metavar="REGEX",
                     help="A Python regex with named groups (step, loss, eval_loss, lr, tokens_per_s, "
                     "samples_per_s, epoch) for output lines the built-in formats miss. Repeatable."),
        click.option("--resume", "resume_existing", is_flag=True,
                     help="Continue the existing run NAME although CMD, --ckpt-dir or --durable differ from what "
                          "it recorded (without it, a different command under an existing name is refused)."),
        click.option("--node-group", "node_group", metavar="PATH|-", type=PathValue(stdin_dash=True),
                     help="This run is one node of a multi-node group: the group file (`-`: read it from stdin, "
                          "as `onboxctl run --nodes` sends it; stored 0600, only its path is recorded)."),
        click.option("--docker", "docker_image", metavar="IMAGE",
                     help="Run CMD in a container of IMAGE (`docker run --rm --init --gpus ...`, checkpoint, run, "
                          "durable and work dirs mounted at the same paths)."),
        click.option("--docker-arg", "docker_args", multiple=True, metavar="OPT",
                     help="An extra `docker run` option for --docker, e.g. --docker-arg=--volume=/data:/data. Repeatable."),
        click.option("--shm-size", "docker_shm_size", help="/dev/shm of the --docker container (default 16g)."),
        click.option("--foreground", is_flag=True, help="Stay in the foreground (sbatch, containers, systemd)."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@click.command(context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@run_options
@click.option("--take-over", "take_over", is_flag=True,
              help="Supersede the live lease another agent holds on the run's --durable (its box was declared "
                   "lost: `onboxctl keep` passes it): that agent writes nothing more and stops. Needs --durable.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run(command: List[str], run_file: Optional[str], foreground: bool, as_json: bool, resume_existing: bool,
        take_over: bool, **flags: Any) -> int:
    """Start a supervised run of CMD: `onbox run [OPTIONS] -- CMD [ARGS...]`.

    Detaches by default and returns once the child runs, printing the run name, its directory and the PID.
    Starting an existing run again re-adopts its child if it is still alive (no double launch); `onbox run
    --name X` without a command re-launches X from its recorded config.json (e.g. from a requeued sbatch script
    or vast.ai's onstart.sh).

    Every number must be finite and inside its range (shown with each option; the run-file and ONBOX_* knobs:
    tick_interval 0.001-60 s, deadline_margin 0-86400 s (default 60), backoff_initial 0-86400 s, backoff_max 0-604800 s, term_timeout 0-3600 s,
    reap_wait 0-3600 s, sync_reserve 0-86400 s, notice_interval 0.01-3600 s, stall_minutes 0.01-10080,
    hang_factor 1-1000 (default 10), hang_floor 0-86400 s (default 120), hang_startup 0.01-604800 s (default 1200),
    metrics_hint_minutes 0-10080 (default 10; 0: never), crash_loop_threshold 0-1000, log_max_bytes 0-2^40,
    log_backups 0-1000, log_tail_lines 0-200 (default 20; 0: no output leaves the box), scan_max_entries
    1-10^8, scan_max_depth 1-1000, scan_max_seconds 0.001-3600 (one scan of the checkpoint dir; defaults 500000,
    32, 5)). Booleans are true/false, never numbers.

    With --durable the agent takes the run's lease there first (`<durable>/<run>/leases/`): while another agent's
    lease is live the launch is refused (exit 2, naming it) unless --take-over; an agent that finds a newer lease
    writes nothing more, stops its trainer and ends `fenced` (exit 1).

    A hung trainer: once it has reported a step, no new step, no output byte and no write in its checkpoint dir
    for longer than its bound (--hang-after; an eval it announces with a line such as `eval ...` or `Evaluating`
    has its own) gets the Python stacks of every process of the attempt saved (py-spy on PATH; else faulthandler in
    a trainer that registered SIGUSR2 into $ONBOX_STACKS_DIR/<pid>.txt; else /proc's state, wchan and kernel stack),
    then --on-hang acts (a `hang_detected` event, a warning in `onbox status` and the beats). A trainer whose
    output onbox never reads as a step is never judged hung.

    Exit codes: 0 started (or, with --foreground, the run's own: 0 done/stopped, 1 failed or fenced, 75
    preempted, or stopped by its --deadline: session_limit), 2 bad input (nothing is created, a --deadline that has
    passed or is too near; a platform's end too near is a warning; a path option given an option or nothing: `--durable
    -- cmd`, `--durable ""`; a checkpoint or durable dir that is `/` or in a system directory) or another agent holds
    the run, 3 the box is unfit (--deadline slurm unreadable; ONBOX_HOME read-only, full or not writable).
    """
    from onbox.launch.plan import prepare

    if take_over:
        click.echo("onbox: warning: --take-over: a live lease another agent holds on the durable storage is "
                   "superseded; that agent stops at its next check", err=True)
    plan = prepare(flags, command, run_file, resume_existing, take_over=take_over)
    say_warnings(plan.warnings)
    return _start(plan, foreground, as_json)


@click.command()
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
            click.echo("onbox: run %s failed to start: %s" % (plan.rd.name, info.get("error")), err=True)
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
