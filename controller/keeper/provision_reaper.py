"""The process between the keeper and a provision command: it runs the command, and stops everything the command left
running once it ends (or is stopped at its timeout). Run by controller/keeper/provision_run.py as

    python -I provision_reaper.py KEEPER_PID REPORT_FD GRACE -- ARGV...

Why a process of its own, a child subreaper (prctl PR_SET_CHILD_SUBREAPER), rather than the keeper walking /proc
(onbox/supervisor/leftovers.py's way for an attempt): a provision script is short-lived glue around a platform's CLI
that often backgrounds things (`cmd &`, `setsid`, a daemonising ssh ControlMaster, `(... &)` whose parent is gone
before any poll could see it, `env -i` that drops any marker). Every process that ever descends from the command is
reparented to this subreaper when its parent dies, whatever session it moved to and whatever it did to its
environment, so `descendants(self)` is exactly what the command left; a /proc poll misses what double-forked
between two polls with a scrubbed environment. The keeper itself cannot be the subreaper: its own ssh
ControlMasters and other children would end up its zombies. And as a process of its own it has PR_SET_PDEATHSIG: a
keeper SIGKILLed mid-provision takes the command and its leftovers along (TERM, then KILL), where the keeper's own
/proc walk would have died with it.

Each stop is the one escalation (onbox.proc.escalate: TERM, GRACE seconds, KILL, every signal checked against the
process's start time). What it saw is written to REPORT_FD as JSON lines, never to its stdout or stderr (those are
the command's, read by the keeper): {"started": pid} or {"error": "missing" | "not_executable" | "oserror", ...},
{"exited": code} or {"signal": n} when the command ends, {"stopped": [...], ...} once its leftovers are gone.

Run by its file path with -I (no PYTHONPATH, no user site): it imports the standard library and onbox.proc (with
onbox.clock) only, from the tree it lies in.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, List

PR_SET_PDEATHSIG = 1  # prctl(2)
POLL = 0.05  # seconds between looks at the command while it runs
MAX_LISTED = 20  # leftovers named in the report (the count is always whole)


def _die_with(parent: int) -> bool:
    """TERM to this process when the keeper's thread that started it ends; False when the keeper is gone already."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    return os.getppid() == parent


def main(args: List[str]) -> int:
    from onbox.clock import SystemClock
    from onbox.proc import ProcessSeam, ProcRef, escalate, set_child_subreaper, start_time

    parent, fd, grace = int(args[0]), int(args[1]), float(args[2])
    cmd = args[4:] if args[3:4] == ["--"] else args[3:]
    report = os.fdopen(fd, "w", buffering=1)

    def say(**doc: Any) -> None:
        try:
            report.write(json.dumps(doc) + "\n")
            report.flush()
        except OSError:  # the keeper is gone (EPIPE): the stop goes on all the same
            pass

    stop: List[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))  # recorded; the loop acts on it
    if not _die_with(parent):
        return 1
    set_child_subreaper(True)
    try:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except FileNotFoundError:
        say(error="missing")
        return 0
    except PermissionError:
        say(error="not_executable")
        return 0
    except OSError as e:
        say(error="oserror", text=str(e))
        return 0
    say(started=child.pid)
    while not stop:
        pid, status = os.waitpid(child.pid, os.WNOHANG)
        if pid:
            say(**({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exited": os.WEXITSTATUS(status)}))
            break
        time.sleep(POLL)
    child.returncode = 0  # reaped here or by the stop below: keep Popen from looking for it again

    seam = ProcessSeam()
    me = ProcRef(os.getpid(), start_time(os.getpid()) or 0)

    def left() -> List[ProcRef]:  # the subreaper's whole tree: the command (at a timeout) and all it left
        return [p.ref for p in seam.descendants(me)]

    found, killed, survived, commands = [], [], [], {}
    for _ in range(3):  # again for what forked while being stopped (a KILL ends that)
        out = escalate(seam, left, grace, SystemClock(), what="process(es) the provision command left")
        if not out.found:
            break
        found += out.found
        killed += out.killed
        survived += out.survived
        commands.update(out.commands)
    while True:  # whatever ended meanwhile is ours to reap
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    theirs = [r for r in found if r.pid != child.pid]
    say(stopped=[{"pid": r.pid, "command": commands.get(r, "")} for r in theirs[:MAX_LISTED]], count=len(theirs),
        killed=[r.pid for r in killed if r.pid != child.pid], survived=[r.pid for r in survived])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main(sys.argv[1:]))
