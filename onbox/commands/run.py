"""`onbox run` and `onbox adopt`: thin commands over detach.py and supervisor.py."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Tuple

import click

from onbox.commands.clikit import echo_json
from onbox.config import RANGES, is_remote
from onbox.errors import OnboxError, UnfitError, UsageError

UNPROCESSED = click.UNPROCESSED


def _r(key: str) -> str:
    """The documented range of a number, as `onbox run --help` shows it (config.RANGES)."""
    low, high, _unit = RANGES[key]
    return "-".join(str(int(x)) if float(x).is_integer() else str(x) for x in (low, high))


def _options(f: Any) -> Any:
    opts = [
        click.option("--name", help="Run name (default: <program>-<UTC time>, as onboxctl run names it)."),
        click.option("--profile", help="Platform profile whose defaults apply (grace, paths, notices)."),
        click.option("-f", "--run-file", "run_file", type=click.Path(dir_okay=False),
                     help="A TOML run file holding the same options (a [run] table)."),
        click.option("--ckpt-dir", help="Where the trainer writes checkpoints (ONBOX_CKPT_DIR)."),
        click.option("--durable", help="Durable target: a mounted path or an rclone remote:path."),
        click.option("--sync-interval", type=float, help="Seconds between commits of a new complete checkpoint "
                     "(%s, default 60)." % _r("sync_interval")),
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
        click.option("--max-restarts", type=int, help="Restarts after failures before giving up (%s, default 5)."
                     % _r("max_restarts")),
        click.option("--checkpoint-signal", help="Signal forwarded to the child on preemption (default TERM; "
                     "never KILL or STOP: the child could not checkpoint)."),
        click.option("--preempt-signal", help="Scheduler signal the agent treats as preemption (default USR1; "
                     "never KILL, STOP or CHLD)."),
        click.option("--grace", type=float, help="Seconds from a preemption notice to the hard kill (%s; default "
                     "from the profile, else 30)." % _r("grace")),
        click.option("--resume-arg", "resume_args", multiple=True,
                     help="Argument appended when a checkpoint exists; {ckpt} expands to its path. Repeatable."),
        click.option("--env", "env", multiple=True, help="KEY=VAL for the child. Repeatable. Recorded in "
                     "config.json and visible in `ps`: secrets go in --secret or --env-file."),
        click.option("--env-file", "env_files", multiple=True, metavar="PATH",
                     help="KEY=VAL lines for the child, read when each attempt starts; only the path is "
                     "recorded. Repeatable."),
        click.option("--secret", "secrets", multiple=True, metavar="[VAR=]NAME",
                     help="The child gets VAR (default NAME) from the file $ONBOX_HOME/secrets/NAME (where "
                     "`onboxctl secrets push` puts it), read when each attempt starts, never recorded. Repeatable."),
        click.option("--workdir", type=click.Path(file_okay=False), help="Child's working directory."),
        click.option("--notice-source", type=click.Choice(["auto", "aws", "gcp", "azure", "none"]),
                     help="Cloud preemption notices from the metadata service."),
        click.option("--metadata-url", help="Base URL of the metadata service (override)."),
        click.option("--requeue/--no-requeue", default=None, help="Under Slurm: scontrol requeue on preemption."),
        click.option("--tracker", help="Tracker URL heartbeats go to (or ONBOX_TRACKER)."),
        click.option("--tracker-token-file", type=click.Path(dir_okay=False),
                     help="File holding the tracker's bearer token (or ONBOX_TRACKER_TOKEN; never a flag value)."),
        click.option("--heartbeat-interval", type=float, help="Seconds between heartbeats (%s, default 30)."
                     % _r("heartbeat_interval")),
        click.option("--heartbeat-file", type=click.Path(dir_okay=False),
                     help="Also append every heartbeat to this JSONL file (e.g. on the durable dir)."),
        click.option("--ping-url", help="healthchecks.io-style ping URL (/start, success pings, /fail)."),
        click.option("--mlflow", metavar="URL", help="Also send heartbeats and metrics to this MLflow tracking "
                     "server (or ONBOX_MLFLOW): one MLflow run per onbox run, found again by its tag onbox.run."),
        click.option("--mlflow-experiment", metavar="NAME", help="MLflow experiment of the run (or "
                     "ONBOX_MLFLOW_EXPERIMENT; default onbox; created when missing)."),
        click.option("--mlflow-token-file", type=click.Path(dir_okay=False), help="File holding the MLflow bearer "
                     "token (else MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN from the agent's "
                     "environment; never a flag value, never given to the child)."),
        click.option("--metrics-regex", "metrics_regex", multiple=True, metavar="REGEX",
                     help="A Python regex with named groups (step, loss, eval_loss, lr, tokens_per_s, "
                     "samples_per_s, epoch) for output lines the built-in formats miss. Repeatable."),
        click.option("--resume", "resume_existing", is_flag=True,
                     help="Continue the existing run NAME although CMD, --ckpt-dir or --durable differ from what "
                          "it recorded (without it, a different command under an existing name is refused)."),
        click.option("--node-group", "node_group", metavar="PATH|-",
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
@_options
@click.argument("command", nargs=-1, type=UNPROCESSED)
def run(command: List[str], run_file: Optional[str], foreground: bool, as_json: bool, resume_existing: bool,
        **flags: Any) -> int:
    """Start a supervised run of CMD: `onbox run [OPTIONS] -- CMD [ARGS...]`.

    Detaches by default and returns once the child runs, printing the run name, its directory and the PID.
    Starting an existing run again re-adopts its child if it is still alive (no double launch); `onbox run
    --name X` without a command re-launches X from its recorded config.json (e.g. from a requeued sbatch script
    or vast.ai's onstart.sh).

    Every number must be finite and inside its range (shown with each option; the run-file and ONBOX_* knobs:
    tick_interval 0.001-60 s, backoff_initial 0-86400 s, backoff_max 0-604800 s, term_timeout 0-3600 s,
    reap_wait 0-3600 s, sync_reserve 0-86400 s, notice_interval 0.01-3600 s, stall_minutes 0.01-10080,
    metrics_hint_minutes 0-10080 (default 10; 0: never), crash_loop_threshold 0-1000, log_max_bytes 0-2^40,
    log_backups 0-1000, log_tail_lines 0-200 (default 20; 0: no output leaves the box), scan_max_entries
    1-10^8, scan_max_depth 1-1000, scan_max_seconds 0.001-3600 (one scan of the checkpoint dir; defaults 500000,
    32, 5)). Booleans are true/false, never numbers.

    Exit codes: 0 started (or, with --foreground, the run's own: 0 done/stopped, 1 failed, 75 preempted),
    2 bad input (nothing is created), 3 the box is unfit.
    """
    cfg, rd = prepare_run(command, run_file, resume_existing, flags)
    return _launch(cfg, rd, foreground, as_json, adopt_only=False)


def prepare_run(command: List[str], run_file: Optional[str], resume_existing: bool,
                flags: Dict[str, Any]) -> Tuple[Any, Any]:
    """(RunConfig, RunDir) of the run `onbox run` would start, resolved and checked in the foreground (exit 2, 3)
    with its warnings said; creates nothing. `onbox queue add` checks each entry with it."""
    from onbox import paths
    from onbox.commands import runchecks
    from onbox.subsystems import preflight
    from onbox.supervisor.rundir import RunDir

    cli = cli_layer(flags)
    if command:
        cli["command"] = list(command)
    saved = _relaunch_record(cli, run_file)
    if saved is not None:  # `onbox run --name X` alone: X again, exactly as recorded (flags still override)
        cfg = runchecks.resolve_relaunch(cli, saved, paths.run_dir(cli["name"]))
    else:
        cfg = _resolve_with_profile(cli, run_file)
    if not cfg.command:
        raise UsageError("no command to run", hint="onbox run [OPTIONS] -- CMD [ARGS...]")
    cfg.workdir = os.path.abspath(cfg.workdir or os.getcwd())
    # the detached agent runs from "/": relative paths must mean what they meant where `onbox run` was typed (`~`
    # was expanded where the configuration was read)
    for key in ("ckpt_dir", "tracker_token_file", "heartbeat_file", "mlflow_token_file"):
        if getattr(cfg, key):
            setattr(cfg, key, os.path.abspath(getattr(cfg, key)))
    if cfg.durable and not is_remote(cfg.durable):
        cfg.durable = os.path.abspath(cfg.durable)
    cfg.env_files = [os.path.abspath(p) for p in cfg.env_files]
    runchecks.check_child_secrets(cfg)  # every --env-file and --secret readable now, values not kept
    if not os.path.isdir(cfg.workdir):
        raise UsageError("working directory does not exist: %s" % cfg.workdir)
    runchecks.check_container(cfg)
    # with --docker the command runs inside the image: the host needs docker, not the command
    _check_executable("docker" if cfg.docker_image else cfg.command[0], cfg.workdir, {**os.environ, **cfg.env})
    from onbox.supervisor.phases import parse_phases

    for phase in parse_phases(cfg.phases):  # [[phase]] tables: checked here, not in a detached agent's log
        if phase.command and not cfg.docker_image:
            _check_executable(phase.command[0], cfg.workdir, {**os.environ, **cfg.env, **dict(phase.env)})
    from onbox.slurm.job import default_run_name

    # Inside a Slurm job the run is named after the job, so every requeue continues it (onbox/slurm/job.py).
    cfg.name = cfg.name or default_run_name(os.environ) or paths.default_run_name(cfg.command)
    runchecks.check_paths(cfg, paths.run_dir(cfg.name))
    group = runchecks.node_group(cfg)
    _check_runs_dir(paths.runs_dir())
    if saved is None and not resume_existing:
        _refuse_a_different_run_under_the_same_name(cfg, paths.run_dir(cfg.name))
    preflight(cfg)  # before anything is created or detached: the user sees the error, not a daemon's log
    for line in runchecks.warnings(cli.get("env") or {}, cfg):
        click.echo("onbox: warning: %s" % line, err=True)
    if not cfg.ckpt_dir:
        click.echo("onbox: warning: no --ckpt-dir: onbox commits and restores only what the trainer writes to "
                   "$ONBOX_CKPT_DIR (%s); point the trainer there, or give --ckpt-dir its output dir"
                   % os.path.join(paths.run_dir(cfg.name), paths.CHECKPOINTS_DIR), err=True)
    rd = RunDir(paths.run_dir(cfg.name))
    if group is not None:  # from stdin: stored only now that nothing refused the launch
        from onbox.multinode.role import save_group

        cfg.node_group = save_group(group, cfg.name)
    return cfg, rd


RECORDED = ("command", "ckpt_dir", "durable")  # what makes a run this run: another one needs another name


def _refuse_a_different_run_under_the_same_name(cfg: Any, run_dir: str) -> None:
    """A different command (or checkpoint dir, or durable target) under the name of an existing run would
    continue that run and be handed its checkpoint: refused (exit 2) unless --resume says it is meant."""
    from onbox import paths
    from onbox.fsutil import read_json

    path = os.path.join(run_dir, paths.CONFIG_FILE)
    try:
        saved = read_json(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise UsageError("cannot read the record of the existing run %s: %s" % (path, e),
                         hint="give the new run another --name, or move %s away" % run_dir)
    if not isinstance(saved, dict):
        raise UsageError("the record of the existing run %s is not a JSON object" % path,
                         hint="give the new run another --name, or move %s away" % run_dir)
    differ = [k for k in RECORDED if (saved.get(k) or None) != (getattr(cfg, k) or None)]
    if differ:
        was = "; ".join("%s was %s" % (k, _shown(saved.get(k))) for k in differ)
        raise UsageError("run %s already exists with another %s (%s)" % (cfg.name, " and ".join(differ), was),
                         hint="give this run a new --name, or pass --resume to continue %s (and its "
                              "checkpoints) with the new settings on purpose" % cfg.name)


def _shown(value: Any) -> str:
    if isinstance(value, list):
        import shlex

        return shlex.join(str(v) for v in value)
    return str(value) if value else "unset"


@click.command()
@click.argument("name")
@click.option("--foreground", is_flag=True, help="Stay in the foreground.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def adopt(name: str, foreground: bool, as_json: bool) -> int:
    """Re-adopt run NAME whose child outlived its agent (PID and start time must both match)."""
    from onbox import paths
    from onbox.config import RunConfig
    from onbox.fsutil import read_json
    from onbox.subsystems import preflight
    from onbox.supervisor.rundir import RunDir

    if not paths.valid_run_name(name):
        raise UsageError("invalid run name %r" % name, hint="`onbox ls` lists runs")
    problem = paths.home_problem()
    if problem:
        raise UsageError("ONBOX_HOME %s is unusable: %s" % (paths.onbox_home(), problem),
                         hint="point ONBOX_HOME at a directory (unset, it is ~/.onbox)")
    rd = RunDir(paths.run_dir(name))
    if not rd.exists():
        raise UsageError("no run named %s in %s" % (name, paths.runs_dir()), hint="`onbox ls` lists runs")
    try:
        cfg = RunConfig.from_dict(read_json(rd.config_path), paths.CONFIG_FILE).validate()
    except (OSError, ValueError) as e:
        raise UsageError("cannot read %s: %s" % (rd.config_path, e))
    except UsageError as e:
        raise UsageError("run %s's config.json: %s" % (name, e.message),
                         hint="fix %s, or relaunch with the option given on the command line (`onbox run --name "
                              "%s --OPTION VALUE` overrides the record)" % (rd.config_path, name))
    preflight(cfg)
    return _launch(cfg, rd, foreground, as_json, adopt_only=True)


def _launch(cfg: Any, rd: Any, foreground: bool, as_json: bool, adopt_only: bool) -> int:
    from onbox import fsutil, paths
    from onbox.proc import ProcessSeam
    from onbox.supervisor import detach, records

    runs_created = not os.path.isdir(os.path.dirname(rd.path))
    created = not os.path.isdir(rd.path)
    lock_existed = os.path.exists(rd.lock_path)

    def undo() -> None:  # a refused start leaves nothing behind
        if created:
            shutil.rmtree(rd.path, ignore_errors=True)
        elif not lock_existed and os.path.exists(rd.lock_path):
            os.unlink(rd.lock_path)
        if runs_created:
            try:
                os.rmdir(os.path.dirname(rd.path))
            except OSError:
                pass

    # A full (or read-only) ONBOX_HOME refuses a new run up front; a live child is adopted all the same: a
    # supervised child on a full disk (the agent holds its records in memory) beats an unsupervised one.
    space = fsutil.space_problem(paths.onbox_home())
    if space and detach.live_child(rd, ProcessSeam()) is None:
        raise records.home_problem_error(paths.onbox_home(), space, rd.name)
    try:
        if not os.path.isdir(os.path.dirname(rd.path)):
            fsutil.make_private_dir(os.path.dirname(rd.path))
        os.makedirs(rd.path, mode=fsutil.PRIVATE_DIR, exist_ok=True)
        lock = detach.lock_or_explain(rd)
    except UsageError:
        raise
    except OSError as e:
        undo()
        raise records.home_fault_error(paths.onbox_home(), e, rd.name) or UsageError(
            "cannot create the run directory %s: %s" % (rd.path, e.strerror or e),
            hint="set ONBOX_HOME to a writable directory")
    child = detach.live_child(rd, ProcessSeam())
    if adopt_only and child is None:
        lock.release()
        if not lock_existed:  # a refusal leaves nothing behind
            os.unlink(rd.lock_path)
        raise UsageError("run %s has no live child to adopt" % rd.name,
                         hint="start it again with `onbox run --name %s -- CMD`" % rd.name)
    rd.make_private()  # 0700 and 0600, also for a run an older agent left 0755/0644
    if child is not None and not adopt_only:
        cfg = _saved_config(rd, cfg)  # the live child runs the recorded configuration, not this command line
    if child is None:
        try:
            rd.write_config(cfg.to_dict())  # the exact re-launch record
            if os.path.exists(rd.stop_request):  # a stop meant for an earlier agent must not end this launch
                os.unlink(rd.stop_request)
        except OSError as e:  # the disk filled since the check above
            refusal = records.home_fault_error(paths.onbox_home(), e, rd.name)
            if refusal is None:
                raise
            lock.release()
            undo()
            raise refusal
    lock.write_owner(os.getpid())

    def agent(ready: Any) -> int:
        from onbox import subsystems
        from onbox.supervisor.loop import Supervisor, exit_code_for

        lock.write_owner(os.getpid())
        try:
            try:
                # builds the hooks; preflight() caught what it could in the foreground
                sup = Supervisor(cfg, rd, hooks_factory=subsystems.make_hooks, proc=_container_seam(cfg, rd))
            except OSError as oe:
                raise UnfitError("run %s cannot start: %s" % (rd.name, oe), hint="check the permissions of %s" % rd.path)
        except OnboxError as e:
            if created:  # a refused launch leaves nothing behind
                shutil.rmtree(rd.path, ignore_errors=True)
            ready({"ok": False, "run": rd.name, "error": e.message, "hint": e.hint, "exit": int(e.exit_code)})
            if foreground:
                raise
            return int(e.exit_code)
        sup.on_ready = lambda s: ready({"ok": s.state.value == "running", "run": rd.name, "run_dir": rd.path,
                                        "pid": s.child.pid if s.child else None, "agent_pid": os.getpid(),
                                        "state": s.state.value, "adopted": child is not None,
                                        "error": s.message if s.state.value != "running" else None})
        return exit_code_for(sup.run(adopt=child))

    if foreground:
        try:
            return agent(lambda info: _report(info, as_json) if info.get("adopted") else None)
        finally:
            lock.release()
    ok, info = detach.daemonize(agent, rd.file(paths.AGENT_LOG))
    lock.release()
    if not ok:
        click.echo("onbox: run %s failed to start: %s" % (rd.name, info.get("error")), err=True)
        if info.get("hint"):
            click.echo("hint: %s" % info["hint"], err=True)
        return int(info.get("exit") or 1)
    _report(info, as_json)
    return 0


def _container_seam(cfg: Any, rd: Any) -> Any:
    """The process seam of a container job (onbox/supervisor/container.py), None for any other run."""
    from onbox import paths
    from onbox.supervisor.container import seam_for

    def log(message: str) -> None:
        sys.stderr.write("onbox[%d]: %s\n" % (os.getpid(), message))

    return seam_for(cfg, rd, os.path.abspath(cfg.ckpt_dir or rd.file(paths.CHECKPOINTS_DIR)), os.environ, log)


def cli_layer(flags: Dict[str, Any]) -> Dict[str, Any]:
    """The command-line layer of the RunConfig from `onbox run`'s option values (only those given)."""
    from onbox import paths

    cli: Dict[str, Any] = {k: v for k, v in flags.items() if v is not None and v != ()}
    if "name" in cli and not paths.valid_run_name(cli["name"]):
        raise UsageError("invalid run name %r" % cli["name"],
                         hint="use letters, digits, '.', '_' and '-' (at most 128), starting with a letter or digit")
    if "env" in cli:
        cli["env"] = _parse_env(cli["env"])
    for key in ("resume_args", "env_files", "secrets", "metrics_regex", "docker_args"):
        if key in cli:
            cli[key] = list(cli[key])
    if "keep_best" in cli:
        cli.update(_parse_keep_best(cli.pop("keep_best")))
    return cli


def check_run_options(args: List[str]) -> None:
    """`onbox run` options given to another command (`onbox sbatch` passes them through): parsed and their
    values validated now, not on a node after the queue wait. Files they name are not read here."""
    from onbox.config import RunConfig

    ctx = run.make_context("onbox run", [*args, "--", "true"])
    flags = {k: v for k, v in ctx.params.items()
             if k not in ("command", "run_file", "foreground", "as_json", "resume_existing")}
    RunConfig.from_dict(cli_layer(flags), "the run options").validate()


def _relaunch_record(cli: Dict[str, Any], run_file: Optional[str]) -> Optional[Dict[str, Any]]:
    """The saved config.json of run --name when no command and no run file were given, else None."""
    from onbox import paths, untrusted
    from onbox.fsutil import read_json

    name = cli.get("name")
    if "command" in cli or run_file or not name or not paths.valid_run_name(name):
        return None
    path = os.path.join(paths.run_dir(name), paths.CONFIG_FILE)
    if not os.path.exists(path):  # not isfile: a record that is a FIFO or /dev/zero is refused, not "no record"
        return None
    try:
        saved = read_json(path)
    except (OSError, ValueError) as e:
        raise UsageError("cannot read the re-launch record %s: %s" % (path, untrusted.reason(e)))
    if not isinstance(saved, dict):
        raise UsageError("the re-launch record %s is not a JSON object" % path)
    return saved


def _saved_config(rd: Any, fallback: Any) -> Any:
    from onbox import paths
    from onbox.config import RunConfig
    from onbox.fsutil import read_json

    try:
        return RunConfig.from_dict(read_json(rd.config_path), paths.CONFIG_FILE).validate()
    except (OSError, ValueError, UsageError):
        return fallback


def _resolve_with_profile(cli: Dict[str, Any], run_file: Optional[str]) -> Any:
    """CLI > env > run file > profile > defaults. The profile's name itself may come from any layer above it,
    so resolve once to learn it, then again with its defaults (the one call site of Profile.run_defaults())."""
    from onbox import config
    from onbox.platform import profiles

    first = config.resolve(cli, run_file=run_file)
    profile, _why = profiles.select(first.profile)
    cfg = config.resolve(cli, run_file=run_file, profile_defaults=profile.run_defaults())
    cfg.profile = profile.name
    return cfg


def _report(info: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(info)
    else:
        click.echo("%s %s %s %s" % ("adopted" if info.get("adopted") else "started", info["run"], info["run_dir"],
                                    info.get("pid")))


def _parse_env(items: List[str]) -> Dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError("--env needs KEY=VAL, not %r" % item)
        out[key] = value
    return out


def _parse_keep_best(value: str) -> Dict[str, str]:
    """`--keep-best eval_loss:min` -> keep_best_metric and keep_best_mode (the mode is optional)."""
    metric, sep, mode = value.rpartition(":")
    if not sep:
        return {"keep_best_metric": value}
    if not metric or mode not in ("min", "max"):
        raise UsageError("--keep-best needs METRIC or METRIC:min or METRIC:max, not %r" % value)
    return {"keep_best_metric": metric, "keep_best_mode": mode}


def _check_executable(exe: str, workdir: str, env: Dict[str, str]) -> None:
    if os.sep in exe:
        path = exe if os.path.isabs(exe) else os.path.join(workdir, exe)
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise UsageError("cannot run %s: no such executable file (missing, or not chmod +x)" % exe,
                             hint="check the path (relative paths are from %s)" % workdir)
        return
    if shutil.which(exe, path=env.get("PATH", os.defpath)) is None:
        raise UsageError("cannot run %s: not found on PATH" % exe,
                         hint="give the full path, or fix PATH (the agent uses this shell's PATH)")


def _check_runs_dir(runs: str) -> None:
    """Refuse early (exit 2, nothing created) when the runs directory cannot be created or written."""
    from onbox.fsutil import is_writable_dir, nearest_existing

    probe = nearest_existing(runs)

    if not os.path.isdir(probe) or not is_writable_dir(probe):  # access(2) lies for root and read-only mounts
        raise UsageError("the runs directory %s is not writable (%s)" % (runs, probe),
                         hint="set ONBOX_HOME to a writable directory")
    if sys.platform != "linux":  # pragma: no cover
        raise UsageError("onbox runs jobs on Linux only")
