"""The one way onbox and onboxctl run a tool (scontrol, sbatch, rclone, ssh, rsync), as submitit runs its commands
through `CommandFunction`: a list argv, never a shell string; a timeout; output captured; and each way a call
fails turned into the caller's domain error:

  the tool is not installed (FileNotFoundError)   -> `Tool.missing`
  it did not finish in time (TimeoutExpired)      -> `Tool.timed_out`
  it exited non-zero (when the call is checked)   -> `Tool.failed`, carrying the tail of its stderr

Each caller words its own messages and hints (a `Tool` per tool and caller, kept beside the code that calls it):
the runner decides when an error is raised, never what it says.

`runner` is the subprocess seam: anything called like `subprocess.run(argv, stdout=PIPE, stderr=PIPE, text=...,
timeout=...)` that returns a CompletedProcess; tests pass a recorder. The default is `call`.

A tool that runs beside onbox while onbox talks to it (`rclone rcd`) is a `Helper`: it dies with this process and
is stopped by its PID and start time, through onbox.proc (the one /proc reader and process seam; it imports
nothing of this module). Besides that, this module imports only onbox.errors.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import threading
from typing import IO, Any, Callable, List, Mapping, Optional, Sequence, Type, Union

from onbox.errors import JobFailed, OnboxError

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
Runner = Callable[..., "subprocess.CompletedProcess[Any]"]
Stream = Union[int, IO[Any], None]


def kill_group(proc: "subprocess.Popen[Any]") -> None:
    """SIGKILL a child started with start_new_session=True and everything in its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def call(argv: Sequence[str], *, timeout: Optional[float], input: Any = None, stdin: Stream = None,
         stdout: Stream = PIPE, stderr: Stream = PIPE, cwd: Optional[str] = None,
         env: Optional[Mapping[str, str]] = None, text: bool = False,
         start_new_session: bool = False) -> "subprocess.CompletedProcess[Any]":
    """subprocess.run, except that a tool started in a session of its own is killed with its whole process group at
    the timeout (ssh's ProxyCommand, the ssh that rsync starts), and is not killed when the caller is interrupted
    (Ctrl-C does not reach that session: what the tool does on the remote side runs to its end)."""
    p = subprocess.Popen(list(argv), stdin=PIPE if input is not None else stdin, stdout=stdout, stderr=stderr,
                         cwd=cwd, env=None if env is None else dict(env), text=text,
                         start_new_session=start_new_session)
    try:
        out, err = p.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        if start_new_session:
            kill_group(p)
        else:
            p.kill()
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(p.args, timeout or 0.0, output=out, stderr=err)
    except BaseException:
        if not start_new_session:  # as subprocess.run: an interrupted caller leaves no tool behind
            p.kill()
            p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


LINE_BREAK = re.compile(rb"[\r\n]")


def stream(argv: Sequence[str], *, timeout: Optional[float], on_line: Callable[[str], None], input: Any = None,
           stdin: Stream = None, stdout: Stream = PIPE, stderr: Stream = PIPE, cwd: Optional[str] = None,
           env: Optional[Mapping[str, str]] = None, text: bool = False, start_new_session: bool = False,
           interrupt_grace: float = 15.0) -> "subprocess.CompletedProcess[Any]":
    """`call` for a tool whose output is progress: each line of its stdout (ended by \n or \r, as rsync's and
    curl's meters are) goes to `on_line` as it comes, and stdout is not kept (CompletedProcess.stdout is None);
    stderr is. A watchdog thread kills the tool (with its group in a session of its own) once `timeout` s have
    passed, however much it printed: a stalled transfer ends with TimeoutExpired, as in `call`. A caller
    interrupted (Ctrl-C) passes SIGINT on to a tool in its own session and gives it `interrupt_grace` s to end
    cleanly (rsync then keeps its half-copied file for the next try) before it is killed."""
    if input is not None or stdout is not PIPE:
        raise ValueError("stream() reads the tool's stdout line by line and gives it no input")
    p = subprocess.Popen(list(argv), stdin=stdin, stdout=PIPE, stderr=stderr, cwd=cwd,
                         env=None if env is None else dict(env), start_new_session=start_new_session)
    assert p.stdout is not None
    errbuf: List[bytes] = []
    reader = threading.Thread(target=lambda: errbuf.append(p.stderr.read() if p.stderr else b""), daemon=True)
    reader.start()
    timed_out = threading.Event()

    def watchdog() -> None:  # at the timeout, unless the tool ended (and was reaped) first
        if p.poll() is None:
            timed_out.set()
            if start_new_session:
                kill_group(p)
            else:
                p.kill()

    timer = threading.Timer(timeout, watchdog) if timeout is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        try:
            buf = b""
            while True:
                chunk = p.stdout.read1(4096)  # type: ignore[attr-defined]
                if not chunk:
                    break
                *lines, buf = LINE_BREAK.split(buf + chunk)
                for line in lines:
                    on_line(line.decode("utf-8", "replace"))
            if buf:
                on_line(buf.decode("utf-8", "replace"))
        except BaseException:
            _interrupt(p, start_new_session, interrupt_grace)
            raise
        rc = p.wait()  # still under the watchdog: a tool may close its stdout and hang on
    finally:
        if timer is not None:
            timer.cancel()
    reader.join(timeout=5)  # a straggler of its group may hold stderr open: what came is enough
    p.stdout.close()
    if p.stderr is not None:
        p.stderr.close()
    err: Any = b"".join(errbuf)
    err = err.decode("utf-8", "replace") if text else err
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(p.args, timeout or 0.0, output=None, stderr=err)
    return subprocess.CompletedProcess(p.args, rc, None, err)


def _interrupt(p: "subprocess.Popen[bytes]", own_session: bool, grace: float) -> None:
    """A streaming caller interrupted (or its on_line raised): SIGINT to a tool in its own session (Ctrl-C never
    reached it) and up to `grace` s to end, its stdout drained meanwhile so its last words never hit a closed pipe;
    then, or at once for a tool in the caller's session, KILL."""
    if own_session:
        try:
            os.killpg(p.pid, signal.SIGINT)
        except (ProcessLookupError, PermissionError):
            return
        if p.stdout is not None:
            threading.Thread(target=p.stdout.read, daemon=True).start()
        try:
            p.wait(timeout=grace)
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            kill_group(p)
    else:
        p.kill()
    p.wait()


class Says:
    """How one kind of failure reads: a message and a hint, both str.format templates over the call's fields
    ({name} the tool, {cmd} the argv joined, {timeout}, {rc}, {stderr} its tail, and whatever the call passes);
    the error class when it is not the tool's own; extra keyword arguments for the error (e.g. errno_name)."""

    def __init__(self, message: str, hint: Optional[str] = None, error: Optional[Type[OnboxError]] = None,
                 **extra: Any) -> None:
        self.message = message
        self.hint = hint
        self.error = error
        self.extra = extra


def stderr_tail(chars: Optional[int] = None, lines: Optional[int] = None, sep: str = "\n", empty: str = "",
         or_stdout: bool = False) -> Callable[[str, str], str]:
    """What of (stderr, stdout) a failure message carries: stderr stripped (stdout when stderr is empty and
    `or_stdout`), its last `lines` lines joined by `sep`, then its last `chars` characters; `empty` when none."""
    def pick(err: str, out: str) -> str:
        text = ((err or out) if or_stdout else err or "").strip()
        if lines is not None:
            text = sep.join(text.splitlines()[-lines:])
        if chars is not None:
            text = text[-chars:]
        return text or empty
    return pick


NOT_INSTALLED = Says("{name} is not installed")
TIMED_OUT = Says("`{cmd}` did not finish within {timeout:.0f} s")
FAILED = Says("`{cmd}` failed (exit {rc}): {stderr}")
LAST_600 = stderr_tail(chars=600)


def _text(data: Any) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


@dataclasses.dataclass(frozen=True)
class Tool:
    """One tool as one caller runs it: its name, the caller's domain error, and how each failure reads."""

    name: str
    error: Type[OnboxError] = JobFailed
    missing: Says = NOT_INSTALLED
    timed_out: Says = TIMED_OUT
    failed: Says = FAILED
    tail: Callable[[str, str], str] = LAST_600

    def run(self, argv: Sequence[str], timeout: Optional[float], *, check: bool = True,
            runner: Optional[Runner] = None, input: Any = None, stdin: Stream = None, stdout: Stream = PIPE,
            stderr: Stream = PIPE, cwd: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
            binary: bool = False, new_session: bool = False, timed_out_rc: Optional[int] = None,
            on_line: Optional[Callable[[str], None]] = None, **fields: Any) -> "subprocess.CompletedProcess[Any]":
        """Run argv; raise the missing / timed-out error, and with `check` the failed one. `binary`: bytes out.
        `new_session`: the tool leads a session of its own (killed as a group, see `call`). `timed_out_rc`: a
        timeout is no error but a CompletedProcess with this exit code and what the tool wrote until then.
        `on_line`: each line of stdout as it comes, not kept (see `stream`). `fields`: the caller's own template
        fields."""
        argv = list(argv)
        kw: dict = dict(stdout=stdout, stderr=stderr, text=not binary, timeout=timeout)
        for key, value in (("input", input), ("stdin", stdin), ("cwd", cwd), ("env", env), ("on_line", on_line)):
            if value is not None:
                kw[key] = value
        if new_session:
            kw["start_new_session"] = True
        try:
            done = (runner or (call if on_line is None else stream))(argv, **kw)
        except FileNotFoundError:
            raise self._error(self.missing, argv, timeout=timeout, **fields)
        except subprocess.TimeoutExpired as e:
            if timed_out_rc is not None:
                return subprocess.CompletedProcess(argv, timed_out_rc, e.output, e.stderr)
            raise self._error(self.timed_out, argv, timeout=timeout, **fields)
        if check:
            self.check(done, **fields)
        return done

    def check(self, done: Any, **fields: Any) -> None:
        """Raise the failed error when `done` (a CompletedProcess, or anything with returncode, stdout and stderr)
        exited non-zero."""
        if done.returncode != 0:
            raise self.failure(done, **fields)

    def failure(self, done: Any, **fields: Any) -> OnboxError:
        """The failed error for a finished call (for callers that look at some exit codes themselves first)."""
        return self._error(self.failed, list(getattr(done, "args", None) or getattr(done, "argv", [])),
                           rc=done.returncode, stderr=self.tail(_text(done.stderr), _text(done.stdout)), **fields)

    def _error(self, says: Says, argv: Sequence[str], **fields: Any) -> OnboxError:
        values = dict(name=self.name, cmd=" ".join(map(str, argv)), **fields)
        hint = says.hint.format(**values) if says.hint is not None else None
        return (says.error or self.error)(says.message.format(**values), hint=hint, **says.extra)


