"""What `onbox run` checks and says in the foreground, before anything is created or detached, beyond
RunConfig.validate: the child's secrets can be read, a re-launch record's bad value is named as such, and the
warnings a careless setup deserves (a secret on the command line, a token file others can read)."""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List

from onbox.errors import UsageError

# Names that usually hold credentials (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD, ...).
SECRET_NAME_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)


def resolve_relaunch(cli: Dict[str, Any], saved: Dict[str, Any], run_dir: str) -> Any:
    """`onbox run --name X` alone: X's config.json below the flags. A value the record holds that is no longer
    accepted (an older onbox took `--preempt-signal KILL`) is refused naming the record and the way out."""
    from onbox import config

    path = os.path.join(run_dir, "config.json")
    try:
        return config.resolve(cli, profile_defaults=saved, defaults_source="the re-launch record %s" % path)
    except UsageError as e:
        raise UsageError(e.message, hint="%sthe re-launch record %s may hold it: the same option on the command line "
                                         "overrides the record" % ((e.hint + "; ") if e.hint else "", path))


def check_child_secrets(cfg: Any) -> None:
    """Every --env-file and --secret readable and well-formed now; the values are read and dropped (the agent
    reads them again when each attempt starts, so they never travel in argv or config.json)."""
    from onbox.supervisor.childenv import secret_env

    secret_env(cfg.env_files, cfg.secrets)


def warnings(cli_env: Dict[str, str], cfg: Any) -> List[str]:
    """One line each, for stderr: setups that work but leak (U34)."""
    from onbox import fsutil, paths
    from onbox.config import parse_secret_spec

    out = []
    leaky = sorted(k for k in cli_env if SECRET_NAME_RE.search(k))
    if leaky:
        out.append("--env %s look%s like a secret: the value stays in this agent's command line (`ps` shows it for "
                   "the whole run) and in config.json; use --secret %s (the file %s) or --env-file PATH instead" % (
                       ", ".join(leaky), "s" if len(leaky) == 1 else "", leaky[0],
                       os.path.join(paths.secrets_dir(), leaky[0])))
    files = [("the tracker token file", cfg.tracker_token_file)] if cfg.tracker_token_file else []
    files += [("the MLflow token file", cfg.mlflow_token_file)] if cfg.mlflow_token_file else []
    files += [("the --env-file", p) for p in cfg.env_files]
    files += [("the secret", os.path.join(paths.secrets_dir(), parse_secret_spec(s)[1])) for s in cfg.secrets]
    for what, path in files:
        mode = fsutil.readable_by_others(path)
        if mode is not None:
            out.append("%s %s is readable by %s (mode %04o): `chmod 600 %s`" % (
                what, path, "everyone" if mode & 0o004 else "its group", mode, path))
    return out
