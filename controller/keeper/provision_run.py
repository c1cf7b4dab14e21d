"""Running the user's provision command: bounded in time, in output and in what it may leave behind.

`ProvisionRunner` is a runner for onbox.toolrun (the one tool runner: `PROVISION.run(..., runner=...)` keeps its
words for a command that is missing or timed out). It starts controller/keeper/provision_reaper.py, which runs the
command in a session and process group of its own, stdin closed, and stops whatever the command left running once
it ends, or once this runner stops it at its timeout (TERM to the reaper: it stops the command and its tree, TERM
then KILL after `grace` seconds). The reaper says what it stopped; `notes()` turns that into the keeper's
`provision_leftovers` event.

What the command prints is read here, in memory, from pipes: the last OUTPUT_MAX_BYTES (64 KiB) of stdout and of
stderr are kept, the rest is read and dropped as it comes (a command printing 300 MB costs neither 300 MB of memory
nor of disk, and a small TMPDIR changes nothing). A cut is said: `cut_note()` in a failure message, and a
`provision_output_cut` note otherwise.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from onbox import untrusted, vocab
from onbox.proc import KILL_WAIT

OUTPUT_MAX_BYTES = 64 * 1024  # of stdout, and of stderr: the contract's bound (provision.py)
REPORT_MAX_BYTES = 256 * 1024  # the reaper's own JSON lines (20 leftovers named at most)
LEFTOVER_GRACE = 2.0  # seconds a leftover gets between TERM and KILL
SLACK = 3.0  # seconds beyond its own bounds that the reaper gets before it is KILLed itself
START_BOUND = 30.0  # seconds the reaper may take to start the command (a Python interpreter starting, on a busy box)
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "provision_reaper.py")


class Tail:
    """The last `limit` bytes of a stream, and how many it carried in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > self.limit:
            del self.buf[:len(self.buf) - self.limit]

    @property
    def cut(self) -> bool:
        return self.total > self.limit


