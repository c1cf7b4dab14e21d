"""One typed RunConfig. Precedence: CLI flags > ONBOX_* environment > run file (TOML) > profile > defaults.

The resolved config is saved in the run directory as config.json: the exact re-launch record.

Past 400 lines on purpose: every knob's type, range and coercion sits beside the one table of fields, so a flag,
an ONBOX_* variable, a run file, a profile and a saved config.json are checked by the same lines and say the same
message; split by layer, the same knob would be checked in two places and drift.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
from typing import Any, Dict, List, Mapping, Optional, Tuple

from onbox.errors import UsageError
from onbox.paths import valid_run_name, valid_secret_name

RESTART_POLICIES = ("on-failure", "always", "never")
ON_HANG = ("alert", "restart", "stop")
NOTICE_SOURCES = ("auto", "aws", "gcp", "azure", "none")
BEST_MODES = ("min", "max")
# U34: the agent's own secrets stay with the agent. Trainers print and log their environment (W&B/MLflow record
# it, crash dumps and `env` in a launch script show it): a token the child never sees cannot leak from there.
AGENT_ONLY_VARS = ("ONBOX_TRACKER_TOKEN",)
# U34: with --mlflow on, the MLflow credentials in the agent's environment are the agent's too: the child does not
# inherit them (a trainer that logs to MLflow itself gets its own with --secret).
MLFLOW_CREDENTIAL_VARS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # POSIX portable names: what a shell can export and read
# The child's contract: the variables onbox/supervisor/childenv.py sets for every attempt (onbox/supervisor/README.md, `onbox run`).
# They are onbox's answers to the trainer, never the user's to set. U32: one setting quietly overriding the right
# value is how runs go wrong unseen; `--env ONBOX_CKPT_DIR=/elsewhere` used to win that way, the trainer saved
# where onbox never looks and nothing was ever committed. So they are refused, each with what to give instead.
CONTRACT_VARS: Dict[str, str] = {
    "ONBOX_RUN": "give --name instead",
    "ONBOX_CKPT_DIR": "give --ckpt-dir instead",
    "ONBOX_RESUME_FROM": "it is the newest verified checkpoint (restored from --durable when the local dir lacks "
                         "it); --resume-arg hands it to the trainer's own flag",
    "ONBOX_RESTART_COUNT": "it counts the attempts",
    "ONBOX_METRICS_FILE": "it names the file onbox reads (in the run dir); for output lines the built-in formats "
                          "miss, give --metrics-regex",
    "ONBOX_PREEMPT_FILE": "it names the file onbox creates when a preemption is under way",
}
# Set for the job too, but not part of its contract: the attempt's marker (onbox/supervisor/leftovers.py)
MARKER_VARS: Dict[str, str] = {
    "ONBOX_ATTEMPT_ID": "it marks the attempt's processes, so that onbox finds and stops what they leave behind",
}
# ONBOX_PHASE, ONBOX_PHASE_INDEX, ONBOX_PHASE_LR, ...: set for each [[phase]] of a curriculum (onbox/supervisor/phases.py)
PHASE_VAR = "ONBOX_PHASE"

MINUTE, HOUR, DAY, WEEK = 60.0, 3600.0, 86400.0, 7 * 86400.0
LEASE_TTL_FLOOR = 60.0  # seconds: lease_ttl defaults to max(this, 3 x sync_interval)
# Every number a run takes, finite and inside these bounds (inclusive); onbox/supervisor/README.md says the same.
# A value beyond them is a typo or a unit mix-up (ms for s), never a setting: `inf` made every heartbeat
# unsendable, `nan` made `onbox stop` give up at once and skip the final commit.
RANGES: Dict[str, Tuple[float, float, str]] = {
    "sync_interval": (0.0, WEEK, "seconds"),
    "lease_ttl": (1.0, WEEK, "seconds"),  # unset: max(60 s, 3 x sync_interval) (RunConfig.effective_lease_ttl)
    "settle_seconds": (0.0, DAY, "seconds"),
    "backoff_initial": (0.0, DAY, "seconds"),
    "backoff_max": (0.0, WEEK, "seconds"),
    "term_timeout": (0.0, HOUR, "seconds"),
    "tick_interval": (0.001, MINUTE, "seconds"),  # 0 would spin the loop
    "reap_wait": (0.0, HOUR, "seconds"),
    "grace": (0.0, DAY, "seconds"),
    "deadline_margin": (0.0, DAY, "seconds"),
    "sync_reserve": (0.0, DAY, "seconds"),
    "final_sync_timeout": (0.0, DAY, "seconds"),
    "restore_probation": (0.0, WEEK, "seconds"),  # 0: never quarantine a checkpoint an attempt crashed on
    "notice_interval": (0.01, HOUR, "seconds"),  # 0 would hammer the metadata service
    "heartbeat_interval": (0.01, DAY, "seconds"),
    "stall_minutes": (0.01, 7 * 24 * 60.0, "minutes"),  # 0 would call every run stalled
    "hang_after": (0.0, WEEK, "seconds"),  # 0: never judged hung
    "hang_factor": (1.0, 1000.0, "x the typical step interval"),
    "hang_floor": (0.0, DAY, "seconds"),
    "hang_startup": (0.01, WEEK, "seconds"),
    "metrics_hint_minutes": (0.0, 7 * 24 * 60.0, "minutes"),  # 0: never hint
    "max_restarts": (0, 100000, "restarts"),
    "keep_last": (0, 100000, "checkpoints"),
    "keep_every_steps": (1, 10 ** 12, "steps"),
    "crash_loop_threshold": (0, 1000, "attempts"),
    "log_max_bytes": (0, 2 ** 40, "bytes"),  # 0: never rotate
    "log_backups": (0, 1000, "files"),
    "log_tail_lines": (0, 200, "lines"),  # 0: the job's output stays on the box
    # one scan of the checkpoint dir (onbox/checkpoints/local/detect.py): a dir past these is no checkpoint dir
    "scan_max_entries": (1, 10 ** 8, "entries"),
    "scan_max_depth": (1, 1000, "levels"),
    "scan_max_seconds": (0.001, HOUR, "seconds"),
}
# The `onbox run` flag of each field that has one (messages name what the user typed).
FLAGS = {k: "--" + k.replace("_", "-") for k in (
    "name", "profile", "ckpt_dir", "durable", "sync_interval", "lease_ttl", "settle_seconds", "keep_last", "prune_local",
    "final_sync_timeout", "restore_probation", "restart", "max_restarts", "checkpoint_signal", "preempt_signal", "grace", "env",
    "workdir", "notice_source", "metadata_url", "requeue", "deadline", "tracker", "tracker_token_file", "heartbeat_interval",
    "heartbeat_file", "ping_url", "metrics_regex", "mlflow", "mlflow_experiment", "mlflow_token_file")}
FLAGS.update(hang_after="--hang-after", on_hang="--on-hang")
FLAGS.update(ckpt_pattern="--ckpt-pattern", ckpt_ignore="--ckpt-ignore")
FLAGS.update(keep_best_metric="--keep-best", keep_every_steps="--keep-every", resume_args="--resume-arg",
             env_files="--env-file", secrets="--secret", node_group="--node-group", docker_image="--docker",
             docker_args="--docker-arg", docker_shm_size="--shm-size")
# Fields that name a local path (durable only when it is not an rclone remote): `~` is expanded wherever they come
# from (a flag, an ONBOX_* variable, a run file, a profile), and their length is checked (ENAMETOOLONG).
PATH_FIELDS = ("ckpt_dir", "durable", "workdir", "tracker_token_file", "heartbeat_file", "mlflow_token_file",
               "node_group")
PATH_LIST_FIELDS = ("env_files",)
SHM_SIZE_RE = re.compile(r"^[0-9]{1,12}[bkmgBKMG]?$")  # what `docker run --shm-size` takes
UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


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
    # seconds the run's lease on durable storage stays live after a renewal (renewed every third of it; another
    # launch is refused while it is live). None: max(60 s, 3 x sync_interval). onbox/checkpoints/leases/fencing.py
    lease_ttl: Optional[float] = None
    settle_seconds: float = 10.0  # a checkpoint untouched this long (and format-valid) is complete
    # top-level names of ckpt_dir that are checkpoints (globs; empty: any name) and that never are (logs, events,
    # samples the trainer also writes there): onbox/checkpoints/local/detect.py
    ckpt_pattern: List[str] = dataclasses.field(default_factory=list)
    ckpt_ignore: List[str] = dataclasses.field(default_factory=list)
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
    # the session's end (onbox/supervisor/deadline.py): --deadline WHEN (an absolute time, UTC or with an offset, or a
    # duration from the launch: 11h40m), `slurm` (the job's EndTime, refused when unreadable), `none` (no deadline,
    # none looked for), or unset: the platform's (Slurm's
    # EndTime, a Kaggle session, a profile's session hours). The launch resolves it into deadline_at (wall-clock
    # epoch seconds) and deadline_source, recorded in config.json: an adopting agent keeps them, a relaunch
    # resolves its own.
    deadline: Optional[str] = None
    deadline_at: Optional[float] = None
    deadline_source: Optional[str] = None
    deadline_margin: float = 60.0  # seconds kept between the end of the final commit and the deadline
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
    mlflow: Optional[str] = None  # MLflow tracking server URL: one MLflow run per onbox run (onbox/heartbeat/mlflow.py)
    mlflow_experiment: str = "onbox"  # created when missing
    mlflow_token_file: Optional[str] = None  # bearer token file; else MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN
    metrics_hint_minutes: float = 10.0  # output for this long and no metric recognised: say so once (0: never)
    log_tail_lines: int = 20  # the last lines of output sent with each beat, secrets redacted (0: none)
    stall_minutes: float = 30.0
    # a hung trainer (onbox/telemetry/cadence.py, onbox/supervisor/hang.py): no new step, no output and no checkpoint
    # write for max(hang_factor x its typical step interval, hang_floor) seconds (hang_startup before an attempt's
    # first step); then its stacks are saved and --on-hang acts
    hang_after: Optional[float] = None  # --hang-after DUR: a fixed bound instead of the learned one; 0 (`off`): never
    on_hang: str = "restart"  # --on-hang alert|restart|stop (restart: bounded by the restart policy)
    hang_factor: float = 10.0
    hang_floor: float = 120.0
    hang_startup: float = 1200.0
    # how much of the checkpoint dir one scan may read: a dir past these bounds is implausibly large for checkpoints
    # (a wrong --ckpt-dir); the scan stops there and the run says so (onbox/checkpoints/local/detect.py)
    scan_max_entries: int = 500000
    scan_max_depth: int = 32
    scan_max_seconds: float = 5.0
    # secrets for the child, recorded by reference only: the values are read when each attempt starts, never saved
    env_files: List[str] = dataclasses.field(default_factory=list)  # KEY=VAL files (--env-file)
    secrets: List[str] = dataclasses.field(default_factory=list)  # NAME or VAR=NAME in $ONBOX_HOME/secrets (--secret)
    # a multi-phase curriculum: the run file's [[phase]] tables as given (no flag); checked by
    # onbox.supervisor.phases.parse_phases when `onbox run`/`onbox queue add` resolve a run and when the agent starts
    phases: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    # multi-node over SSH: the node-group file onboxctl wrote (rank, peers, rendezvous; its key stays in the file)
    node_group: Optional[str] = None
    # containers (onbox/launch/container.py): the image the command runs in, extra `docker run` options, /dev/shm
    docker_image: Optional[str] = None
    docker_args: List[str] = dataclasses.field(default_factory=list)
    docker_shm_size: str = "16g"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def effective_lease_ttl(self) -> float:
        """lease_ttl, or its default: max(60 s, 3 sync intervals) -- a holder renews at a third of it, and a
        fenced one is stopped within a sync interval."""
        if self.lease_ttl is not None:
            return float(self.lease_ttl)
        return max(LEASE_TTL_FLOOR, 3.0 * self.sync_interval)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> "RunConfig":
        return _apply(cls(), data, source)

    def validate(self) -> "RunConfig":
        """Check every value (the one place: flags, ONBOX_* variables, run files, profiles and config.json all
        come through here); raise UsageError naming the option and the problem."""
        if self.name and not valid_run_name(self.name):
            raise UsageError("invalid run name %r" % self.name,
                             hint="use letters, digits, '.', '_' and '-' (at most 128), starting with a letter or digit")
        for key, choices in (("restart", RESTART_POLICIES), ("notice_source", NOTICE_SOURCES), ("on_hang", ON_HANG),
                             ("keep_best_mode", BEST_MODES)):
            if getattr(self, key) not in choices:
                raise UsageError("%s must be one of %s, not %r" % (label(key), "|".join(choices), getattr(self, key)))
        parse_catchable_signal(self.preempt_signal, "preempt_signal", also_refused=(signal.SIGCHLD,))
        parse_catchable_signal(self.checkpoint_signal, "checkpoint_signal")
        for key in RANGES:
            check_range(key, getattr(self, key))
        if self.deadline is not None and self.deadline.strip().lower() != DEADLINE_SLURM:
            parse_deadline(self.deadline, 0.0)  # its syntax now (`onbox queue add`, `onbox sbatch` too)
        if self.deadline_at is not None and not (math.isfinite(self.deadline_at) and self.deadline_at > 0):
            raise UsageError("deadline_at must be a time (seconds since the epoch), not %r" % (self.deadline_at,),
                             hint="it is the launch's to set: give --deadline instead")
        if self.keep_best_metric is not None and not self.keep_best_metric.strip():
            raise UsageError("--keep-best needs a metric name, e.g. --keep-best eval_loss:min")
        self._check_strings()
        self._check_paths()
        for key in ("tracker", "ping_url", "metadata_url", "mlflow"):
            url = getattr(self, key)
            problem = url is not None and url_problem(url)
            if problem:
                raise UsageError("%s %r: %s" % (label(key), url, problem), hint=URL_HINTS.get(
                    key, "a full http(s) URL with a host, e.g. http://127.0.0.1:8080"))
        if self.mlflow and "@" in self.mlflow.split("//", 1)[-1].split("/", 1)[0]:
            # U34: config.json records the URL, `ps` shows the flag: a password in it would be written down
            raise UsageError("--mlflow: the URL carries credentials (user@ or user:password@)",
                             hint="give the URL without them; the agent reads MLFLOW_TRACKING_USERNAME/PASSWORD, "
                                  "MLFLOW_TRACKING_TOKEN or --mlflow-token-file from its own environment")
        check_mlflow_experiment(self.mlflow_experiment)
        if self.metrics_regex:
            from onbox.telemetry.metrics import MetricsParser

            MetricsParser(self.metrics_regex)  # raises UsageError naming the bad regex
        for spec in self.secrets:
            parse_secret_spec(spec)
        return self

    def _check_strings(self) -> None:
        """Environment names and values, argv words: what execve(2) can carry (no NUL), no agent secret."""
        for key, value in self.env.items():
            check_env_entry(key, value, "--env")
        for key in ("command", "resume_args"):
            for word in getattr(self, key):
                if "\0" in word:
                    raise UsageError("%s: %r holds a NUL byte, which no argument can carry" % (label(key), word))
        for path in self.env_files:
            if not path.strip():
                raise UsageError("--env-file needs a path")
        for key in ("ckpt_pattern", "ckpt_ignore"):
            for glob in getattr(self, key):
                if not glob.strip() or "/" in glob or "\0" in glob:
                    raise UsageError("%s %r is not a glob of a name in the checkpoint dir" % (label(key), glob),
                                     hint="e.g. %s '*.json' (a name at the top of --ckpt-dir, no /)" % label(key))
        image = self.docker_image
        if image is not None and (not image or image.startswith("-") or any(c.isspace() or ord(c) < 32 for c in image)):
            raise UsageError("--docker %r is not an image name" % image, hint="e.g. --docker pytorch/pytorch@sha256:...")
        if not SHM_SIZE_RE.fullmatch(self.docker_shm_size or ""):
            raise UsageError("--shm-size must be a size like 16g or 512m, not %r" % self.docker_shm_size)
        if any("\0" in a for a in self.docker_args):
            raise UsageError("--docker-arg: an argument holds a NUL byte, which no argument can carry")

    def _check_paths(self) -> None:
        """Every path option fits the system's limits (a 300-byte name crashed the agent with ENAMETOOLONG after
        launch; a 4,282-byte --durable failed every commit) and has no `~` left that could not be expanded."""
        named = [(key, getattr(self, key)) for key in PATH_FIELDS if getattr(self, key)]
        named += [(key, p) for key in PATH_LIST_FIELDS for p in getattr(self, key)]
        for key, value in named:
            check_path(key, value)


URL_HINTS = {"tracker": "e.g. http://10.0.0.5:8787 (the token goes in a file or ONBOX_TRACKER_TOKEN)",
             "mlflow": "the tracking server's base URL, e.g. http://10.0.0.5:5000 (the token goes in "
                       "--mlflow-token-file or MLFLOW_TRACKING_TOKEN, never in the URL)"}


def check_mlflow_experiment(name: Any) -> None:
    """An MLflow experiment name: some text, one line, no NUL (MLflow takes any other string)."""
    if not isinstance(name, str) or not name.strip() or len(name) > 500 or any(c in name for c in "\0\n\r"):
        raise UsageError("--mlflow-experiment must be a one-line name of 1 to 500 characters, not %r" % (name,),
                         hint="e.g. --mlflow-experiment nanogpt-sweeps (created when missing)")


def agent_only_vars(cfg: "RunConfig") -> Tuple[str, ...]:
    """The agent's secrets a child never inherits for this run (U34): the tracker token, and the MLflow
    credentials when the run sends to MLflow."""
    return AGENT_ONLY_VARS + (MLFLOW_CREDENTIAL_VARS if cfg.mlflow else ())


def label(key: str) -> str:
    """How messages name a field: its flag (with the field where the two differ), else the run-file key."""
    flag = FLAGS.get(key)
    if flag is None:
        return key
    return flag if flag == "--" + key.replace("_", "-") else "%s (%s)" % (flag, key)


def check_range(key: str, value: Any) -> None:
    """A finite number inside RANGES[key] (None passes: unset); else a UsageError naming how it is set."""
    if value is None:
        return
    low, high, unit = RANGES[key]
    if isinstance(value, float) and math.isfinite(value) and low <= value <= high:
        return
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return
    whole = isinstance(low, int)
    flag = FLAGS.get(key)
    raise UsageError("%s must be %s from %s to %s %s, not %r" % (
        label(key), "a whole number" if whole else "a number", _fmt(low), _fmt(high), unit, value),
        hint="set by %sONBOX_%s, the run file's `%s` or the profile" % (
            (flag + ", ") if flag else "", key.upper(), key))


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def check_env_entry(key: str, value: str, where: str) -> None:
    """A variable the child may get: a portable name, no NUL, not the agent's own secret (U34)."""
    if not ENV_NAME_RE.fullmatch(key):
        raise UsageError("%s: %r is not a valid environment variable name" % (where, key),
                         hint="letters, digits and '_', not starting with a digit")
    if "\0" in value:
        raise UsageError("%s: the value of %s holds a NUL byte, which no environment variable can carry" % (
            where, key))
    contract = contract_var_hint(key)
    if contract is not None:
        raise UsageError("%s: %s is onbox's to set for the job: %s" % (where, key, contract),
                         hint="drop it here: onbox gives every attempt its own value, and the trainer must see "
                              "that one")
    if key in AGENT_ONLY_VARS:  # U34: it would be recorded in config.json and handed to the child
        raise UsageError("%s: %s is the agent's secret, not the job's" % (where, key),
                         hint="put the token in a file (--tracker-token-file) or export it in the "
                              "agent's environment; it is never written down or given to the child")


