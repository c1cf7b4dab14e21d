"""What every process of a hung attempt is doing, read before anything is stopped: the evidence a person needs to
fix the cause (which rank waits in which collective, which DataLoader worker is stuck).

For each process (torchrun AND its workers, their DataLoader workers: every process of the attempt, each known by
pid and start time), the best Python stack the box allows, in this order:
  1. `py-spy dump --pid P` when py-spy is on the agent's PATH (`pip install py-spy`: one static binary). It needs
     ptrace permission: root, CAP_SYS_PTRACE, or the same user with kernel.yama.ptrace_scope 0 (containers often
     drop it). A stopped process (state T) is read with --nonblocking: py-spy cannot pause it again.
  2. faulthandler, for a trainer that opted in: the agent gives every attempt ONBOX_STACKS_DIR, and a trainer that
     runs
         import faulthandler, os, signal
         if os.environ.get("ONBOX_STACKS_DIR"):
             faulthandler.register(signal.SIGUSR2, all_threads=True, file=open(os.path.join(
                 os.environ["ONBOX_STACKS_DIR"], "%d.txt" % os.getpid()), "w"))
     gets SIGUSR2 and dumps every thread's stack into its own file. The signal goes ONLY to a process whose file is
     there, was made after the process started (not a recycled pid's) and which has a handler for SIGUSR2
     (SigCgt): a signal to a trainer that did not opt in could kill it. Never to a stopped process.
  3. Always, from /proc: the state (`T (stopped)`, `D (disk sleep)`), wchan, the kernel stack where readable
     (root), the threads' states.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
from typing import Any, Dict, List, Mapping, Optional

from onbox import toolrun
from onbox.clock import Clock, SystemClock
from onbox.proc import ProcessSeam, ProcRef
from onbox.untrusted import printable

STACKS_VAR = "ONBOX_STACKS_DIR"
STACKS_SIGNAL = signal.SIGUSR2
PY_SPY_TIMEOUT = 10.0  # seconds one `py-spy dump` may take
DUMP_WAIT = 2.0  # seconds a faulthandler dump gets to appear
WORKERS = 8  # processes read at once
MAX_PROCESSES = 256  # a bound on the evidence: the first ones (by pid) are read
MAX_TEXT = 256 * 1024  # characters kept of one process's Python stack
MAX_THREADS = 1024


@dataclasses.dataclass
class ProcessStacks:
    """One process's evidence."""

    ref: ProcRef
    command: str = ""
    ppid: Optional[int] = None
    state: str = "?"
    wchan: str = ""
    threads: str = ""
    python: str = ""  # the Python stack as the method printed it
    method: str = "none"  # py-spy | faulthandler | none
    why_not: List[str] = dataclasses.field(default_factory=list)  # why a better method gave nothing
    kernel: str = ""

    def summary(self) -> Dict[str, Any]:
        """For the hang_detected event: who it is, where it waits, how its stack was read."""
        return {"pid": self.ref.pid, "command": self.command[:160], "state": self.state, "wchan": self.wchan,
                "method": self.method, "top": top_frame(self.python)}

    def text(self) -> str:
        out = ["== pid %d (start %d ticks) ppid %s · state %s · wchan %s · threads %s" % (
            self.ref.pid, self.ref.start_time, self.ppid, self.state, self.wchan or "-", self.threads or "-"),
            "cmd: %s" % printable(self.command)]
        if self.python:
            out += ["-- python stack (%s)" % self.method, printable(self.python.rstrip("\n"), keep_newlines=True)]
        for why in self.why_not:
            out.append("-- no python stack: %s" % printable(why))
        if self.kernel:
            out += ["-- kernel stack", printable(self.kernel.rstrip("\n"), keep_newlines=True)]
        return "\n".join(out) + "\n"


def top_frame(text: str) -> Optional[str]:
    """The innermost frame of the first thread in a py-spy or faulthandler dump: where the main thread waits."""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("File ") or (s.endswith(")") and "(" in s and not s.startswith(("Thread", "Process",
                                                                                          "Python"))):
            return s[:200]
    return None


