"""The OS seam for processes: spawn an attempt in its own session, signal its group, wait, escalate, and find
every process of a session by scanning /proc (orphans reparented to init keep their session id), every process
under a given one (its tree), and every process whose environment carries a given variable.

A process is identified for good by its pid AND its start time (`ProcRef`): a pid is handed out again once its
process is gone, the pair is not (within one boot). Every signal to a process found earlier is checked against
its start time right before it is sent, through a pidfd where the kernel and Python have one (Linux 5.3, Python
3.9), so a recycled pid is never signalled.

Stopping processes is one escalation, `escalate` (TERM, a deadline on the clock seam, KILL, each step logged),
for an attempt's session (`ProcessSeam.kill_session`) and for the GPU reaper alike. This module is onbox's one
reader of /proc/<pid>/stat (`read_stat`).

The supervisor and the reaper receive a `ProcessSeam`; tests pass a fake (a subclass over a scripted process
table, with a FakeClock). Everything here is Linux /proc based: onbox runs on Linux boxes only.

Past 400 lines on purpose: the seam, the stat reader and the escalation share `ProcRef` and the start-time check
made right before each signal; kept in one module, that check has one implementation.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import signal
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.clock import Clock, SystemClock

PROC = "/proc"


@dataclasses.dataclass
class Child:
    """One spawned (or adopted) attempt: it leads its own session and process group (sid == pgid == pid)."""

    pid: int
    sid: int
    pgid: int
    start_time: Optional[int]  # /proc/<pid>/stat field 22, clock ticks since boot: tells a recycled PID apart
    ours: bool = True  # False when adopted from a dead agent: we cannot waitpid() it, so the exit code is unknown


@dataclasses.dataclass(frozen=True)
class ProcRef:
    """One process for good: its pid and its start time (clock ticks since boot, /proc/<pid>/stat field 22)."""

    pid: int
    start_time: int


@dataclasses.dataclass(frozen=True)
class ProcInfo:
    """One process as /proc/<pid>/stat shows it."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start_time: int
    comm: str
    state: str = "R"  # the kernel's one-letter state: R running, S sleeping, D disk wait, Z zombie, ...

    @property
    def ref(self) -> ProcRef:
        return ProcRef(self.pid, self.start_time)

    @property
    def live(self) -> bool:
        """Not a zombie: a zombie holds no memory, no files and no GPU, and cannot be signalled any more."""
        return self.state not in ("Z", "X")


@dataclasses.dataclass
class Stopped:
    """What one escalation met: every process it found (TERM), those that refused a signal (another user's: not
    waited for, not signalled again), those still there at the deadline (KILL), those alive even after the KILL
    (stuck, state D), each one's command line as first seen, and every signal in the order sent:
    (process, signal name, "sent" | "denied" | "gone")."""

    found: List[ProcRef] = dataclasses.field(default_factory=list)
    killed: List[ProcRef] = dataclasses.field(default_factory=list)
    survived: List[ProcRef] = dataclasses.field(default_factory=list)
    denied: List[ProcRef] = dataclasses.field(default_factory=list)
    commands: Dict[ProcRef, str] = dataclasses.field(default_factory=dict)
    signals: List[Tuple[ProcRef, str, str]] = dataclasses.field(default_factory=list)

    @property
    def pids(self) -> List[int]:
        return [r.pid for r in self.found]

    def result(self, ref: ProcRef, name: str) -> Optional[str]:
        """What the signal `name` ("SIGTERM") did to `ref`: "sent", "denied", "gone", or None when not sent."""
        return next((res for r, n, res in self.signals if r == ref and n == name), None)


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


# /proc/<pid>/stat, proc(5): "pid (comm) state ppid pgrp session tty_nr ... starttime ...". Fields are numbered
# from 1, as the man page numbers them. comm may hold spaces and parentheses, so the line is split at its LAST ')':
# the words after it start at field 3 (state), so field N is word N - 3 there. This is onbox's one reader of it.
STAT_STATE, STAT_PPID, STAT_PGRP, STAT_SESSION, STAT_STARTTIME = 3, 4, 5, 6, 22


def read_stat(pid: int, proc: str = PROC) -> Optional[ProcInfo]:
    """/proc/<pid>/stat of any process, zombies included (see ProcInfo.live), or None when gone or unreadable."""
    try:
        with open("%s/%d/stat" % (proc, pid), "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    head, _, tail = raw.rpartition(")")
    words = tail.split()
    try:
        return ProcInfo(pid=pid, ppid=int(words[STAT_PPID - 3]), pgid=int(words[STAT_PGRP - 3]),
                        sid=int(words[STAT_SESSION - 3]), start_time=int(words[STAT_STARTTIME - 3]),
                        comm=head.partition("(")[2], state=words[STAT_STATE - 3])
    except (IndexError, ValueError):  # not a stat line (a stand-in file, a truncated read)
        return None


