"""Shared helpers for the supervisor's real-process tests: fast knobs, the CLI in a subprocess, its state and
events. The processes a test started: tests/processes.py; the cleanup fixture: tests/integration/conftest.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

from tests.conftest import subprocess_env

# Every time knob shrunk to milliseconds (RunConfig fields through ONBOX_* variables).
FAST = {
    "ONBOX_TICK_INTERVAL": "0.05",
    "ONBOX_BACKOFF_INITIAL": "0.05",
    "ONBOX_BACKOFF_MAX": "0.2",
    "ONBOX_TERM_TIMEOUT": "0.5",
    "ONBOX_SYNC_RESERVE": "0",
    "ONBOX_NOTICE_SOURCE": "none",
    "ONBOX_NOTICE_INTERVAL": "0.05",
}


def env_for(home: Any, **extra: str) -> Dict[str, str]:
    env = subprocess_env({"ONBOX_HOME": str(home), **FAST})
    env.update(extra)
    return env


def onbox(home: Any, *args: str, timeout: float = 60, env_extra: Optional[Dict[str, str]] = None,
          cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onbox", *args], env=env_for(home, **(env_extra or {})),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)


def state(home: Any, name: str) -> Dict[str, Any]:
    try:
        with open(os.path.join(str(home), "runs", name, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def events(home: Any, name: str) -> List[Dict[str, Any]]:
    path = os.path.join(str(home), "runs", name, "events.jsonl")
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []

