"""The child's environment and argv: ONBOX_RUN, ONBOX_CKPT_DIR, ONBOX_RESUME_FROM, ... (onbox/supervisor/README.md, `onbox run`)."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional

from onbox.config import AGENT_ONLY_VARS, CONTRACT_VARS
from onbox.fsutil import read_token_file
from onbox.untrusted import UntrustedInput, read_bytes

ENV_FILE_MAX_BYTES = 1024 * 1024  # KEY=VAL lines; a secret is a token or a key
SECRET_MAX_BYTES = 1024 * 1024

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cpu_quota_cores(root: str = "/") -> Optional[float]:
    """CPUs the cgroup allows (quota / period), or None when unlimited or unknown. v2 cpu.max, v1 cfs files."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            rows = [line.strip().split(":", 2) for line in f if line.strip()]
    except OSError:
        return None
    for hier, controllers, path in rows:
        rel = path.lstrip("/")
        if hier == "0" and controllers == "":
            try:
                with open(os.path.join(root, "sys/fs/cgroup", rel, "cpu.max")) as f:
                    quota, period = f.read().split()
                if quota != "max":
                    return int(quota) / int(period)
            except (OSError, ValueError):
                pass
        elif "cpu" in controllers.split(","):
            base = os.path.join(root, "sys/fs/cgroup", "cpu,cpuacct" if "cpuacct" in controllers else "cpu", rel)
            if not os.path.isdir(base):
                base = os.path.join(root, "sys/fs/cgroup/cpu", rel)
            try:
                with open(os.path.join(base, "cpu.cfs_quota_us")) as f:
                    quota_us = int(f.read())
                with open(os.path.join(base, "cpu.cfs_period_us")) as f:
                    period_us = int(f.read())
                if quota_us > 0 and period_us > 0:
                    return quota_us / period_us
            except (OSError, ValueError):
                pass
    return None


def child_env(base: Mapping[str, str], run: str, ckpt_dir: str, resume_from: Optional[str], restart_count: int,
              metrics_file: str, preempt_file: str, extra: Mapping[str, str],
              quota_cores: Optional[float] = None, agent_only: Iterable[str] = AGENT_ONLY_VARS) -> Dict[str, str]:
    """The user's environment minus the agent's secrets (U34; `agent_only`, config.agent_only_vars), plus the
    ONBOX_* contract (config.CONTRACT_VARS), PYTHONUNBUFFERED=1 (U43) and thread caps (U40). `extra` (the run's
    --env, env files, secrets) comes after the defaults, as given, but never over the contract: `onbox run` refuses
    a contract variable there, and one in the agent's own environment (a nested onbox) is replaced."""
    drop = set(agent_only)
    env = {k: v for k, v in base.items() if k not in drop}
    contract = {
        "ONBOX_RUN": run,
        "ONBOX_CKPT_DIR": ckpt_dir,
        "ONBOX_RESUME_FROM": resume_from or "",
        "ONBOX_RESTART_COUNT": str(restart_count),
        "ONBOX_METRICS_FILE": metrics_file,
        "ONBOX_PREEMPT_FILE": preempt_file,
    }
    assert contract.keys() == CONTRACT_VARS.keys(), "config.CONTRACT_VARS names the contract: keep the two in step"
    env["PYTHONUNBUFFERED"] = "1"  # U43: block-buffered stdout into a file makes a healthy job look frozen
    # U40: torch/numpy size their thread pools by the host's CPU count, not the cgroup quota: on a 4-CPU
    # container of a 128-core host that oversubscribes and starves the GPU. Cap them unless the user chose.
    if quota_cores is not None:
        cap = str(max(1, math.floor(quota_cores)))
        for var in THREAD_VARS:
            if not env.get(var):
                env[var] = cap
    env.update(extra)
    env.update(contract)
    return env


def child_argv(command: List[str], resume_args: List[str], resume_from: Optional[str]) -> List[str]:
    """The command, plus the resume arguments (with {ckpt} expanded) only when a checkpoint exists."""
    if not resume_from:
        return list(command)
    return list(command) + [a.replace("{ckpt}", resume_from) for a in resume_args]