PR_SET_PDEATHSIG = 1  # prctl(2)


class Helper:
    """A long-lived tool this process talks to while it runs (`rclone rcd`), where `Tool.run` is a call that runs to
    its end. It must never outlive this process, and it is stopped by its PID and start time only:

    - it is started from a thread of its own that stays, blocked on the helper's stderr, until the helper ends, and
      then reaps it. The helper gets PR_SET_PDEATHSIG (SIGKILL): the kernel kills it when the thread that started
      it ends, which is this thread, so only at the helper's own end or this process's (a SIGKILLed agent takes
      its helper along). The kernel counts the starting THREAD as the parent: a helper started by a worker thread
      that then finished would die with that worker.
    - the last lines of its stderr are kept (`tail`) for the error that says why it ended.
    - `stop`: TERM, a bounded wait, KILL; only from the process that started it (a forked child inherits this
      object, not the helper).
    Raises OSError from `start` (FileNotFoundError: the tool is not installed)."""

    def __init__(self, argv: Sequence[str], env: Optional[Mapping[str, str]] = None, tail_lines: int = 20) -> None:
        self.argv = list(argv)
        self.env = None if env is None else dict(env)
        self.pid: Optional[int] = None
        self.start_time: Optional[int] = None
        self.owner: Optional[int] = None  # the pid of the process that started it
        self.returncode: Optional[int] = None
        self._lines: "collections.deque[str]" = collections.deque(maxlen=tail_lines)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
        parent = os.getpid()

        def die_with_parent() -> None:  # in the child, between fork and exec
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the parent went before the prctl took: nothing would kill this one
                os._exit(1)

        started = threading.Event()
        failed: List[OSError] = []

        def own() -> None:
            try:
                p = subprocess.Popen(self.argv, stdin=DEVNULL, stdout=DEVNULL, stderr=PIPE, env=self.env,
                                     close_fds=True, preexec_fn=die_with_parent)
            except OSError as e:
                failed.append(e)
                started.set()
                return
            from onbox.proc import start_time

            self.pid, self.start_time, self.owner = p.pid, start_time(p.pid), parent
            started.set()
            assert p.stderr is not None
            with p.stderr:
                for line in p.stderr:  # until the helper ends (its stderr closes with it)
                    self._lines.append(line.decode("utf-8", "replace").rstrip())
            self.returncode = p.wait()

        self._thread = threading.Thread(target=own, name="onbox-helper-%s" % os.path.basename(self.argv[0]),
                                        daemon=True)
        self._thread.start()
        started.wait()
        if failed:
            raise failed[0]

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.owner == os.getpid()

    def tail(self, lines: int = 3) -> str:
        return " | ".join(list(self._lines)[-lines:])

    def stop(self, grace: float = 2.0, kill: bool = False) -> None:
        """TERM, up to `grace` s for it to go, then KILL (and as long again); `kill`: KILL at once. Nothing when it
        is gone already or was started by another process (this one a fork of it). Not proc.escalate: that reaps
        the zombies of other sessions while it waits, and in an agent one of them may be the trainer whose exit
        status the supervisor is about to collect; this waits on the thread that reaps the helper alone."""
        from onbox.proc import ProcessSeam, ProcRef

        if not self.running() or self.pid is None or self.start_time is None:
            return
        seam, ref = ProcessSeam(), ProcRef(self.pid, self.start_time)
        for sig in (signal.SIGKILL,) if kill else (signal.SIGTERM, signal.SIGKILL):
            if not seam.signal_process(ref, sig):
                break  # gone (the thread reaps it)
            assert self._thread is not None
            self._thread.join(grace)
            if not self._thread.is_alive():
                return
