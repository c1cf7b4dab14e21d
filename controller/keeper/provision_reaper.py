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
process's start time), then a KILL to the command's process group. The command is not reaped before that (waitid
WNOWAIT): its zombie holds its pid, so its group id cannot have passed to another process. Where there is no /proc
to walk (a macOS laptop), only that group is stopped: TERM, GRACE seconds, KILL. What it saw is written to REPORT_FD as JSON lines, never to its stdout or stderr (those are
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
from typing import Any, Dict, List, Optional, Sequence

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


def _ended(pid: int) -> Optional[Dict[str, int]]:
    """How the command ended ({"exited": code} or {"signal": n}), None while it runs. Where the OS can, the command
    is NOT reaped here: its zombie keeps its pid, so the process group it leads cannot be handed to another process
    while this one still signals it."""
    if hasattr(os, "waitid"):
        res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if res is None or res.si_pid == 0:
            return None
        killed = res.si_code in (getattr(os, "CLD_KILLED", 2), getattr(os, "CLD_DUMPED", 3))
        return {"signal": res.si_status} if killed else {"exited": res.si_status}
    done, status = os.waitpid(pid, os.WNOHANG)  # pragma: no cover (no waitid): reaped, so no group signal after it
    if not done:
        return None
    ended = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exited": os.WEXITSTATUS(status)}
    return dict(ended, reaped=1)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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
    ended: Optional[Dict[str, int]] = None
    while not stop:
        ended = _ended(child.pid)
        if ended is not None:
            say(**{k: v for k, v in ended.items() if k != "reaped"})
            break
        time.sleep(POLL)
    child.returncode = 0  # reaped below: keep Popen from looking for it again

    class Seam(ProcessSeam):
        def reap_zombies(self, keep: Sequence[int] = ()) -> List[int]:  # the command's zombie holds its group id
            return super().reap_zombies(keep=[*keep, child.pid])

    seam = Seam()
    me = ProcRef(os.getpid(), start_time(os.getpid()) or 0)
    group = ended is None or not ended.get("reaped")  # its group id is still its own to signal

    def left() -> List[ProcRef]:  # the subreaper's whole tree: the command (at a timeout) and all it left
        return [p.ref for p in seam.descendants(me) if p.pid != child.pid or ended is None]

    walk = os.path.isdir("/proc/self")  # Linux: the tree is walked (and said); elsewhere only the group is known
    if group and not walk:
        _signal_group(child.pid, signal.SIGTERM)  # its process group: everything that stayed in it
    found, killed, survived, commands = [], [], [], {}
    for _ in range(3):  # again for what forked while being stopped (a KILL ends that)
        out = escalate(seam, left, grace, SystemClock(), what="process(es) the provision command left")
        if not out.found:
            break
        found += out.found
        killed += out.killed
        survived += out.survived
        commands.update(out.commands)
    if group:  # the last sweep of its group (with no tree to walk: after the group's grace)
        if not walk:
            time.sleep(grace)
        _signal_group(child.pid, signal.SIGKILL)
    try:
        os.waitpid(child.pid, 0)
    except ChildProcessError:
        pass
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
