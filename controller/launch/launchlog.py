"""$ONBOX_CONFIG_DIR/launches.json: the runs `onboxctl run` started, so that the same command run again on a
replacement box (one that never saw the run) finds the run it belongs to (controller/launch/relaunch.py).

    {"schema": "onboxctl.launches/1", "launches": [{"run", "box", "command", "workdir", "durable", "ckpt_dir",
                                                    "at"}, ...]}

One entry per run a box started (single box and fan-out; a `--nodes` group relaunches from its own records), newest
last, at most MAX_ENTRIES (the oldest go first); `workdir`, `durable` and `ckpt_dir` as the box's agent resolved
them (absolute), so they compare with what the agent on another box resolves for the same launch. Written
atomically under a lock. A damaged file (not this shape, too large, nested too deep, not a regular file) is named
and left alone: a launch that needs it is refused (delete it: only relaunches on a replacement box read it), and
a launch that only adds to it says it could not.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

from controller.boxes.inventory import config_dir
from onbox import untrusted, vocab
from onbox.errors import UsageError
from onbox.fsutil import atomic_write_json
from onbox.paths import valid_run_name

SCHEMA = vocab.SCHEMA_LAUNCHES
FILE = "launches.json"
MAX_ENTRIES = 500
_LOCK = threading.Lock()  # flock is per open file: threads of one onboxctl take turns here first


def _problem(n: int, e: Any) -> Optional[str]:
    if not isinstance(e, dict):
        return "entry %d is not an object" % n
    if not isinstance(e.get("run"), str) or not valid_run_name(e["run"]):
        return "entry %d: run %r is not a run name" % (n, e.get("run"))
    if not isinstance(e.get("box"), str) or not e["box"]:
        return "entry %d: box %r is not a box name" % (n, e.get("box"))
    cmd = e.get("command")
    if not isinstance(cmd, list) or not cmd or not all(isinstance(w, str) for w in cmd):
        return "entry %d: command is not a list of words" % n
    for key in ("workdir", "durable", "ckpt_dir"):
        if e.get(key) is not None and not isinstance(e[key], str):
            return "entry %d: %s %r is not a path" % (n, key, e[key])
    at = e.get("at")
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not at >= 0:
        return "entry %d: at %r is not a time" % (n, at)
    return None


class LaunchLog:
    """The launch log of this machine's onboxctl (one config dir)."""

    def __init__(self, directory: Optional[str] = None) -> None:
        self.path = os.path.join(directory or config_dir(), FILE)

    def load(self) -> List[Dict[str, Any]]:
        """Every recorded launch, oldest first; [] when there is none yet. A damaged log is refused whole."""
        try:
            doc = untrusted.read_json(self.path, untrusted.CONFIG_MAX_BYTES, "launch log")
            entries = doc.get("launches") if isinstance(doc, dict) else None
            if not isinstance(entries, list):
                raise ValueError('not {"launches": [...]}')
            for n, e in enumerate(entries, 1):
                why = _problem(n, e)
                if why:
                    raise ValueError(why)
            return entries
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise UsageError("launch log %s is damaged: %s" % (self.path, untrusted.reason(e)),
                             hint="move it aside (or delete it): it only lets a relaunch on a replacement box find "
                                  "its run; `--name RUN` names the run without it")

    def of_command(self, command: Sequence[str]) -> List[Dict[str, Any]]:
        """The recorded launches of `command` (word for word), newest first."""
        return [e for e in reversed(self.load()) if e["command"] == list(command)]

    @contextlib.contextmanager
    def _editing(self) -> Iterator[List[Dict[str, Any]]]:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with _LOCK, open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # several onboxctl processes may launch at once
            entries = self.load()
            yield entries
            atomic_write_json(self.path, {"schema": SCHEMA, "launches": entries[-MAX_ENTRIES:]}, mode=0o600)

    def record(self, launches: Sequence[Dict[str, Any]], now: Optional[float] = None) -> Optional[str]:
        """Append one entry per started run ({run, box, command, workdir, durable, ckpt_dir}); None, or why they
        could not be recorded (said as a warning: the runs started all the same)."""
        at = time.time() if now is None else now
        rows = [{"run": x["run"], "box": x["box"], "command": list(x["command"]), "workdir": x.get("workdir"),
                 "durable": x.get("durable"), "ckpt_dir": x.get("ckpt_dir"), "at": round(at, 3)} for x in launches]
        if not rows:
            return None
        try:
            with self._editing() as entries:
                entries.extend(rows)
        except UsageError as e:
            return e.message
        except OSError as e:
            return "cannot write the launch log %s: %s" % (self.path, e.strerror or e)
        return None