def start_time(pid: int, proc: str = PROC) -> Optional[int]:
    """The process start time in clock ticks since boot (stat field 22), or None when the process is gone."""
    found = read_stat(pid, proc)
    return found.start_time if found else None


def proc_info(pid: int, proc: str = PROC) -> Optional[ProcInfo]:
    """The live (non-zombie) process `pid`, or None."""
    found = read_stat(pid, proc)
    return found if found is not None and found.live else None


def boot_id(proc: str = PROC) -> Optional[str]:
    """This boot's random id (/proc/sys/kernel/random/boot_id): pids and clock ticks only compare within one."""
    try:
        with open(os.path.join(proc, "sys/kernel/random/boot_id")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def is_alive(pid: int, expected_start: Optional[int] = None, proc: str = PROC) -> bool:
    """True when `pid` exists, is not a zombie, and (if given) started at `expected_start` (no recycled PID)."""
    found = proc_info(pid, proc)
    return found is not None and (expected_start is None or found.start_time == int(expected_start))


def _pids(proc: str) -> List[int]:
    try:
        return [int(n) for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return []


def session_members(sid: int, proc: str = PROC, exclude: Sequence[int] = ()) -> List[int]:
    """Every live (non-zombie) process whose session id is `sid`, found by scanning /proc."""
    skip = set(exclude)
    out = []
    for pid in _pids(proc):
        found = proc_info(pid, proc) if pid not in skip else None
        if found is not None and found.sid == sid:
            out.append(pid)
    return out


def zombie_children(parent: int, proc: str = PROC) -> List[int]:
    """Zombies whose parent is `parent` (orphans reparented to a PID-1 or subreaper agent)."""
    out = []
    for pid in _pids(proc):
        found = read_stat(pid, proc)
        if found is not None and found.state == "Z" and found.ppid == parent:
            out.append(pid)
    return out


class ProcessSeam:
    """Every process syscall the supervisor and the reaper make, one small method each (tests swap in a fake)."""

    def __init__(self, proc: str = PROC, clock: Optional[Clock] = None) -> None:
        self.proc = proc
        self.clock = clock or SystemClock()  # the escalation's deadlines

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
        found = proc_info(pid, self.proc)
        if found is None:
            return None
        if expected_start is None or found.start_time != int(expected_start):
            return None  # a recycled PID: some other process now holds it
        return Child(pid=pid, sid=found.sid, pgid=found.pgid, start_time=found.start_time, ours=False)

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

    # ---- reading /proc: one process, a tree, an environment ------------------------------------------------
    def info(self, pid: int) -> Optional[ProcInfo]:
        """The live process `pid` (None when gone or a zombie)."""
        return proc_info(pid, self.proc)

    def start_time_of(self, pid: int) -> Optional[int]:
        """Start time of the live process `pid`, None when gone or a zombie."""
        found = self.info(pid)
        return found.start_time if found else None

    def pids(self) -> List[int]:
        return _pids(self.proc)

    def children(self, pid: int) -> List[int]:
        """Direct children of `pid`: /proc/<pid>/task/*/children (each thread's own), else a scan of every ppid."""
        out: List[int] = []
        try:
            tids = os.listdir("%s/%d/task" % (self.proc, pid))
        except OSError:
            return out
        for tid in tids:
            try:
                with open("%s/%d/task/%s/children" % (self.proc, pid, tid)) as f:
                    out.extend(int(x) for x in f.read().split())
            except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN (or the thread just ended)
                if not os.path.exists("%s/%d/task/%s" % (self.proc, pid, tid)):
                    continue
                return [p for p in self.pids() if (self.info(p) or _NOBODY).ppid == pid]
            except (OSError, ValueError):
                continue
        return out

    def descendants(self, root: ProcRef) -> List[ProcInfo]:
        """Every live process under `root` (not itself), while `root` is still that very process."""
        if self.start_time_of(root.pid) != root.start_time:
            return []
        out: List[ProcInfo] = []
        seen = {root.pid}
        todo = [root.pid]
        while todo:
            for pid in self.children(todo.pop()):
                found = self.info(pid)
                if found is None or pid in seen or found.start_time < root.start_time:
                    continue
                seen.add(pid)
                out.append(found)
                todo.append(pid)
        return out

    def environ(self, pid: int) -> Dict[str, str]:
        return environ_of(pid, self.proc)

    def marked(self, name: str, value: str) -> List[ProcInfo]:
        """Every live process whose (initial) environment has name=value: what inherited a marker, wherever it
        went (another session, reparented to init). Reads each process's environ: meant for rare calls."""
        needle = ("%s=%s" % (name, value)).encode("utf-8", "surrogateescape")
        out = []
        for pid in self.pids():
            try:
                with open("%s/%d/environ" % (self.proc, pid), "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
            except OSError:  # gone, or not ours to read (then not ours to signal either)
                continue
            found = self.info(pid)
            if found is not None:
                out.append(found)
        return out

    def command(self, pid: int) -> str:
        """The command line of `pid` (its comm in brackets when it has none), "" when gone."""
        try:
            with open("%s/%d/cmdline" % (self.proc, pid), "rb") as f:
                raw = f.read(4096)
        except OSError:
            raw = b""
        text = " ".join(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a)
        if text:
            return text[:200]
        found = self.info(pid)
        return "[%s]" % found.comm if found else ""

    def has_open(self, pid: int, path: str) -> bool:
        """True when process `pid` holds `path` open (one of /proc/<pid>/fd/* points at it)."""
        target = os.path.realpath(path)
        try:
            fds = os.listdir("%s/%d/fd" % (self.proc, pid))
        except OSError:
            return False
        for fd in fds:
            try:
                if os.readlink("%s/%d/fd/%s" % (self.proc, pid, fd)) == target:
                    return True
            except OSError:
                continue
        return False

    # ---- signalling what was found earlier ------------------------------------------------------------------
    def signal_process(self, ref: ProcRef, sig: int) -> bool:
        """Signal the process `ref` names, never another that got its pid since. False when it is gone."""
        pidfd = self._pidfd_open(ref.pid)
        try:
            # With a pidfd open first, a start time that still matches proves the pidfd is that process: the
            # signal then cannot reach a successor even if the process ends right now. Without one, a pid
            # recycled between this check and kill() is the (tiny) remaining window.
            if self.start_time_of(ref.pid) != ref.start_time:
                return False
            if pidfd is not None:
                try:
                    signal.pidfd_send_signal(pidfd, sig)  # type: ignore[attr-defined]
                    return True
                except (ProcessLookupError, PermissionError):
                    return False
            return self.signal_pid(ref.pid, sig)
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _pidfd_open(self, pid: int) -> Optional[int]:
        opener = getattr(os, "pidfd_open", None)
        if opener is None or not hasattr(signal, "pidfd_send_signal") or self.proc != PROC:
            return None
        try:
            return int(opener(pid))
        except OSError:  # gone (ESRCH), or a kernel without pidfds (ENOSYS)
            return None

    def catches(self, pid: int, sig: int) -> bool:
        """True when process `pid` has a handler for `sig` (SigCgt in /proc/<pid>/status)."""
        try:
            with open("%s/%d/status" % (self.proc, pid)) as f:
                for line in f:
                    if line.startswith("SigCgt:"):
                        return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
        except (OSError, ValueError, IndexError):
            pass
        return False

    # ---- stopping a session: the escalation over its members ------------------------------------------------
    def session_members(self, sid: int) -> List[int]:
        return session_members(sid, self.proc, exclude=(os.getpid(),))

    def _session_refs(self, sid: int, leader_start: Optional[int]) -> List[ProcRef]:
        """Members of session `sid` that started no earlier than its leader (when that start is known)."""
        out = []
        for pid in self.session_members(sid):
            st = self.start_time_of(pid)
            if st is not None and (leader_start is None or st >= int(leader_start)):
                out.append(ProcRef(pid, st))
        return out

    def kill_session(self, sid: int, timeout: float, log: Optional[Callable[[str], None]] = None,
                     leader_start: Optional[int] = None, also: Optional[Callable[[], List[ProcRef]]] = None,
                     on_step: Optional[Callable[[str, List[ProcRef], Stopped], None]] = None) -> Stopped:
        """TERM every process of session `sid` (and what `also()` names), wait up to `timeout` s, then KILL what
        is left: `escalate` over the session's members, on this seam's clock.

        Orphaned DataLoader/DDP workers are the usual GPU pinners (U11): they keep the session id after their
        parent died, so a /proc scan finds them where a process-group kill of a dead leader would not. What left
        the session (setsid, a double fork) is not found that way: `also` names it (the attempt's tracked tree
        and marker, onbox/supervisor/leftovers.py).
        `leader_start`: the start time (clock ticks) of the process that created the session. A session id is
        a pid, recycled once the session emptied: when a process with pid `sid` lives but started at another
        time, session `sid` is someone else's now and none of its members is touched; members that started
        before that leader cannot be of its session either.
        """
        session = True
        if leader_start is not None:
            now_leader = self.start_time_of(sid)
            if now_leader is not None and now_leader != int(leader_start):
                if log:
                    log("session %d was recycled (its leader pid started at another time): not touched" % sid)
                session = False

        me = os.getpid()

        def find() -> List[ProcRef]:
            refs = self._session_refs(sid, leader_start) if session else []
            for r in also() if also else []:
                if r not in refs and self.start_time_of(r.pid) == r.start_time:
                    refs.append(r)
            return [r for r in refs if r.pid not in (me, 1)]  # never the agent itself, never init

        return escalate(self, find, timeout, self.clock, what="leftover process(es)", log=log, on_step=on_step)

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
            found = read_stat(pid, self.proc)
            if found is not None and found.sid == my_sid:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
                reaped.append(pid)
            except ChildProcessError:
                pass
        return reaped


_NOBODY = ProcInfo(pid=0, ppid=-1, pgid=0, sid=0, start_time=0, comm="")
KILL_WAIT = 5.0  # seconds a KILLed process gets to go; one still there is stuck in the kernel (state D)


def escalate(seam: ProcessSeam, find: Callable[[], List[ProcRef]], timeout: float, clock: Clock, *,
             kill_timeout: float = KILL_WAIT, poll: Optional[float] = None, what: str = "process(es)",
             log: Optional[Callable[[str], None]] = None,
             on_step: Optional[Callable[[str, List[ProcRef], Stopped], None]] = None) -> Stopped:
    """TERM every process `find()` names, wait until `timeout` s have passed on the clock's monotonic time, then
    KILL what is left and give it `kill_timeout` s to go: the elastic agent's escalation, and onbox's only one.

    `find` is asked again while waiting: what appears meanwhile (a worker forked on the way out) gets its TERM too.
    A process counts as there while its pid's start time is the one found (a pid handed to another process is
    neither waited for nor hit: every signal goes through seam.signal_process); one that refuses a signal (another
    user's) is not waited for. Each step is logged (`what` names the processes) and, once its signals are out,
    reported to `on_step(step, processes, report)`: "SIGTERM" (again for newcomers), "SIGKILL", "survived".
    `poll`: seconds between checks; by default a twentieth of the timeout (5 to 50 ms), 10 ms after the KILL."""
    out = Stopped()

    def fresh(refs: List[ProcRef]) -> List[ProcRef]:
        return [r for r in refs if r not in out.commands]

    def send(refs: List[ProcRef], sig: int) -> None:
        name = signal_name(sig)
        for r in refs:
            if seam.signal_process(r, sig):
                result = "sent"
            elif seam.start_time_of(r.pid) == r.start_time:  # still there, and not ours to signal
                result = "denied"
                out.denied.append(r)
            else:
                result = "gone"
            out.signals.append((r, name, result))
        refused = [r.pid for r in refs if r in out.denied]
        if log and refused:
            log("%s refused by %d %s (not ours to signal): %s" % (name[3:], len(refused), what, refused))
        if on_step:
            on_step(name, refs, out)

    def term(refs: List[ProcRef]) -> None:
        for r in refs:
            out.commands[r] = seam.command(r.pid)
            out.found.append(r)
        if log:
            log("TERM to %d %s: %s" % (len(refs), what, ", ".join(
                "%d (%s)" % (r.pid, out.commands[r][:60]) for r in refs)))
        send(refs, signal.SIGTERM)

    def alive(refs: List[ProcRef]) -> List[ProcRef]:
        return [r for r in refs if seam.start_time_of(r.pid) == r.start_time]

    def wait(until: float, step: float) -> None:  # a last short step: the KILL comes at the deadline, not a poll late
        clock.sleep(min(step, max(0.0, until - clock.monotonic())))

    first = fresh(alive(find()))
    if not first:
        return out
    term(first)
    deadline = clock.monotonic() + max(0.0, timeout)
    while True:
        seam.reap_zombies()
        left = alive([r for r in find() if r not in out.denied])
        newcomers = fresh(left)
        if newcomers:
            term(newcomers)
            left = [r for r in left if r not in out.denied]
        if not left or clock.monotonic() >= deadline:
            break
        wait(deadline, poll if poll is not None else min(0.05, max(0.005, timeout / 20)))
    if left:
        if log:
            log("KILL to %d process(es) still alive %.1f s after TERM: %s" % (len(left), timeout,
                                                                           [r.pid for r in left]))
        out.killed = left
        send(left, signal.SIGKILL)
        kill_deadline = clock.monotonic() + kill_timeout
        while alive(left) and clock.monotonic() < kill_deadline:
            wait(kill_deadline, poll if poll is not None else 0.01)
            seam.reap_zombies()
        out.survived = alive(left)
        if out.survived:
            if log:
                log("still alive %.0f s after KILL (stuck in the kernel, state D?): %s"
                    % (kill_timeout, [r.pid for r in out.survived]))
            if on_step:
                on_step("survived", out.survived, out)
    seam.reap_zombies()
    return out


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
