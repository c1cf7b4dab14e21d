"""The keeper of an attempt's child (a shim, as containerd-shim and conmon are to a container): a small process
that starts the child as its own child, waits for it, and keeps its exit status where an agent can read it, so an
agent that was SIGKILLed and relaunched (or `onbox adopt`, `onbox stop` without an agent) records how the child
really ended instead of `unknown`. A process's exit status goes to its parent alone, through wait(), and only
while that parent lives; once the agent is gone, no one else can ever learn it.

Why a fork of the agent, and not the alternatives:
- an exit record written by a wrapper around the command (`sh -c 'cmd; echo $? >f'`): the wrapper would lead the
  session and group the agent signals (TERM would end the shell, not the trainer, and no record is written), and a
  wrapper that execs the command to keep the group is gone before the command ends;
- a shim program the agent execs (`python onbox.pyz shim ...`): the agent would have to find its interpreter and
  zipapp again, and under qemu user mode without binfmt (an aarch64 box emulated) an emulated interpreter cannot
  exec another aarch64 binary at all;
- ptrace, taskstats or process accounting: root or ptrace rights, and a traced trainer is one py-spy cannot read.
A fork needs nothing from the box, and is as portable as the agent itself.

What the keeper does (shimproc.keep), each step so that the child sees what it saw when the agent started it directly:
1. its signal handlers: the agent's wakeup fd is dropped (a signal to the keeper must not wake the agent), the
   signals whose default action ends a process get a handler that does nothing (a broadcast TERM or Slurm's USR1 to
   every process must not end the keeper before its child), an ignored one stays ignored; a handler becomes the
   default again at exec, so the child inherits exactly the dispositions it inherited from the agent. The signals
   stay blocked from the fork until then, and the agent's mask is restored before the child starts;
2. setsid(): a session of its own, so the attempt's stops (its session, its tree, its marker: leftovers.py) never
   reach it, and its environment is the agent's (no attempt marker);
3. every inherited descriptor closed but the report pipe (stdin/stdout/stderr on /dev/null): the run's lock, the
   peers' UDP port and the tracker's connections stay the agent's alone, so a relaunched agent takes them;
4. the child started by ProcessSeam.spawn itself: the same Popen in a new session and group, stdin /dev/null,
   output appended to output.log, close_fds, restore_signals (what the agent signals is the child's group, as before;
   the GPU reaper's owners, the hang watch's processes and the Slurm step see the same child);
5. `{"started": pid, "start_time": ticks}` on the pipe, then wait(), then `{"exit": {code, signal}}` on the pipe, then
   the exit record `child-exit.json` in the run dir (atomic; pid, start time, boot id, code, signal), then it exits.

The agent that started the keeper reads the pipe (poll; the loop also wakes on it). An adopting agent reads the
record of that very process (pid, start time, boot); while the child lives it waits, and once it is gone it waits up
to RECORD_GRACE for a keeper that still lives. Nothing is guessed: with no report and no record (the keeper was
killed), the exit is `unknown` and its message says why; but an agent that still lives is a child subreaper, so the
child of a killed keeper becomes its own child and its exit is waited for exactly.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import time
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from onbox import fsutil
from onbox.clock import Clock
from onbox.proc import PROC, Child, ExitStatus, ProcessSeam, boot_id, is_alive, read_stat, start_time
from onbox.supervisor.shimproc import SCHEMA, STAY, keep

START_TIMEOUT = 60.0  # seconds the agent waits for its keeper to say the child started (a fork and an exec)
RECORD_GRACE = 30.0  # seconds an adopter waits, once the child is gone, for the record of a keeper still alive
RECORD_MAX_BYTES = 4096
SHIM_NAME = b"onbox-shim"  # its comm (ps, top): the keeper runs the agent's code and keeps its command line


@dataclasses.dataclass
class LostExit(ExitStatus):
    """An exit status no one can know any more, and why (exits.classify says it in the exit's message)."""

    why: str = ""


@dataclasses.dataclass
class Keeper:
    """One attempt's keeper: its pid and start time (state.json's attempt `keeper`), the record it writes, the
    pipe it reports on (the agent that started it; None once read to its end, and for an adopted child) and the
    boot its child ran in."""

    pid: int
    start_time: Optional[int]
    record: str
    fd: Optional[int] = None
    boot: Optional[str] = None
    status: Optional[ExitStatus] = None
    gone_at: Optional[float] = None  # monotonic: when the child was first seen gone without a word of its exit
    buf: bytes = b""

    def to_dict(self) -> Dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time}


@dataclasses.dataclass
class KeptChild(Child):
    """A Child started (or adopted) under a keeper."""

    keeper: Optional[Keeper] = None


