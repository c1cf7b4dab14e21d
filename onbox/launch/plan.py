"""prepare(): the run `onbox run` (or `onbox queue add`) would start, its configuration resolved from the layers
and checked; prepare_adopt(): the run `onbox adopt` takes over. Both refuse in the foreground (exit 2, 3) and
create nothing; the one exception is a node group read from stdin, stored once nothing refused the launch."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Mapping, Optional

from onbox import paths, untrusted
from onbox.config import RunConfig, is_remote
from onbox.errors import UsageError
from onbox.launch import checks
from onbox.supervisor.rundir import RunDir


@dataclasses.dataclass
class LaunchPlan:
    """A run resolved and checked, ready for start()."""

    cfg: RunConfig
    rd: RunDir
    warnings: List[str] = dataclasses.field(default_factory=list)  # one line each, to say before it starts
    adopt_only: bool = False  # `onbox adopt`: take over the live child, never start one
    # --take-over: this launch supersedes a live lease another agent holds on the durable storage (that box was
    # declared lost); for this launch only, never recorded (a relaunch must not inherit it)
    take_over: bool = False


def prepare(values: Mapping[str, Any], command: List[str], run_file: Optional[str] = None,
            resume_existing: bool = False, environ: Optional[Mapping[str, str]] = None,
            take_over: bool = False) -> LaunchPlan:
    """The run of `command` that `onbox run` would start with its option `values` (None or () where not given):
    CLI > ONBOX_* > run file > profile > defaults, or `--name X` alone: X's re-launch record below the flags.
    `resume_existing` (--resume): a different command under an existing run's name is meant. `take_over`
    (--take-over): supersede another agent's live lease on the durable storage."""
    from onbox.launch.deadline import resolve as resolve_deadline
    from onbox.slurm.job import default_run_name
    from onbox.subsystems import preflight
    from onbox.supervisor.phases import parse_phases

    environ = os.environ if environ is None else environ
    cli = cli_layer(values)
    if command:
        cli["command"] = list(command)
    saved = _relaunch_record(cli, run_file)
    if saved is not None:  # `onbox run --name X` alone: X again, exactly as recorded (flags still override)
        cfg = _resolve_relaunch(cli, saved, RunDir(paths.run_dir(cli["name"])), environ)
    else:
        cfg = _resolve_with_profile(cli, run_file, environ)
    workdir = _settle(cfg)
    checks.check_child_secrets(cfg)  # every --env-file and --secret readable now, values not kept
    if not os.path.isdir(workdir):
        raise UsageError("working directory does not exist: %s" % workdir)
    checks.check_container(cfg)
    # with --docker the command runs inside the image: the host needs docker, not the command
    checks.check_executable("docker" if cfg.docker_image else cfg.command[0], workdir, {**environ, **cfg.env})
    for phase in parse_phases(cfg.phases):  # [[phase]] tables: checked here, not in a detached agent's log
        if phase.command and not cfg.docker_image:
            checks.check_executable(phase.command[0], workdir, {**environ, **cfg.env, **dict(phase.env)})
    # Inside a Slurm job the run is named after the job, so every requeue continues it (onbox/slurm/job.py).
    cfg.name = cfg.name or default_run_name(environ) or paths.default_run_name(cfg.command)
    rd = RunDir(paths.run_dir(cfg.name))
    checks.check_paths(cfg, rd.path)
    group = checks.node_group(cfg)
    checks.check_runs_dir(paths.runs_dir())
    if saved is None and not resume_existing:
        checks.check_same_run(cfg, rd)
    if take_over and not cfg.durable:
        raise UsageError("--take-over supersedes the lease another agent holds on the run's durable storage, and "
                         "run %s has no --durable" % cfg.name,
                         hint="give the run's --durable (leases live there), or drop --take-over")
    # before anything is created or detached: the user sees the error, not a daemon's log
    preflight(cfg, dict(environ))
    # the deadline this launch's (a relaunch resolves its own): --deadline, Slurm's EndTime, the profile's session;
    # not for a run whose child still runs: start() adopts it with its recorded deadline
    deadline_warnings = [] if _child_alive(rd) else resolve_deadline(cfg, environ, rd.path)
    warnings = checks.warnings(cli.get("env") or {}, cfg) + deadline_warnings
    if group is not None:  # from stdin: stored only now that nothing refused the launch
        from onbox.multinode.role import save_group

        cfg.node_group = save_group(group, cfg.name)
    return LaunchPlan(cfg, rd, warnings, take_over=take_over)


def _child_alive(rd: RunDir) -> bool:
    """The run's recorded child still runs (start() then adopts it, with the configuration it recorded)."""
    from onbox.proc import ProcessSeam
    from onbox.supervisor.detach import live_child

    try:
        return live_child(rd, ProcessSeam()) is not None
    except (OSError, ValueError):
        return False


def resolve(values: Mapping[str, Any], command: List[str], run_file: Optional[str] = None,
            environ: Optional[Mapping[str, str]] = None) -> RunConfig:
    """The configuration `onbox run` would give a new run of `command` with its option `values` (the layers, as
    prepare() resolves them; the working directory and every path made absolute), without a name of its own
    unless --name gave one. Checks nothing else and creates nothing: `onbox match` compares it with the runs
    already on this box."""
    environ = os.environ if environ is None else environ
    cli = cli_layer(values)
    if command:
        cli["command"] = list(command)
    cfg = _resolve_with_profile(cli, run_file, environ)
    _settle(cfg)
    return cfg


