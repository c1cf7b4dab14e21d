"""One typed RunConfig. Precedence: CLI flags > ONBOX_* environment > run file (TOML) > profile > defaults.

The resolved config is saved in the run directory as config.json: the exact re-launch record.
"""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any, Dict, List, Mapping, Optional

from onbox.errors import UsageError
from onbox.paths import valid_run_name

RESTART_POLICIES = ("on-failure", "always", "never")
NOTICE_SOURCES = ("auto", "aws", "gcp", "azure", "none")
BEST_MODES = ("min", "max")
# U34: the agent's own secrets stay with the agent. Trainers print and log their environment (W&B/MLflow record
# it, crash dumps and `env` in a launch script show it): a token the child never sees cannot leak from there.
AGENT_ONLY_VARS = ("ONBOX_TRACKER_TOKEN",)


@dataclasses.dataclass
class RunConfig:
    """Everything a run needs. Field names are the run-file keys (dashes or underscores both accepted)."""

    name: str = ""
    command: List[str] = dataclasses.field(default_factory=list)
    profile: Optional[str] = None
    workdir: Optional[str] = None  # cwd of the child; default: where `onbox run` was called
    # checkpoints
    ckpt_dir: Optional[str] = None  # local fast disk the trainer writes to; default <run dir>/checkpoints
    durable: Optional[str] = None  # a mounted path, or an rclone remote "remote:path"
    sync_interval: float = 60.0  # seconds between looks for a new complete checkpoint to commit
    settle_seconds: float = 10.0  # a checkpoint untouched this long (and format-valid) is complete
    keep_last: int = 3
    keep_best_metric: Optional[str] = None
    keep_best_mode: str = "min"
    keep_every_steps: Optional[int] = None
    prune_local: bool = False  # delete committed local copies (never the newest) when the local disk runs low
    resume_args: List[str] = dataclasses.field(default_factory=list)  # appended when a checkpoint exists; {ckpt}
    # restarts
    restart: str = "on-failure"
    max_restarts: int = 5
    backoff_initial: float = 5.0
    backoff_max: float = 300.0
    crash_loop_threshold: int = 3  # the same failure class this many times in a row stops the run
    reap_orphans: bool = True  # kill leftovers of earlier attempts before the next one starts (U11)
    term_timeout: float = 10.0  # seconds between TERM and KILL when clearing an attempt's leftover processes
    tick_interval: float = 0.5  # seconds between the supervisor loop's housekeeping ticks (signals wake it at once)
    reap_wait: float = 60.0  # seconds the restart waits, at most, for reaped GPU memory to come back
    gpu_devices: str = "/dev/nvidia*"  # glob of the NVIDIA device files the holder scan looks for
    # preemption
    preempt_signal: str = "USR1"  # the scheduler's warning signal the agent listens for (NCCL catches USR1: allow USR2)
    checkpoint_signal: str = "TERM"  # what the agent forwards to the child's process group on a notice
    grace: Optional[float] = None  # seconds from notice to hard kill; default from the profile
    sync_reserve: float = 10.0  # seconds kept back from the grace window for the final commit
    final_sync_timeout: float = 300.0  # seconds the last commit may take when the job ends (done/failed for good)
    # an attempt that resumed from a checkpoint and failed within this many seconds, before getting past the
    # checkpoint's step, quarantines it: the next attempt falls back to the newest older one
    restore_probation: float = 900.0
    notice_source: str = "auto"  # cloud metadata notices: auto|aws|gcp|azure|none
    metadata_url: Optional[str] = None  # base URL override for the metadata service (tests, proxies)
    notice_interval: float = 5.0  # seconds between metadata-service polls (AWS recommends 5 s)
    requeue: Optional[bool] = None  # under Slurm: scontrol requeue on preemption (default: yes inside a job)
    # output and heartbeats
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    log_max_bytes: int = 64 * 1024 * 1024
    log_backups: int = 3
    tracker: Optional[str] = None
    tracker_token_file: Optional[str] = None
    heartbeat_interval: float = 30.0
    heartbeat_file: Optional[str] = None  # JSONL file sink (e.g. on the durable dir)
    ping_url: Optional[str] = None  # healthchecks.io-style ping URL
    metrics_regex: List[str] = dataclasses.field(default_factory=list)  # user regexes with named groups
    stall_minutes: float = 30.0

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> "RunConfig":
        return _apply(cls(), data, source)

    def validate(self) -> "RunConfig":
        """Check values; raise UsageError naming the key and the problem."""
        if self.name and not valid_run_name(self.name):
            raise UsageError("invalid run name %r" % self.name,
                             hint="use letters, digits, '.', '_' and '-' (at most 128), starting with a letter or digit")
        if self.restart not in RESTART_POLICIES:
            raise UsageError("restart must be one of %s, not %r" % ("|".join(RESTART_POLICIES), self.restart))
        if self.notice_source not in NOTICE_SOURCES:
            raise UsageError("notice_source must be one of %s, not %r" % ("|".join(NOTICE_SOURCES), self.notice_source))
        if self.keep_best_mode not in BEST_MODES:
            raise UsageError("keep_best_mode must be min or max, not %r" % self.keep_best_mode)
        for key in ("preempt_signal", "checkpoint_signal"):
            parse_signal(getattr(self, key), key)
        for key in ("max_restarts", "keep_last", "crash_loop_threshold", "log_backups"):
            if getattr(self, key) < 0:
                raise UsageError("%s must be >= 0, not %r" % (key, getattr(self, key)))
        for key in ("sync_interval", "settle_seconds", "backoff_initial", "backoff_max", "sync_reserve",
                    "heartbeat_interval", "stall_minutes", "term_timeout", "tick_interval",
                    "notice_interval", "reap_wait", "final_sync_timeout", "restore_probation"):
            if getattr(self, key) < 0:
                raise UsageError("%s must be >= 0 seconds, not %r" % (key, getattr(self, key)))
        for key in self.env:
            if key in AGENT_ONLY_VARS:  # U34: it would be recorded in config.json and handed to the child
                raise UsageError("env: %s is the agent's secret, not the job's" % key,
                                 hint="put the token in a file (--tracker-token-file) or export it in the "
                                      "agent's environment; it is never written down or given to the child")
        if self.keep_every_steps is not None and self.keep_every_steps <= 0:
            raise UsageError("keep_every_steps must be a positive number of steps, not %r" % self.keep_every_steps)
        if self.grace is not None and self.grace < 0:
            raise UsageError("grace must be >= 0 seconds, not %r" % self.grace)
        for key in ("tracker", "ping_url"):
            url = getattr(self, key)
            if url and not url.startswith(("http://", "https://")):
                raise UsageError("%s must be an http(s) URL, not %r" % (key, url),
                                 hint="e.g. http://10.0.0.5:8787 (the token goes in a file or ONBOX_TRACKER_TOKEN)")
        if self.metrics_regex:
            from onbox.telemetry.metrics import MetricsParser

            MetricsParser(self.metrics_regex)  # raises UsageError naming the bad regex
        return self


