"""Daemonize the agent, hold the per-run lock, find a child to re-adopt after an agent restart (a live one, or one
that ended while its keeper kept its exit: shim.py), and stop a live child whose agent is gone (`onbox stop`).

Why a double fork (U1-U4, U18): `ssh box 'onbox run -- ...'` must come back at once and the job must outlive the
SSH session. The first child calls setsid() (no controlling terminal, no SIGHUP when the session ends), the
second fork makes sure the agent can never re-acquire a terminal; stdin/stdout/stderr are re-opened on
/dev/null and agent.log so sshd sees its channel close and the ssh client returns.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from onbox import fsutil, paths, untrusted
from onbox.errors import UsageError
from onbox.proc import Child, ProcessSeam, ProcRef, is_alive
from onbox.supervisor.rundir import RunDir
from onbox.supervisor.state import TERMINAL_VALUES

if TYPE_CHECKING:
    from onbox.supervisor.hooks import Hooks, RunContext
    from onbox.supervisor.state import RunState

TERMINAL = TERMINAL_VALUES  # done, failed, preempted, stopped, fenced


class RunLock:
    """flock(2) on <run_dir>/lock, held by the live agent for its whole life (no double launch)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: Optional[int] = None

    def acquire(self) -> bool:
        """Take the lock without waiting; False when another live agent holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, fsutil.PRIVATE_FILE)
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
            fd = os.open(self.path, os.O_RDONLY)  # a disk remounted read-only: flock(2) needs no write access
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        self.fd = fd
        return True

    def write_owner(self, pid: int) -> None:
        """The holder's pid in the file, for people and error messages (the flock is what counts). Written over
        the old line, then cut to length: no new block is needed, so it works on a full disk; a disk fault is
        ignored (the line only informs, and the agent must start to supervise a child it adopts)."""
        if self.fd is not None:
            data = ("%d\n" % pid).encode()
            try:
                os.pwrite(self.fd, data, 0)
                os.ftruncate(self.fd, len(data))
            except OSError as e:
                if fsutil.disk_fault(e) is None:
                    raise

    def owner(self) -> Optional[int]:
        try:  # bounded, regular files only: the lock file holds one pid
            return int(untrusted.read_text(self.path, 4096, "lock file").strip() or 0) or None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last fd of the open file description drops the flock
            self.fd = None


def agent_alive(state: Optional[Dict[str, Any]]) -> bool:
    """True when the agent recorded in state.json still runs (pid + start time: a recycled pid is not it)."""
    if not state or not state.get("agent_pid"):
        return False
    return is_alive(int(state["agent_pid"]), state.get("agent_start_time"))


def records_problem(rd: RunDir, state: Dict[str, Any], alive: bool) -> Optional[str]:
    """Why what state.json says may be stale: the run's filesystem cannot take writes now (the agent then holds
    the newest state in memory, records.py). Checked with statvfs, for runs not known ended."""
    if state.get("state") in TERMINAL and not alive:
        return None
    problem = fsutil.space_problem(rd.path)
    if not problem:
        return None
    return ("ONBOX_HOME's filesystem %s is %s: the agent cannot record this run's state, so what is shown may be "
            "stale; %s" % (paths.onbox_home(), problem,
                           "it supervises on and writes the state once there is space: free space there (`df -h`, "
                           "`df -i`)" if alive else "free space there, then `onbox status` again"))


def lock_holder(rd: RunDir, proc: ProcessSeam) -> Optional[ProcRef]:
    """The live agent holding the run's lock, from the lock file's owner line: for when state.json cannot name it
    (an agent that adopted the child on a full disk could not record itself). Only a process that has the lock
    file open counts, so a recycled pid in a stale owner line is never taken for the agent."""
    pid = RunLock(rd.lock_path).owner()
    if not pid or pid == os.getpid() or not proc.has_open(pid, rd.lock_path):
        return None
    start = proc.start_time_of(pid)
    return ProcRef(pid, start) if start is not None else None


def live_child(rd: RunDir, proc: ProcessSeam) -> Optional[Child]:
    """The child recorded in state.json if it still runs — same pid AND same start time (a recycled PID is
    someone else's process and must never be adopted or signalled) — or, when it ended while no agent watched it,
    as long as its keeper kept its exit (shim.py): adopting it then records how it really ended (done, or a failure
    the restart policy restarts) instead of starting a new attempt after a run that may have finished."""
    state = rd.read_state()
    if not state or state.get("state") in TERMINAL or not state.get("child_pid"):
        return None
    # imported here: `onbox status` of ended runs never pays for the keeper's imports
    from onbox.supervisor import shim

    live = proc.adopt(int(state["child_pid"]), state.get("child_start_time"))
    return shim.recorded_child(state, rd.file(paths.CHILD_EXIT_FILE), live)


def stop_without_agent(rd: RunDir, child: Child, hooks_factory: Callable[["RunContext"], "Hooks"],
                       grace: Optional[float], request_written: bool) -> "RunState":
    """`onbox stop` for a run whose agent is gone while its child lives: this process adopts the child and stops it
    through the supervisor loop (checkpoint signal, grace, final commit), as the agent would have. The caller holds
    the run's lock. `request_written`: stop.request is in place; else the stop is asked with `grace` directly (the
    disk refused the file). A config.json that cannot supervise the stop is a UsageError, and the request goes."""
    from onbox.supervisor.loop import Supervisor

    try:
        cfg = rd.run_config()
    except (OSError, ValueError, TypeError, UsageError) as e:
        if request_written:
            try:
                os.unlink(rd.stop_request)
            except FileNotFoundError:
                pass
        raise UsageError("run %s has no agent, and its config.json cannot supervise the stop: %s" % (
            rd.name, getattr(e, "message", e)), hint="fix %s, or stop the child yourself: `kill -TERM -%d` "
                                                     "(its process group)" % (rd.config_path, child.pgid))
    cfg.notice_source = "none"
    sup = Supervisor(cfg, rd, hooks_factory=hooks_factory)
    if not request_written:
        sup.intake.ask(grace)
    return sup.run(adopt=child)


def daemonize(agent: Callable[[Callable[[Dict[str, Any]], None]], int], log_path: str,
              ready_timeout: float = 60.0) -> Tuple[bool, Dict[str, Any]]:
    """Run `agent(ready)` in a detached grandchild; return (ok, info) in the caller once it called `ready(info)`.

    The caller keeps running only to report: it returns as soon as the agent says the child runs (or failed).
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # first child
        os.close(r)
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            _redirect_stdio(log_path)
            os.chdir("/")

            sent: list = []

            def ready(info: Dict[str, Any]) -> None:
                if not sent:
                    sent.append(True)
                    try:
                        os.write(w, json.dumps(info).encode() + b"\n")
                        os.close(w)
                    except OSError:
                        pass

            code = 1
            try:
                code = agent(ready)
            finally:
                ready({"ok": False, "error": "the agent ended before the child started; see %s" % log_path})
            os._exit(code)
        except BaseException:  # never return into the caller's stack from a forked child
            import traceback

            traceback.print_exc()
            os._exit(1)
    os.close(w)
    os.waitpid(pid, 0)  # the first child exits right after the second fork
    data = b""
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        ready_fds, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready_fds:
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
        if data.endswith(b"\n"):
            break
    os.close(r)
    if not data:
        return False, {"error": "the agent did not report within %.0f s; see %s" % (ready_timeout, log_path)}
    info = json.loads(data.decode())
    return bool(info.get("ok")), info


def _redirect_stdio(log_path: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out = fsutil.open_private_append(log_path)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def lock_or_explain(rd: RunDir) -> RunLock:
    """The run's lock, or a UsageError naming the live agent (a second `onbox run --name X` is refused)."""
    lock = RunLock(rd.lock_path)
    if not lock.acquire():
        owner = lock.owner()
        raise UsageError("run %s is already running (agent pid %s)" % (rd.name, owner or "?"),
                         hint="`onbox status %s` shows it; `onbox stop %s` stops it" % (rd.name, rd.name))
    return lock