def is_remote(durable: str) -> bool:
    """A durable target `remote:path` (rclone), not a mounted path: a colon before the first '/'."""
    return not os.path.isabs(durable) and ":" in durable.split("/", 1)[0]


def check_path(key: str, value: str) -> None:
    """A path option the system can take: no NUL, within PATH_MAX and NAME_MAX, `~` expanded (UsageError naming the
    option otherwise)."""
    from onbox.untrusted import path_length_problem

    if "\0" in value:
        raise UsageError("%s: the path holds a NUL byte, which no path can carry" % label(key))
    problem = path_length_problem(value)
    if problem:
        raise UsageError("%s: the path is too long for the system: %s" % (label(key), problem),
                         hint="give a shorter path (for a deep local directory, a symlink to it works)")
    if value.startswith("~") and not (key == "durable" and is_remote(value)):
        raise UsageError("%s %s: cannot expand %s (HOME is unset, or no such user)" % (
            label(key), value, value.split("/", 1)[0]), hint="give an absolute path (./%s for a directory whose "
                                                              "name starts with ~)" % value)


def expand_home(key: str, value: Any) -> Any:
    """`~` and `~user` at the start of a path field, expanded, so that `durable = "~/durable"` means the home
    directory wherever it is given, not a directory named `~` under the working directory."""
    if isinstance(value, list) and key in PATH_LIST_FIELDS:
        return [os.path.expanduser(v) for v in value]
    if not isinstance(value, str) or key not in PATH_FIELDS or (key == "durable" and is_remote(value)):
        return value
    return os.path.expanduser(value)


