"""Where onbox keeps its state on a box. One place, so every command agrees.

$ONBOX_HOME (default ~/.onbox, or /tmp/onbox-<uid> when $HOME is unwritable)
  runs/<run>/        one directory a run (mode 0700): state.json, events.jsonl, config.json, output.log, ...
  secrets/<NAME>     secrets for `onbox run --secret NAME` (`onboxctl secrets push` writes ~/.onbox/secrets/)
"""
from __future__ import annotations

import os
import re
from typing import Optional

RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SECRET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # what `onboxctl secrets push` accepts


def onbox_home() -> str:
    env = os.environ.get("ONBOX_HOME")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    home = os.path.expanduser("~")
    if home and home != "~" and os.access(home, os.W_OK):
        return os.path.join(home, ".onbox")
    return os.path.join("/tmp", "onbox-%d" % os.getuid())


def runs_dir() -> str:
    return os.path.join(onbox_home(), "runs")


def run_dir(name: str) -> str:
    return os.path.join(runs_dir(), name)


def valid_run_name(name: str) -> bool:
    """Run names become directory names and tracker keys: letters, digits, '.', '_', '-'."""
    return bool(RUN_NAME_RE.fullmatch(name))


def secrets_dir() -> str:
    return os.path.join(onbox_home(), "secrets")


def valid_secret_name(name: str) -> bool:
    """A file name inside secrets_dir(): never a path (no '/', no leading '.')."""
    return bool(SECRET_NAME_RE.fullmatch(name))


def home_problem() -> Optional[str]:
    """Why $ONBOX_HOME (or its runs/ directory) can never hold runs, or None. A home that does not exist yet is
    fine (nothing has run here); one that is, or sits under, a regular file is not: without this check
    `ONBOX_HOME=<a file> onbox status` printed nothing and exited 0."""
    home = onbox_home()
    for path in (home, runs_dir()):
        probe = path
        while not os.path.lexists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if os.path.lexists(probe) and not os.path.isdir(probe):
            return "%s is not a directory" % probe
    return None