def find_py_spy(environ: Mapping[str, str]) -> Optional[str]:
    """py-spy on the agent's PATH, or None."""
    return shutil.which("py-spy", path=environ.get("PATH") or os.defpath)


def capture(seam: ProcessSeam, refs: List[ProcRef], stacks_dir: Optional[str], py_spy: Optional[str],
            clock: Optional[Clock] = None, proc: str = "/proc") -> List[ProcessStacks]:
    """The evidence of each process of `refs` that is still that process, read in parallel (bounded)."""
    refs = sorted(refs, key=lambda r: r.pid)[:MAX_PROCESSES]
    clk = clock or SystemClock()
    with concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="onbox-stacks") as pool:
        found = list(pool.map(lambda r: read_one(seam, r, stacks_dir, py_spy, clk, proc), refs))
    return [f for f in found if f is not None]


def read_one(seam: ProcessSeam, ref: ProcRef, stacks_dir: Optional[str], py_spy: Optional[str], clock: Clock,
             proc: str = "/proc") -> Optional[ProcessStacks]:
    info = seam.info(ref.pid)
    if info is None or info.start_time != ref.start_time:
        return None  # gone, or its pid is another process's now
    out = ProcessStacks(ref, command=seam.command(ref.pid), ppid=info.ppid, state=_status_state(ref.pid, proc),
                        wchan=_read(proc, ref.pid, "wchan").strip().replace("\0", ""),
                        threads=_threads(proc, ref.pid), kernel=_kernel_stack(proc, ref.pid))
    stopped = out.state.startswith(("T", "t"))
    if py_spy:
        _py_spy(out, py_spy, stopped)
    else:
        out.why_not.append("py-spy is not on the agent's PATH (pip install py-spy)")
    if not out.python:
        _faulthandler(seam, out, stacks_dir, stopped, clock, proc)
    if seam.start_time_of(ref.pid) != ref.start_time:  # it ended while read: what was read may be another's
        return None
    return out