def read_env_file(path: str) -> Dict[str, str]:
    """`--env-file PATH`: KEY=VAL lines for the child. Blank lines and `#` comments are skipped, `export ` before
    a key is allowed, a value may be wrapped in single or double quotes (taken literally: no expansion). Errors
    name the file and the line, never the value (the file is where secrets live)."""
    from onbox.config import check_env_entry
    from onbox.errors import UsageError

    hint = "give a readable file of KEY=VAL lines (mode 600)"
    try:
        # a regular file of bounded size: /dev/zero would grow the agent without end, a FIFO block it forever
        raw = read_bytes(path, ENV_FILE_MAX_BYTES, "--env-file")
    except UntrustedInput as e:
        raise UsageError(str(e), hint=hint)
    except OSError as e:
        raise UsageError("--env-file %s: cannot read it: %s" % (path, e.strerror or e), hint=hint)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError("--env-file %s is not UTF-8 text (byte %d)" % (path, e.start), hint="save it as UTF-8")
    out: Dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export "):].lstrip()
        key, sep, value = stripped.partition("=")
        key = key.strip()
        where = "--env-file %s line %d" % (path, n)
        if not sep or not key:
            raise UsageError("%s: expected KEY=VAL" % where, hint="one KEY=VAL a line; `#` starts a comment")
        value = value.strip()
        if value[:1] in ("'", '"'):
            if len(value) < 2 or value[-1] != value[0]:
                raise UsageError("%s: the value of %s opens a quote it does not close" % (where, key))
            value = value[1:-1]
        check_env_entry(key, value, where)
        out[key] = value
    return out


def read_secret(name: str) -> str:
    """The secret `name` from $ONBOX_HOME/secrets/ (where `onboxctl secrets push` puts it), without its final
    line ending. Never logged or recorded: only the name is."""
    from onbox import paths
    from onbox.errors import UsageError

    path = os.path.join(paths.secrets_dir(), name)
    hint = ("store it with `onboxctl secrets push BOX %s < FILE` from your laptop (or write the file on the box, "
            "mode 600)" % name)
    try:
        raw = read_bytes(path, SECRET_MAX_BYTES, "the secret")
    except FileNotFoundError:
        raise UsageError("no secret named %s in %s" % (name, paths.secrets_dir()), hint=hint)
    except IsADirectoryError:
        raise UsageError("the secret %s is a directory, not a file" % path, hint=hint)
    except UntrustedInput as e:  # a FIFO, a device, or more than an environment variable should carry
        raise UsageError(str(e), hint=hint)
    except OSError as e:
        raise UsageError("cannot read the secret %s: %s" % (path, e.strerror or e), hint=hint)
    try:
        value = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("the secret %s is not UTF-8 text: an environment variable cannot carry it" % path)
    value = value[:-2] if value.endswith("\r\n") else value[:-1] if value.endswith("\n") else value
    if not value:
        raise UsageError("the secret %s is empty" % path, hint=hint)
    return value


def secret_env(env_files: List[str], secrets: List[str]) -> Dict[str, str]:
    """The child's variables that are never written down: every --env-file (in order), then every --secret.
    Read when an attempt starts, so a relaunch (and a rotated secret file) takes the current values."""
    from onbox.config import check_env_entry, parse_secret_spec

    out: Dict[str, str] = {}
    for path in env_files:
        out.update(read_env_file(path))
    for spec in secrets:
        var, name = parse_secret_spec(spec)
        value = read_secret(name)
        check_env_entry(var, value, "--secret %s" % spec)
        out[var] = value
    return out


def secret_values(cfg: Any, environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """Every secret value the agent can know, to keep out of the log tail it sends (U34): the job's --secret and
    --env-file values, the tracker and MLflow token files, the agent-only variables of its environment. A secret
    that cannot be read is skipped here: the attempt that needs it says why."""
    from onbox.config import agent_only_vars, parse_secret_spec
    from onbox.errors import UsageError

    env = os.environ if environ is None else environ  # the agent's environment, as the Supervisor was given it
    values: List[str] = [env.get(var, "") for var in agent_only_vars(cfg)]
    for path in [cfg.tracker_token_file, cfg.mlflow_token_file]:
        if path:
            try:
                values.append(read_token_file(path))  # the token as the sinks read it
            except (OSError, UnicodeDecodeError):
                pass
    for path in cfg.env_files:
        try:
            values.extend(read_env_file(path).values())
        except UsageError:
            pass
    for spec in cfg.secrets:
        try:
            values.append(read_secret(parse_secret_spec(spec)[1]))
        except UsageError:
            pass
    return [v for v in values if v]