def contract_var_hint(key: str) -> Optional[str]:
    """What to do instead of setting `key`, when it is one of the variables onbox sets for the job; else None."""
    if key in CONTRACT_VARS or key in MARKER_VARS:
        return CONTRACT_VARS.get(key) or MARKER_VARS[key]
    if key == PHASE_VAR or key.startswith(PHASE_VAR + "_"):
        return "the ONBOX_PHASE* variables come from the run file's [[phase]] tables: give the phase's keys " \
               "(lr, target_steps, ...), or another name in its env table"
    return None


def parse_secret_spec(spec: str) -> Tuple[str, str]:
    """`--secret NAME` or `--secret VAR=NAME` -> (the child's variable, the file name in the secrets dir)."""
    var, sep, name = spec.partition("=")
    if not sep:
        var, name = spec, spec
    if not valid_secret_name(name):
        raise UsageError("--secret %r: %r is not a secret name" % (spec, name),
                         hint="a file name in $ONBOX_HOME/secrets/ (letters, digits, '.', '_', '-'), as "
                              "`onboxctl secrets push BOX NAME` stores it; VAR=NAME sets another variable")
    check_env_entry(var, "", "--secret")
    return var, name


def url_problem(url: str) -> Optional[str]:
    """Why `url` is not a usable http(s) URL (None when it is): scheme, host and port are checked."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        _port = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return "not an http(s) URL"
    if not parts.hostname:
        return "no host in it"
    return None


def parse_catchable_signal(value: Any, key: str = "signal", also_refused: Tuple[int, ...] = ()) -> signal.Signals:
    """parse_signal, refusing what no handler can see: KILL and STOP (and `also_refused`, e.g. CHLD, which the
    agent needs for reaping). Before, `--preempt-signal KILL` crashed the detached agent and left a run dir
    that every relaunch failed on."""
    sig = parse_signal(value, label(key))
    if sig in UNCATCHABLE:
        raise UsageError("%s: %s cannot be caught, so the agent could never act on it" % (label(key), sig.name),
                         hint="use a signal a process can handle: USR1, USR2, TERM or INT")
    if sig in also_refused:
        raise UsageError("%s: %s is not available: the agent uses it for its own work" % (label(key), sig.name),
                         hint="use USR1, USR2, TERM or INT")
    return sig


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


SIGNAL_KEYS = ("preempt_signal", "checkpoint_signal")
SINGLE_STRING_LISTS = ("metrics_regex", "env_files")  # from a variable: one item (a regex is no shell word)


def _coerce(key: str, value: Any, source: str) -> Any:
    """The value as the field's type. Text (flags, ONBOX_* variables) is parsed; typed values (TOML, JSON) must
    already have the type: a boolean is not a number (`max_restarts = true` is not 1) and a number is not a
    boolean or a path."""
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
            if not isinstance(value, str):
                raise ValueError("expected true or false, not a number")
            text = value.strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if key == "phases":
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ValueError("expected [[phase]] tables")
            return [dict(v) for v in value]
        if isinstance(value, bool) and kind is not list:
            raise ValueError("expected %s, not true/false" % ("a number" if "float" in ann or "int" in ann
                                                              else "a string"))
        if key == "hang_after":
            return hang_after_seconds(value)
        if "float" in ann:
            if not isinstance(value, (int, float, str)):
                raise ValueError("expected a number")
            return float(value)
        if "int" in ann:
            if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
                raise ValueError("expected a whole number")
            if not isinstance(value, (int, float, str)):
                raise ValueError("expected a whole number")
            return int(value)
        if kind is list:
            if isinstance(value, str):
                if key in SINGLE_STRING_LISTS:
                    return [value]
                import shlex
                return shlex.split(value)
            if not isinstance(value, list) or not all(
                    isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                raise ValueError("expected a list of strings")
            return [str(v) for v in value]
        if kind is dict:
            if not isinstance(value, dict) or not all(
                    isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value.values()):
                raise ValueError("expected a table of KEY = \"value\"")
            return {str(k): str(v) for k, v in value.items()}
        if isinstance(value, int) and key in SIGNAL_KEYS:
            return str(value)
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    except (TypeError, ValueError, OverflowError) as e:
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
        setattr(cfg, key, expand_home(key, _coerce(key, value, source)))
    return cfg


def env_overrides(environ: Mapping[str, str]) -> Dict[str, Any]:
    """ONBOX_<FIELD> variables, e.g. ONBOX_DURABLE, ONBOX_TRACKER, ONBOX_HEARTBEAT_INTERVAL.

    The child-side contract variables (ONBOX_RUN, ONBOX_CKPT_DIR, ONBOX_RESUME_FROM, ...) are outputs, not inputs,
    and are ignored here so a nested onbox does not inherit its parent's run.
    """
    skip = {"name", "command", "ckpt_dir", "env", "phases", "deadline_at", "deadline_source"}  # the launch's to set
    out = {}
    for key in _FIELDS:
        if key in skip:
            continue
        var = "ONBOX_" + key.upper()
        if var in environ and environ[var] != "":
            out[key] = environ[var]
    return out


def resolve(cli: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None,
            run_file: Optional[str] = None, profile_defaults: Optional[Mapping[str, Any]] = None,
            defaults_source: str = "profile") -> RunConfig:
    """Merge the layers (lowest first) into a validated RunConfig. `cli` holds only flags the user gave;
    `defaults_source` names the lowest layer in messages (the profile, or a re-launch record)."""
    from onbox.tomlread import load_toml

    environ = os.environ if environ is None else environ
    cfg = RunConfig()
    if profile_defaults:
        _apply(cfg, profile_defaults, defaults_source)
    if run_file:
        data = dict(load_toml(run_file, "run file"))
        phases = data.pop("phase", None)  # top-level [[phase]] tables (onbox/supervisor/phases.py)
        run_table = data.get("run", data)
        if not isinstance(run_table, dict):
            raise UsageError("run file %s: [run] must be a table" % run_file)
        _apply(cfg, run_table, "run file %s" % run_file)
        if phases is not None:
            _apply(cfg, {"phases": phases}, "run file %s" % run_file)
    _apply(cfg, env_overrides(environ), "environment")
    _apply(cfg, {k: v for k, v in cli.items() if v is not None and v != () and v != []}, "command line")
    return cfg.validate()


DEADLINE_OFF = "none"
DEADLINE_SLURM = "slurm"  # the Slurm job's EndTime, and an error (not a warning) when it cannot be read
DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")
ABSOLUTE_RE = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d)(?::(\d\d)(?:\.\d+)?)?"
                         r"(Z|[+-]\d\d:?\d\d)?$", re.IGNORECASE)
DEADLINE_HINT = ("an absolute time with its zone (2026-11-25T18:00:00Z, 2026-11-25T19:00+01:00), a duration from the "
                 "launch (11h40m, 90m, 1d2h, 3600s), `slurm` (the job's end time) or `none`")


def hang_after_seconds(value: Any) -> float:
    """--hang-after: seconds (a number, or a duration: 90s, 5m, 1h30m), `off` (or `none`, 0) for never judged hung.
    ValueError for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip().lower()
    if text in ("off", "none", "never"):
        return 0.0
    m = DURATION_RE.match(text)
    if not text or m is None or not any(m.groups()):
        raise ValueError("expected seconds or a duration (90s, 5m, 1h30m), or off")
    days, hours, minutes, seconds = (float(g) if g else 0.0 for g in m.groups())
    return days * DAY + hours * HOUR + minutes * MINUTE + seconds