def _py_spy(out: ProcessStacks, py_spy: str, stopped: bool) -> None:
    for nonblocking in ([True] if stopped else [False, True]):
        argv = [py_spy, "dump", "--pid", str(out.ref.pid)] + (["--nonblocking"] if nonblocking else [])
        try:
            done = toolrun.call(argv, timeout=PY_SPY_TIMEOUT, text=True, stdin=toolrun.DEVNULL)
        except (OSError, toolrun.subprocess.TimeoutExpired) as e:
            out.why_not.append("py-spy: %s" % e)
            return
        if done.returncode == 0 and "Thread" in (done.stdout or ""):
            out.python, out.method = (done.stdout or "")[:MAX_TEXT], "py-spy"
            return
        err = [line for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        out.why_not.append("py-spy%s exited %d: %s" % (" --nonblocking" if nonblocking else "", done.returncode,
                                                        " / ".join(err[:3])[:300]))


def _faulthandler(seam: ProcessSeam, out: ProcessStacks, stacks_dir: Optional[str], stopped: bool, clock: Clock,
                  proc: str) -> None:
    """SIGUSR2 to a process that opted in (its own file in ONBOX_STACKS_DIR, a handler for the signal)."""
    if not stacks_dir:
        return
    path = os.path.join(stacks_dir, "%d.txt" % out.ref.pid)
    try:
        st = os.lstat(path)
    except OSError:
        out.why_not.append("faulthandler: not opted in (no %s; see ONBOX_STACKS_DIR in onbox/supervisor/README.md, 'Hung trainers')" % path)
        return
    started = _started_at(proc, out.ref.start_time)
    if not (os.path.isfile(path) and not os.path.islink(path)) or (started is not None and st.st_ctime < started - 0.05):
        out.why_not.append("faulthandler: %s is not this process's (older than its start, or no plain file)" % path)
        return
    if not seam.catches(out.ref.pid, STACKS_SIGNAL):
        out.why_not.append("faulthandler: the process has no handler for SIGUSR2: no signal sent")
        return
    if stopped:
        out.why_not.append("faulthandler: the process is stopped (state T): it cannot run its handler")
        return
    before = st.st_size
    if not seam.signal_process(out.ref, STACKS_SIGNAL):
        out.why_not.append("faulthandler: the process ended before the signal")
        return
    deadline = clock.monotonic() + DUMP_WAIT
    size, steady = before, 0
    while clock.monotonic() < deadline and steady < 2:  # the dump is written in pieces: wait until it stops growing
        clock.sleep(0.05)
        now = os.path.getsize(path) if os.path.exists(path) else before
        steady = steady + 1 if now == size and now > before else 0
        size = now
    if size <= before:
        out.why_not.append("faulthandler: SIGUSR2 sent, nothing dumped within %.0f s" % DUMP_WAIT)
        return
    with open(path, "rb") as f:
        f.seek(before)
        out.python = f.read(MAX_TEXT).decode("utf-8", "replace")
    out.method = "faulthandler"


def _read(proc: str, pid: int, name: str, limit: int = 65536) -> str:
    try:
        with open("%s/%d/%s" % (proc, pid, name), "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def _status_state(pid: int, proc: str) -> str:
    for line in _read(proc, pid, "status").splitlines():
        if line.startswith("State:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _kernel_stack(proc: str, pid: int) -> str:
    try:
        with open("%s/%d/stack" % (proc, pid)) as f:
            return f.read(65536)
    except OSError as e:
        return "(/proc/%d/stack not readable: %s)" % (pid, e.strerror or e)


def _threads(proc: str, pid: int) -> str:
    """`12: S 11, R 1; wchan futex_do_wait 11`: how many threads, in which states, waiting where."""
    try:
        tids = sorted(os.listdir("%s/%d/task" % (proc, pid)))[:MAX_THREADS]
    except OSError:
        return ""
    states: Dict[str, int] = {}
    waits: Dict[str, int] = {}
    for tid in tids:
        stat = _read(proc, pid, "task/%s/stat" % tid, 4096).rpartition(")")[2].split()
        if stat:
            states[stat[0]] = states.get(stat[0], 0) + 1
        w = _read(proc, pid, "task/%s/wchan" % tid, 256).strip().replace("\0", "")
        if w and w != "0":
            waits[w] = waits.get(w, 0) + 1
    text = "%d: %s" % (len(tids), ", ".join("%s %d" % kv for kv in sorted(states.items())))
    if waits:
        text += "; wchan " + ", ".join("%s %d" % kv for kv in sorted(waits.items(), key=lambda kv: -kv[1])[:4])
    return text


def _started_at(proc: str, start_ticks: int) -> Optional[float]:
    """A process's start as wall-clock time: the boot time (btime) plus its start ticks."""
    for line in _proc_stat(proc).splitlines():
        if line.startswith("btime "):
            try:
                return int(line.split()[1]) + start_ticks / float(os.sysconf("SC_CLK_TCK"))
            except (ValueError, OSError):
                return None
    return None


def _proc_stat(proc: str) -> str:
    try:
        with open(os.path.join(proc, "stat")) as f:
            return f.read(65536)
    except OSError:
        return ""


def render(header: List[str], gpus: Any, stacks: List[ProcessStacks]) -> str:
    """The stacks file: what was detected, the GPUs, then each process."""
    methods: Dict[str, int] = {}
    for s in stacks:
        methods[s.method] = methods.get(s.method, 0) + 1
    out = list(header)
    out.append("processes: %d (%s)" % (len(stacks), ", ".join("%s %d" % kv for kv in sorted(methods.items()))))
    out += ["", "== GPUs", json.dumps(gpus, indent=1, sort_keys=True, default=str), ""]
    out += [s.text() for s in stacks]
    return "\n".join(out)