class KeptProcessSeam(ProcessSeam):
    """The process seam of a run's attempts: every child starts under a keeper that writes its exit to `record`."""

    def __init__(self, record: str, proc: str = PROC, clock: Optional[Clock] = None) -> None:
        super().__init__(proc, clock)
        self.record = record

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str], log_path: str) -> KeptChild:
        """Fork the keeper, which starts argv as ProcessSeam.spawn would; OSError/ValueError as Popen raises them."""
        # imported here, never for the first time in the keeper: an import after a fork can wait forever on a lock
        # another thread of the agent held when it forked
        import gc  # noqa: F401
        import subprocess  # noqa: F401

        argv, env = list(argv), dict(env)
        boot = boot_id(self.proc)
        namer = _namer()
        r, w = os.pipe()
        stay = [s for s in STAY if s in signal.valid_signals()] + [signal.SIGCHLD]
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, stay)  # none reaches the keeper before its handlers change
        try:
            with warnings.catch_warnings():  # 3.12+ warns of fork() beside threads: the keeper runs none of theirs
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(r)
            os.close(w)
            raise
        if pid == 0:  # the keeper: never returns into the agent's stack
            code = 1
            try:
                code = keep(self, argv, env, cwd, log_path, self.record, w, mask, namer, boot)
            finally:
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(w)
        keeper = Keeper(pid=pid, start_time=start_time(pid, self.proc), record=self.record, fd=r, boot=boot)
        msg = self._first_word(keeper)
        if "started" not in msg:
            self._close(keeper, wait=True)
            if msg.get("error") == "value":
                raise ValueError(str(msg.get("message")))
            raise OSError(msg.get("errno") or 0, str(msg.get("strerror") or "the child's keeper ended before it "
                                                                           "started the child"), msg.get("filename"))
        os.set_blocking(r, False)
        child_pid = int(msg["started"])
        return KeptChild(pid=child_pid, sid=child_pid, pgid=child_pid, start_time=msg.get("start_time"),
                         keeper=keeper)

    def _first_word(self, keeper: Keeper) -> Dict[str, Any]:
        """The keeper's first report (started, or why not), {} when it ended or stayed silent (then it is killed)."""
        deadline = time.monotonic() + START_TIMEOUT
        assert keeper.fd is not None
        while b"\n" not in keeper.buf:
            left = deadline - time.monotonic()
            ready = select.select([keeper.fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:  # not reaped yet, so its pid is still its own: no start time to check
                os.kill(keeper.pid, signal.SIGKILL)
                return {}
            chunk = os.read(keeper.fd, 4096)
            if not chunk:
                return {}
            keeper.buf += chunk
        line, _, keeper.buf = keeper.buf.partition(b"\n")
        msg = _parse(line)
        return msg if msg is not None else {}

    # ---- the child's end ---------------------------------------------------------------------------------------
    def poll(self, child: Child) -> Optional[ExitStatus]:
        """The child's exit once it has ended: its keeper's report, else its exit record, else (the keeper gone
        with neither) this agent's own wait of it, else a LostExit saying why. None while it runs."""
        keeper = getattr(child, "keeper", None)
        if keeper is None:
            return super().poll(child)
        if keeper.status is not None:
            return keeper.status
        if keeper.fd is not None:
            self._read(keeper)
            if keeper.status is not None or keeper.fd is not None:
                return keeper.status
        return self._unreported(child, keeper)

    def _read(self, keeper: Keeper) -> None:
        assert keeper.fd is not None
        try:
            while True:
                chunk = os.read(keeper.fd, 4096)
                if not chunk:  # the keeper is gone: what it said is all there is
                    self._close(keeper, wait=False)
                    break
                keeper.buf += chunk
        except BlockingIOError:
            pass
        while b"\n" in keeper.buf:
            line, _, keeper.buf = keeper.buf.partition(b"\n")
            msg = _parse(line)
            ended = msg.get("exit") if msg else None
            if isinstance(ended, dict):
                keeper.status = ExitStatus(code=_int(ended.get("code")), signal=_int(ended.get("signal")))
                self._close(keeper, wait=False)

    def _close(self, keeper: Keeper, wait: bool) -> None:
        """Done with the keeper's pipe; reap the keeper if it has ended (it is this agent's child)."""
        if keeper.fd is not None:
            os.close(keeper.fd)
            keeper.fd = None
        try:
            os.waitpid(keeper.pid, 0 if wait else os.WNOHANG)
        except ChildProcessError:  # reaped already (the loop reaps orphans of other sessions)
            pass

    def _unreported(self, child: Child, keeper: Keeper) -> Optional[ExitStatus]:
        if child.start_time is not None and is_alive(child.pid, child.start_time, self.proc):
            return None
        found = read_record(keeper.record, child, keeper.boot)
        if found is None:
            found = self._wait_own(child)
        if found is not None:
            keeper.status = found
            return found
        now = self.clock.monotonic()
        if keeper_alive(keeper, self.proc):
            keeper.gone_at = now if keeper.gone_at is None else keeper.gone_at
            if now - keeper.gone_at < RECORD_GRACE:
                return None  # it is writing the record now
            why = "its keeper (pid %d) wrote no exit record within %.0f s of the child's end" % (keeper.pid,
                                                                                                 RECORD_GRACE)
        else:
            found = read_record(keeper.record, child, keeper.boot)  # written just before the keeper went
            if found is not None:
                keeper.status = found
                return found
            why = ("its keeper (pid %d), the one process that could wait for it, was gone before it (killed?)"
                   % keeper.pid)
        keeper.status = LostExit(why="the child ended and its exit status cannot be known: %s" % why)
        return keeper.status

    def _wait_own(self, child: Child) -> Optional[ExitStatus]:
        """The child as this agent's own zombie (its keeper died while this agent, a child subreaper, lived): its
        exact status. Only that very process is waited for: a zombie of this pid and start time whose parent is
        this agent (no other process can hold a zombie's pid)."""
        found = read_stat(child.pid, self.proc)
        if found is None or found.live or found.ppid != os.getpid() or found.start_time != child.start_time:
            return None
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            return None
        return ExitStatus.from_wait(status) if pid else None


def release(child: Optional[Child]) -> None:
    """The attempt is over for the agent: its keeper's pipe is closed (the keeper finishes on its own)."""
    keeper = getattr(child, "keeper", None)
    if keeper is not None and keeper.fd is not None:
        os.close(keeper.fd)
        keeper.fd = None


def wake_fd(child: Optional[Child]) -> Optional[int]:
    """The pipe the loop may wait on: readable once the keeper reports the child's exit (or ends)."""
    keeper = getattr(child, "keeper", None)
    return keeper.fd if keeper is not None and keeper.status is None else None


def keeper_alive(keeper: Keeper, proc: str = PROC) -> bool:
    return keeper.start_time is not None and keeper.boot in (None, boot_id(proc)) and \
        is_alive(keeper.pid, keeper.start_time, proc)


def read_record(path: str, child: Child, boot: Optional[str]) -> Optional[ExitStatus]:
    """The exit status the record holds for that very child (pid, start time and boot match), else None."""
    if child.start_time is None:
        return None
    try:
        doc = fsutil.read_json(path, RECORD_MAX_BYTES, "child exit record")
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or _int(doc.get("pid")) != child.pid \
            or _int(doc.get("start_time")) != child.start_time or (boot and doc.get("boot_id") != boot):
        return None
    code, sig = _int(doc.get("code")), _int(doc.get("signal"))
    if (code is None) == (sig is None):
        return None
    return ExitStatus(code=code, signal=sig)


def recorded_child(state: Mapping[str, Any], record: str, live: Optional[Child]) -> Optional[Child]:
    """The current attempt's child as state.json records it, under its keeper (a KeptChild): `live` (the process
    seam's adoption of it) while it runs; once it has ended, when its exit can still be known (a record of it, or
    a keeper still alive to write one). An attempt without a keeper (an older agent's) or whose exit is recorded:
    `live` as it is."""
    attempts = state.get("attempts") or []
    att = attempts[-1] if isinstance(attempts, list) and attempts and isinstance(attempts[-1], dict) else {}
    k = att.get("keeper")
    pid, start = _int(state.get("child_pid")), _int(state.get("child_start_time"))
    if not isinstance(k, dict) or _int(k.get("pid")) is None or att.get("exit") is not None or pid is None \
            or _int(att.get("pid")) != pid or _int(att.get("start_time")) != start:
        return live
    boot = att.get("boot_id") if isinstance(att.get("boot_id"), str) else None
    keeper = Keeper(pid=int(k["pid"]), start_time=_int(k.get("start_time")), record=record, boot=boot)
    sid, pgid = (live.sid, live.pgid) if live is not None else (_int(att.get("sid")) or pid,
                                                                _int(att.get("pgid")) or pid)
    child = KeptChild(pid=pid, sid=sid, pgid=pgid, start_time=start, ours=False, keeper=keeper)
    if live is not None or read_record(record, child, boot) is not None or keeper_alive(keeper):
        return child
    return None  # ended, its keeper gone without a record: nothing can be learned (a relaunch starts afresh)

def _parse(line: bytes) -> Optional[Dict[str, Any]]:
    try:
        msg = json.loads(line.decode("utf-8", "replace"))
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _namer() -> Optional[Callable[[], None]]:
    """prctl(PR_SET_NAME) for the keeper, bound in the agent (ctypes is loaded before the fork); None without it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return lambda: libc.prctl(15, SHIM_NAME, 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        return None