def parse_deadline(text: Any, now: float) -> Optional[float]:
    """--deadline WHEN as wall-clock epoch seconds: an absolute time in UTC (`Z`) or with an offset, or a duration
    from `now` (`11h40m`, `90m`, `1d2h`, `45s`, a bare number of seconds); None for `none` (no deadline). Anything
    else is a UsageError: a time without its zone is refused (the box's zone is rarely the one meant)."""
    import calendar

    value = str(text).strip()
    if value.lower() == DEADLINE_OFF:
        return None
    m = DURATION_RE.match(value.lower())
    if value and m and any(m.groups()):
        days, hours, minutes, seconds = (float(g) if g else 0.0 for g in m.groups())
        total = days * DAY + hours * HOUR + minutes * MINUTE + seconds
        if total <= 0 or total > 366 * DAY:
            raise UsageError("--deadline %r: a duration must be more than 0 and at most 366 days" % value,
                             hint=DEADLINE_HINT)
        return now + total
    m = ABSOLUTE_RE.match(value)
    if m is None:
        raise UsageError("--deadline %r: not a time or a duration" % value, hint=DEADLINE_HINT)
    zone = m.group(7)
    if zone is None:
        raise UsageError("--deadline %r: the time has no zone" % value,
                         hint="add Z for UTC or an offset (+01:00): " + DEADLINE_HINT)
    try:
        year, month, day, hour, minute = (int(m.group(i)) for i in range(1, 6))
        second = int(m.group(6) or 0)
        import datetime

        datetime.datetime(year, month, day, hour, minute, second)  # a real date and time
    except ValueError as e:
        raise UsageError("--deadline %r: %s" % (value, e), hint=DEADLINE_HINT)
    at = float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))
    if zone.upper() != "Z":
        sign = 1 if zone[0] == "+" else -1
        digits = zone[1:].replace(":", "")
        at -= sign * (int(digits[:2]) * HOUR + int(digits[2:]) * MINUTE)
    return at