class ProvisionRunner:
    """Called as toolrun calls a runner: (argv, timeout=..., env=..., ...) -> CompletedProcess with the kept tails
    of stdout and stderr (bytes); FileNotFoundError / PermissionError when the command cannot be started,
    subprocess.TimeoutExpired when it was stopped at its timeout. After the call: `stopped` (what it left running,
    as the reaper said), `problem` (the reaper's own failure, if any)."""

    def __init__(self, limit: int = OUTPUT_MAX_BYTES, grace: float = LEFTOVER_GRACE,
                 kill_wait: float = KILL_WAIT) -> None:
        self.out = Tail(limit)
        self.err = Tail(limit)
        self.grace = grace
        self.kill_wait = kill_wait
        self.report: Dict[str, Any] = {}
        self.timed_out = False
        self.problem: Optional[str] = None

    # -- the call ----------------------------------------------------------------------------------------------
    def __call__(self, argv: Sequence[str], *, timeout: Optional[float] = None,
                 env: Optional[Dict[str, str]] = None, **_streams: Any) -> "subprocess.CompletedProcess[bytes]":
        r, w = os.pipe()
        try:
            helper = subprocess.Popen([sys.executable, "-I", REAPER, str(os.getpid()), str(w), repr(self.grace), "--",
                                       *argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env, pass_fds=(w,), start_new_session=True)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        try:
            self._read(helper, r, timeout)
        finally:
            os.close(r)
            self._end(helper)
        return self._result(argv, timeout)

    def _read(self, helper: "subprocess.Popen[bytes]", report_fd: int, timeout: Optional[float]) -> None:
        """Read the command's two streams and the reaper's report until all three close; at the timeout, TERM the
        reaper (it stops the command and what it started), and past the reaper's own bounds stop reading."""
        assert helper.stdout is not None and helper.stderr is not None
        raw = bytearray()
        sel = selectors.DefaultSelector()
        for fd, sink in ((helper.stdout.fileno(), self.out), (helper.stderr.fileno(), self.err), (report_fd, raw)):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, sink)
        # the timeout is the command's: it runs from the reaper's word that the command started (an interpreter
        # starting slowly on a loaded machine is not the command's time), that word itself bounded by START_BOUND
        deadline: Optional[float] = time.monotonic() + START_BOUND
        started = False
        hard: Optional[float] = None  # once the command ended or was stopped: the reaper's bound for its leftovers
        try:
            while sel.get_map():
                now = time.monotonic()
                said = self._parse(raw)
                if not started and ("started" in said or "error" in said):
                    started = True
                    deadline = now + timeout if timeout is not None else None
                if hard is None and ("exited" in said or "signal" in said or "error" in said):
                    hard = now + self.grace + self.kill_wait + SLACK  # ended by itself: no timeout any more
                if hard is None and deadline is not None and now >= deadline:
                    self.timed_out = True
                    if helper.poll() is None:
                        helper.send_signal(signal.SIGTERM)  # our child, not reaped yet: its pid is its own
                    hard = now + self.grace + self.kill_wait + SLACK
                if hard is not None and now >= hard:
                    self.problem = "what it left running was not all stopped within %.0f s" % (
                        self.grace + self.kill_wait + SLACK)
                    return
                until = hard if hard is not None else deadline
                for key, _ in sel.select(None if until is None else max(0.0, min(until - now, 1.0))):
                    try:
                        chunk = os.read(key.fd, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        sel.unregister(key.fd)
                    elif key.data is raw:
                        if len(raw) < REPORT_MAX_BYTES:
                            raw += chunk
                    else:
                        key.data.add(chunk)
        finally:
            sel.close()
            self._parse(raw)

    def _parse(self, raw: bytearray) -> Dict[str, Any]:
        """The reaper's report lines read so far, merged (each line is one JSON object)."""
        for line in bytes(raw).splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict):
                self.report.update(doc)
        return self.report

    def _end(self, helper: "subprocess.Popen[bytes]") -> None:
        """The reaper gone and reaped: it ends by itself once the command's leftovers are; when it does not within
        its bounds (or this keeper is interrupted), TERM, then KILL."""
        for f in (helper.stdout, helper.stderr):
            if f is not None:
                f.close()
        bound = self.grace + self.kill_wait + SLACK
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and helper.poll() is None:
                helper.send_signal(sig)
                if sig == signal.SIGKILL:
                    self.problem = self.problem or "its reaper did not end: KILLed (what it had not stopped may run on)"
            try:
                helper.wait(timeout=bound if sig is None else 5.0)
                return
            except subprocess.TimeoutExpired:
                continue

    def _result(self, argv: Sequence[str], timeout: Optional[float]) -> "subprocess.CompletedProcess[bytes]":
        error = self.report.get("error")
        if error == "missing":
            raise FileNotFoundError(argv[0])
        if error == "not_executable":
            raise PermissionError(argv[0])
        if error is not None:
            raise OSError("cannot start %s: %s" % (argv[0], self.report.get("text")))
        if self.timed_out and "exited" not in self.report and "signal" not in self.report:
            raise subprocess.TimeoutExpired(list(argv), timeout or 0.0, bytes(self.out.buf), bytes(self.err.buf))
        if "exited" in self.report:
            rc = int(self.report["exited"])
        elif "signal" in self.report:
            rc = -int(self.report["signal"])
        else:
            self.problem = self.problem or "its reaper ended without a word (exit %s)" % self.report.get("rc")
            rc = 255
        return subprocess.CompletedProcess(list(argv), rc, bytes(self.out.buf), bytes(self.err.buf))

    # -- what to say ---------------------------------------------------------------------------------------------
    def stopped(self) -> Tuple[int, List[str]]:
        """(how many processes the command left running, each named "pid (command)")."""
        listed = self.report.get("stopped")
        count = self.report.get("count")
        names = ["%s (%s)" % (e.get("pid"), untrusted.printable(str(e.get("command") or "?"))[:80])
                 for e in listed if isinstance(e, dict)] if isinstance(listed, list) else []
        return (count if isinstance(count, int) and not isinstance(count, bool) else len(names)), names

    def cut_note(self) -> str:
        """` (its stdout cut to its last 64 KiB of 300.0 MB; ...)` for a failure message, "" when nothing was cut."""
        cuts = ["its %s cut to its last %s of %s" % (name, untrusted.human(t.limit), _mb(t.total))
                for name, t in (("stdout", self.out), ("stderr", self.err)) if t.cut]
        return " (%s)" % "; ".join(cuts) if cuts else ""

    def notes(self) -> List[Tuple[str, str]]:
        """(kind, text) of the keeper events this try calls for: what was stopped, what was cut."""
        out: List[Tuple[str, str]] = []
        n, names = self.stopped()
        if n:
            survived = self.report.get("survived") or []
            out.append((vocab.KEPT_PROVISION_LEFTOVERS, "stopped %d process(es) the provision command left running: %s%s%s" % (
                n, ", ".join(names), " and %d more" % (n - len(names)) if n > len(names) else "",
                "; still running after KILL: %s" % survived if survived else "")))
        if self.problem:
            out.append((vocab.KEPT_PROVISION_LEFTOVERS, "the provision command's processes: %s" % self.problem))
        for name, t in (("stdout", self.out), ("stderr", self.err)):
            if t.cut:
                out.append((vocab.KEPT_PROVISION_OUTPUT_CUT, "the provision command printed %s on %s: only its last %s were "
                                                    "read" % (_mb(t.total), name, untrusted.human(t.limit))))
        return out


def _mb(n: int) -> str:
    return "%.1f MB" % (n / 1e6)
