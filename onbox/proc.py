"""The OS seam for processes: spawn an attempt in its own session, signal its group, wait, escalate, and find
every process of a session by scanning /proc (orphans reparented to init keep their session id).

The supervisor receives a `ProcessSeam`; tests may pass a recording fake. Everything here is Linux /proc based:
onbox runs on Linux boxes only.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import signal
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

PROC = "/proc"


@dataclasses.dataclass
class Child:
    """One spawned (or adopted) attempt: it leads its own session and process group (sid == pgid == pid)."""

    pid: int
    sid: int
    pgid: int
    start_time: Optional[int]  # /proc/<pid>/stat field 22, clock ticks since boot: tells a recycled PID apart
    ours: bool = True  # False when adopted from a dead agent: we cannot waitpid() it, so the exit code is unknown


@dataclasses.dataclass
class ExitStatus:
    """How a process ended. Exactly one of code/signal is set, or neither when unknown (an adopted child)."""

    code: Optional[int] = None
    signal: Optional[int] = None

    @classmethod
    def from_wait(cls, status: int) -> "ExitStatus":
        if os.WIFSIGNALED(status):
            return cls(signal=os.WTERMSIG(status))
        return cls(code=os.WEXITSTATUS(status))


def read_stat(pid: int, proc: str = PROC) -> Optional[List[str]]:
    """Fields of /proc/<pid>/stat (index 0 is the pid, 1 the comm without parens), or None when gone."""
    try:
        with open("%s/%d/stat" % (proc, pid), "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # comm may contain spaces and parens: split around the LAST ')'
    left, _, right = raw.rpartition(")")
    pid_s, _, comm = left.partition(" (")
    return [pid_s, comm, *right.split()]


def start_time(pid: int, proc: str = PROC) -> Optional[int]:
    """The process start time in clock ticks since boot (stat field 22), or None when the process is gone."""
    fields = read_stat(pid, proc)
    return int(fields[21]) if fields and len(fields) > 21 else None


def boot_id(proc: str = PROC) -> Optional[str]:
    """This boot's random id (/proc/sys/kernel/random/boot_id): pids and clock ticks only compare within one."""
    try:
        with open(os.path.join(proc, "sys/kernel/random/boot_id")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def is_alive(pid: int, expected_start: Optional[int] = None, proc: str = PROC) -> bool:
    """True when `pid` exists, is not a zombie, and (if given) started at `expected_start` (no recycled PID)."""
    fields = read_stat(pid, proc)
    if not fields or len(fields) <= 21 or fields[2] in ("Z", "X"):
        return False
    return expected_start is None or int(fields[21]) == int(expected_start)


def session_members(sid: int, proc: str = PROC, exclude: Sequence[int] = ()) -> List[int]:
    """Every live (non-zombie) process whose session id is `sid`, found by scanning /proc."""
    out: List[int] = []
    skip = set(exclude)
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in skip:
            continue
        fields = read_stat(pid, proc)
        if fields and len(fields) > 5 and fields[2] not in ("Z", "X") and int(fields[5]) == sid:
            out.append(pid)
    return out


def zombie_children(parent: int, proc: str = PROC) -> List[int]:
    """Zombies whose parent is `parent` (orphans reparented to a PID-1 or subreaper agent)."""
    out = []
    for name in os.listdir(proc):
        if name.isdigit():
            fields = read_stat(int(name), proc)
            if fields and len(fields) > 3 and fields[2] == "Z" and int(fields[3]) == parent:
                out.append(int(name))
    return out


class ProcessSeam:
    """Every process syscall the supervisor makes, one small method each (tests swap in a recording fake)."""

    def __init__(self, proc: str = PROC, sleep: Callable[[float], None] = time.sleep,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.proc = proc
        self._sleep = sleep
        self._monotonic = monotonic

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str], log_path: str) -> Child:
        """Start argv in a new session, stdin from /dev/null, stdout+stderr appended to log_path.

        The child writes the log itself (O_APPEND), not through a pipe to the agent: if the agent dies the child
        keeps running and keeps logging instead of dying of SIGPIPE (U1, U3).
        Raises OSError (e.g. ENOENT) when the executable cannot be started.
        """
        import subprocess

        # 0600: the job's output is its owner's (a run dir is 0700 too); the child keeps its own umask
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                 cwd=cwd, env=dict(env), start_new_session=True, close_fds=True,
                                 restore_signals=True)
        finally:
            os.close(log_fd)
        # Popen is only used to fork/exec; the supervisor waits with waitpid itself (it may reap as PID 1).
        p.returncode = 0  # keep Popen.__del__ from warning about a "still running" process
        return Child(pid=p.pid, sid=p.pid, pgid=p.pid, start_time=start_time(p.pid, self.proc))

    def adopt(self, pid: int, expected_start: Optional[int]) -> Optional[Child]:
        """A Child for a live process started by an earlier agent, or None when gone or its PID was recycled."""
        fields = read_stat(pid, self.proc)
        if not fields or len(fields) <= 21 or fields[2] in ("Z", "X"):
            return None
        if expected_start is None or int(fields[21]) != int(expected_start):
            return None  # a recycled PID: some other process now holds it
        return Child(pid=pid, sid=int(fields[5]), pgid=int(fields[4]), start_time=int(fields[21]), ours=False)

    def poll(self, child: Child) -> Optional[ExitStatus]:
        """The exit status once the child has ended (reaping it), else None. Never blocks."""
        if child.ours:
            try:
                pid, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                return ExitStatus()  # reaped elsewhere: ended, status lost
            return ExitStatus.from_wait(status) if pid else None
        return None if is_alive(child.pid, child.start_time, self.proc) else ExitStatus()

    def signal_group(self, pgid: int, sig: int) -> bool:
        """killpg; False when the group no longer exists."""
        try:
            os.killpg(pgid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return False

    def signal_pid(self, pid: int, sig: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def session_members(self, sid: int) -> List[int]:
        return session_members(sid, self.proc, exclude=(os.getpid(),))

    def _members(self, sid: int, leader_start: Optional[int]) -> List[int]:
        """Members of session `sid` that started no earlier than its leader (when that start is known)."""
        members = self.session_members(sid)
        if leader_start is None:
            return members
        return [p for p in members if (start_time(p, self.proc) or 0) >= int(leader_start)]

    def kill_session(self, sid: int, timeout: float, log: Optional[Callable[[str], None]] = None,
                     leader_start: Optional[int] = None) -> List[int]:
        """TERM every process of session `sid`, wait up to `timeout` s, then KILL what is left.

        Orphaned DataLoader/DDP workers are the usual GPU pinners (U11): they keep the session id after their
        parent died, so a /proc scan finds them where a process-group kill of a dead leader would not.
        `leader_start`: the start time (clock ticks) of the process that created the session. A session id is
        a pid, recycled once the session emptied: when a process with pid `sid` lives but started at another
        time, session `sid` is someone else's now and nothing is killed; members that started before that
        leader cannot be of its session either. Returns the pids that were found.
        """
        if leader_start is not None:
            now_leader = start_time(sid, self.proc)
            if now_leader is not None and now_leader != int(leader_start):
                if log:
                    log("session %d was recycled (its leader pid started at another time): not touched" % sid)
                return []
        found = self._members(sid, leader_start)
        if not found:
            return []
        if log:
            log("TERM to %d process(es) of session %d: %s" % (len(found), sid, found))
        for pid in found:
            self.signal_pid(pid, signal.SIGTERM)
        deadline = self._monotonic() + max(0.0, timeout)
        left = found
        while True:
            self.reap_zombies()
            left = [p for p in self._members(sid, leader_start)]
            if not left or self._monotonic() >= deadline:
                break
            self._sleep(min(0.05, max(0.005, timeout / 20)))
        if left:
            if log:
                log("KILL to %d process(es) of session %d still alive after %.1f s: %s"
                    % (len(left), sid, timeout, left))
            for pid in left:
                self.signal_pid(pid, signal.SIGKILL)
            kill_deadline = self._monotonic() + 5.0
            while self._members(sid, leader_start) and self._monotonic() < kill_deadline:
                self.reap_zombies()
                self._sleep(0.01)
        self.reap_zombies()
        return found

    def reap_zombies(self, keep: Sequence[int] = ()) -> List[int]:
        """Reap zombie children that are not ours to wait for (orphans reparented to a PID-1/subreaper agent).

        Zombies in the agent's own session are left alone: those are subprocesses a hook runs and waits for.
        """
        me = os.getpid()
        my_sid = os.getsid(0)
        reaped: List[int] = []
        try:
            zombies = zombie_children(me, self.proc)
        except OSError:
            return reaped
        for pid in zombies:
            if pid in keep:
                continue
            fields = read_stat(pid, self.proc)
            if fields and len(fields) > 5 and int(fields[5]) == my_sid:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
            except ChildProcessError:
                pass
        return reaped


def set_child_subreaper(on: bool = True) -> Optional[bool]:
    """prctl(PR_SET_CHILD_SUBREAPER): orphans of the job reparent to the agent, which reaps them. Linux only.

    Returns the previous setting (None when unknown) so an in-process caller can restore it.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        before = ctypes.c_int(0)
        known = libc.prctl(37, ctypes.byref(before), 0, 0, 0) == 0  # 37 = PR_GET_CHILD_SUBREAPER
        libc.prctl(36, 1 if on else 0, 0, 0, 0)  # 36 = PR_SET_CHILD_SUBREAPER
        return bool(before.value) if known else None
    except (OSError, AttributeError):
        return None


def signal_name(sig: int) -> str:
    """9 -> 'SIGKILL'."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "signal %d" % sig


def env_pid_alive(pid: int) -> bool:
    """True when a process with this pid exists (any state but gone); for lock holders and agents."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as e:  # pragma: no cover
        return e.errno != errno.ESRCH


def environ_of(pid: int, proc: str = PROC) -> Dict[str, str]:
    """The initial environment of a process (for checking an adopted child's ONBOX_RUN)."""
    try:
        with open("%s/%d/environ" % (proc, pid), "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return out