def parse_signal(value: Any, key: str = "signal") -> signal.Signals:
    """'USR1', 'SIGUSR1', '10' -> signal.SIGUSR1; anything else is a UsageError."""
    text = str(value).strip().upper()
    if text.isdigit():
        try:
            return signal.Signals(int(text))
        except ValueError:
            pass
    else:
        name = text if text.startswith("SIG") else "SIG" + text
        if hasattr(signal.Signals, name):
            return signal.Signals[name]
    raise UsageError("%s: unknown signal %r" % (key, value), hint="use a name like USR1, USR2, TERM or INT")


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def _coerce(key: str, value: Any, source: str) -> Any:
    default = _FIELDS[key].default
    factory = _FIELDS[key].default_factory  # type: ignore[misc]
    kind = type(factory()) if factory is not dataclasses.MISSING else type(default)
    ann = str(_FIELDS[key].type)
    try:
        if value is None:
            return None
        if "bool" in ann:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if "float" in ann:
            return float(value)
        if "int" in ann:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("expected a whole number")
            return int(value)
        if kind is list:
            if isinstance(value, str):
                import shlex
                return shlex.split(value)
            if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
                raise ValueError("expected a list of strings")
            return [str(v) for v in value]
        if kind is dict:
            if not isinstance(value, dict):
                raise ValueError("expected a table of KEY = \"value\"")
            return {str(k): str(v) for k, v in value.items()}
        if not isinstance(value, (str, int, float)):
            raise ValueError("expected a string")
        return str(value)
    except (TypeError, ValueError) as e:
        raise UsageError("%s: bad value for %s: %r (%s)" % (source, key, value, e))


def _apply(cfg: RunConfig, data: Mapping[str, Any], source: str) -> RunConfig:
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key not in _FIELDS:
            close = [k for k in _FIELDS if k.startswith(key[:4])][:3]
            raise UsageError("%s: unknown key %r" % (source, raw_key),
                             hint=("did you mean %s?" % ", ".join(close)) if close else "see `onbox run --help`")
        if value is None:
            continue
        setattr(cfg, key, _coerce(key, value, source))
    return cfg


def env_overrides(environ: Mapping[str, str]) -> Dict[str, Any]:
    """ONBOX_<FIELD> variables, e.g. ONBOX_DURABLE, ONBOX_TRACKER, ONBOX_HEARTBEAT_INTERVAL.

    The child-side contract variables (ONBOX_RUN, ONBOX_CKPT_DIR, ONBOX_RESUME_FROM, ...) are outputs, not inputs,
    and are ignored here so a nested onbox does not inherit its parent's run.
    """
    skip = {"name", "command", "ckpt_dir", "env"}
    out = {}
    for key in _FIELDS:
        if key in skip:
            continue
        var = "ONBOX_" + key.upper()
        if var in environ and environ[var] != "":
            out[key] = environ[var]
    return out


def resolve(cli: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None,
            run_file: Optional[str] = None, profile_defaults: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """Merge the layers (lowest first) into a validated RunConfig. `cli` holds only flags the user gave."""
    from onbox.tomlread import load_toml

    environ = os.environ if environ is None else environ
    cfg = RunConfig()
    if profile_defaults:
        _apply(cfg, profile_defaults, "profile")
    if run_file:
        data = load_toml(run_file, "run file")
        run_table = data.get("run", data)
        if not isinstance(run_table, dict):
            raise UsageError("run file %s: [run] must be a table" % run_file)
        _apply(cfg, run_table, "run file %s" % run_file)
    _apply(cfg, env_overrides(environ), "environment")
    _apply(cfg, {k: v for k, v in cli.items() if v is not None and v != () and v != []}, "command line")
    return cfg.validate()
