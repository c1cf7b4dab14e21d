"""Where onbox keeps its state on a box. One place, so every command agrees.

$ONBOX_HOME (default ~/.onbox, or /tmp/onbox-<uid> when $HOME is unwritable)
  runs/<run>/        one directory a run: state.json, events.jsonl, config.json, output.log, ...
"""
from __future__ import annotations

import os
import re

RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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
    return bool(RUN_NAME_RE.match(name))