def _settle(cfg: RunConfig) -> str:
    """A command there is, the working directory (this one by default; returned) and every path absolute: what a
    run records in config.json, and what a relaunch of the same command is compared by."""
    if not cfg.command:
        raise UsageError("no command to run", hint="onbox run [OPTIONS] -- CMD [ARGS...]")
    workdir = cfg.workdir = os.path.abspath(cfg.workdir or os.getcwd())
    _make_paths_absolute(cfg)
    return workdir


def prepare_adopt(name: str) -> LaunchPlan:
    """Run NAME as `onbox adopt` takes it over: its recorded configuration, checked again."""
    from onbox.subsystems import preflight

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
        cfg = rd.run_config()
    except (OSError, ValueError, TypeError) as e:
        raise UsageError("cannot read %s: %s" % (rd.config_path, e))
    except UsageError as e:
        raise UsageError("run %s's config.json: %s" % (name, e.message),
                         hint="fix %s, or relaunch with the option given on the command line (`onbox run --name "
                              "%s --OPTION VALUE` overrides the record)" % (rd.config_path, name))
    preflight(cfg)
    return LaunchPlan(cfg, rd, adopt_only=True)


def cli_layer(values: Mapping[str, Any]) -> Dict[str, Any]:
    """The command-line layer of the RunConfig from `onbox run`'s option values (only those given)."""
    cli: Dict[str, Any] = {k: v for k, v in values.items() if v is not None and v != ()}
    if "name" in cli and not paths.valid_run_name(cli["name"]):
        raise UsageError("invalid run name %r" % cli["name"],
                         hint="use letters, digits, '.', '_' and '-' (at most 128), starting with a letter or digit")
    if "env" in cli:
        cli["env"] = _parse_env(cli["env"])
    for key in ("resume_args", "env_files", "secrets", "metrics_regex", "docker_args", "ckpt_pattern", "ckpt_ignore"):
        if key in cli:
            cli[key] = list(cli[key])
    if "keep_best" in cli:
        cli.update(_parse_keep_best(cli.pop("keep_best")))
    return cli


def _make_paths_absolute(cfg: RunConfig) -> None:
    """The detached agent runs from "/": relative paths must mean what they meant where `onbox run` was typed (`~`
    was expanded where the configuration was read)."""
    for key in ("ckpt_dir", "tracker_token_file", "heartbeat_file", "mlflow_token_file"):
        if getattr(cfg, key):
            setattr(cfg, key, os.path.abspath(getattr(cfg, key)))
    if cfg.durable and not is_remote(cfg.durable):
        cfg.durable = os.path.abspath(cfg.durable)
    cfg.env_files = [os.path.abspath(p) for p in cfg.env_files]


def _relaunch_record(cli: Dict[str, Any], run_file: Optional[str]) -> Optional[Dict[str, Any]]:
    """The saved config.json of run --name when no command and no run file were given, else None."""
    name = cli.get("name")
    if "command" in cli or run_file or not name or not paths.valid_run_name(name):
        return None
    rd = RunDir(paths.run_dir(name))
    if not os.path.exists(rd.config_path):  # not isfile: a FIFO or /dev/zero is refused, not "no record"
        return None
    try:
        return rd.load_config()
    except TypeError:
        raise UsageError("the re-launch record %s is not a JSON object" % rd.config_path)
    except (OSError, ValueError) as e:
        raise UsageError("cannot read the re-launch record %s: %s" % (rd.config_path, untrusted.reason(e)))


def _resolve_relaunch(cli: Dict[str, Any], saved: Dict[str, Any], rd: RunDir,
                      environ: Mapping[str, str]) -> RunConfig:
    """`onbox run --name X` alone: X's config.json below the flags. A value the record holds that is no longer
    accepted (an older onbox took `--preempt-signal KILL`) is refused naming the record and the way out."""
    from onbox import config

    path = rd.config_path
    try:
        return config.resolve(cli, environ, profile_defaults=saved, defaults_source="the re-launch record %s" % path)
    except UsageError as e:
        raise UsageError(e.message, hint="%sthe re-launch record %s may hold it: the same option on the command line "
                                         "overrides the record" % ((e.hint + "; ") if e.hint else "", path))


def _resolve_with_profile(cli: Dict[str, Any], run_file: Optional[str], environ: Mapping[str, str]) -> RunConfig:
    """CLI > env > run file > profile > defaults. The profile's name itself may come from any layer above it,
    so resolve once to learn it, then again with its defaults (the one call site of Profile.run_defaults())."""
    from onbox import config
    from onbox.platform import profiles

    first = config.resolve(cli, environ, run_file=run_file)
    profile, _why = profiles.select(first.profile, environ=environ)
    cfg = config.resolve(cli, environ, run_file=run_file, profile_defaults=profile.run_defaults())
    cfg.profile = profile.name
    return cfg


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
