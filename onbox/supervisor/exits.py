"""What an attempt's exit means: success, failure with a code, killed by a (named) signal, host OOM, CUDA OOM,
NCCL timeout and other causes recognisable from the log tail, preempted.

`classify()` is pure: it takes the exit status, the oom_kill counter before and after, and the log tail.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from onbox import vocab
from onbox.proc import ExitStatus, signal_name

# The classifications are the run's vocabulary (onbox/vocab.py: the crash-loop alert, the keeper and onboxctl
# read them); named here as the supervisor has always named them.
SUCCESS = vocab.EXIT_SUCCESS
FAILED = vocab.EXIT_FAILED  # non-zero exit code, cause not recognised
SIGNALED = vocab.EXIT_SIGNALED  # killed by a signal, cause not recognised
HOST_OOM = vocab.EXIT_HOST_OOM
CUDA_OOM = vocab.EXIT_CUDA_OOM
NCCL_TIMEOUT = vocab.EXIT_NCCL_TIMEOUT
NCCL_ERROR = vocab.EXIT_NCCL_ERROR
DISK_FULL = vocab.EXIT_DISK_FULL
GPU_ERROR = vocab.EXIT_GPU_ERROR
NO_GPU_RUNTIME = vocab.EXIT_NO_GPU_RUNTIME  # a container job: docker cannot give the container GPUs (exit 125)
PREEMPTED = vocab.EXIT_PREEMPTED
STOPPED = vocab.EXIT_STOPPED
SESSION_LIMIT = vocab.EXIT_SESSION_LIMIT  # the run's deadline (supervisor/deadline.py): a relaunch continues
FENCED = vocab.EXIT_FENCED  # a newer lease holds the run: the agent stopped its own trainer
UNKNOWN = vocab.EXIT_UNKNOWN  # the exit status cannot be known: an adopted child whose keeper died (shim.py)
HUNG = vocab.EXIT_HUNG  # no step, no output, no checkpoint write past its bound: the agent stopped it (hang.py)
# failures that no restart can mend (the host must be changed first): the run fails at the first one, with its fix,
# instead of spending its backoffs and restarts on the same refusal
RESTART_CANNOT_FIX = frozenset({NO_GPU_RUNTIME})

# U10: CUDA OOM is not host OOM; the fit-it ladder is the fix.
FIT_IT_LADDER = ("the fit-it ladder: lower the per-device batch size (keep the effective batch with gradient "
                 "accumulation), enable activation checkpointing, train in bf16/fp16, set "
                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and check for processes still holding VRAM "
                 "(`onbox reap`, U11)")

# (classification, compiled pattern, what it means, what to do). First match wins; ordered most specific first.
LOG_PATTERNS: List[Tuple[str, "re.Pattern[str]", str, str]] = [
    (CUDA_OOM, re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|"
                          r"cudaErrorMemoryAllocation|HIP out of memory"),
     "CUDA out of memory (VRAM, not host RAM)", FIT_IT_LADDER),
    (NCCL_TIMEOUT, re.compile(r"Watchdog caught collective operation timeout|NCCL.{0,80}[Tt]imeout|"
                              r"ProcessGroupNCCL.{0,80}timed out|collective operation timeout"),
     "NCCL collective timed out (a rank hung or the network stalled)",
     "check that every rank is alive and on the right NIC (NCCL_SOCKET_IFNAME), look for a straggler, "
     "consider NCCL_DEBUG=INFO; a hang that repeats is not fixed by restarting"),
    (NCCL_ERROR, re.compile(r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|"
                            r"ncclRemoteError"),
     "NCCL communication error", "run with NCCL_DEBUG=INFO and check the interconnect and driver versions"),
    (GPU_ERROR, re.compile(r"fallen off the bus|Xid.{0,20}\b(48|79)\b|uncorrectable ECC error|"
                           r"CUDA error: unspecified launch failure|no CUDA-capable device"),
     "the GPU failed (Xid / ECC / fell off the bus)", "U22: re-rent the box, do not debug a dead card"),
    # U31: a daemon without the NVIDIA Container Toolkit refuses `--gpus` (docker's own exit 125: the trainer never
    # started); the messages are dockerd's and the toolkit's, as a real daemon prints them.
    (NO_GPU_RUNTIME, re.compile(r"could not select device driver .{0,40}capabilities: \[\[gpu\]\]|"
                                r"unknown or invalid runtime name: nvidia|nvidia-container-cli: initialization error"),
     "docker cannot give the container GPUs (no NVIDIA Container Toolkit on this host, or no driver)",
     "U31: install the NVIDIA Container Toolkit and register it with Docker (`nvidia-ctk runtime configure "
     "--runtime=docker`, then restart dockerd); a job meant for the CPU: set CUDA_VISIBLE_DEVICES= (empty) and "
     "onbox adds no --gpus"),
    (DISK_FULL, re.compile(r"No space left on device|basic_ios::clear: iostream error|Disk quota exceeded"),
     "the disk is full (bytes or inodes)",
     "U6/U7: free space (check df -h AND df -i), prune old checkpoints, or commit them to durable storage"),
]

PYTHON_EXC = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)|KeyboardInterrupt)(:.*)?$")


@dataclasses.dataclass
class Classification:
    """The meaning of one exit, recorded in state.json `attempts[].exit` and `last_exit`."""

    classification: str
    code: Optional[int] = None
    signal: Optional[int] = None
    message: str = ""
    hint: str = ""

    @property
    def failed(self) -> bool:
        return self.classification not in (SUCCESS, PREEMPTED, STOPPED, FENCED, SESSION_LIMIT)

    @property
    def loop_key(self) -> str:
        """Failures of the same key in a row make a crash loop (a code-1 crash differs from a code-2 one)."""
        if self.classification == FAILED:
            return "%s:%s" % (FAILED, self.code)
        if self.classification == SIGNALED:
            return "%s:%s" % (SIGNALED, self.signal)
        return self.classification

    def to_dict(self) -> Dict[str, Any]:
        return {"code": self.code, "signal": self.signal, "signal_name": signal_name(self.signal) if self.signal
                else None, "classification": self.classification, "message": self.message, "hint": self.hint}


def oom_kill_count(root: str = "/", pid: str = "self") -> Optional[int]:
    """The oom_kill counter of the agent's memory cgroup (U41: the authoritative "was I OOM-killed"), or None.

    Read through the one cgroup reader (telemetry/host.py: v1, v2, hybrid, a container's own subtree); it
    returns None for what a box lacks, so a box without a memory controller degrades cleanly.
    """
    from onbox.telemetry.host import read_cgroup

    return read_cgroup(root=root, pid=pid).oom_kill


def fenced_exit(status: Optional[ExitStatus], fence: Dict[str, Any]) -> Classification:
    """The exit of a run a newer lease took over (`fence`: the fenced event's fields); `status` None: no child
    was running (a backoff, or before the attempt started)."""
    where = fence.get("newer_holder") or "?"
    if fence.get("host"):
        where = "%s (%s)" % (where, fence["host"])
    what = "the child was stopped (%s)" % describe_status(status) if status is not None else "no child was running"
    return Classification(FENCED, status.code if status else None, status.signal if status else None,
                          "fenced: lease epoch %s of %s holds the run now (this agent's was epoch %s); %s" % (
                              fence.get("newer_epoch"), where, fence.get("epoch"), what),
                          "the run continues on %s; nothing to do on this box" % where)


HANG_HINT = ("read the stacks file: the frame each process waits in tells which rank or worker is stuck (a rank "
             "still in all_reduce while another is not is the straggler or the dead one; a main process waiting on a "
             "DataLoader queue has a stuck worker); a hang that repeats is not fixed by restarting: check the "
             "interconnect (NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO), the workers (num_workers, U9) and the GPUs (Xid)")


def hung_exit(status: ExitStatus, hang: Dict[str, Any]) -> Classification:
    """The exit of an attempt the hang watch stopped (`hang`: the hang_detected event's fields; `peer` in them:
    a peer node's judgement, the group restarts together)."""
    where = hang.get("stacks") or hang.get("stacks_problem") or "not captured"
    peer = hang.get("peer")
    if isinstance(peer, dict):
        return Classification(HUNG, status.code, status.signal,
                              "hung with its group: node %s judged it hung (no new step for %.0f s there, bound %.0f "
                              "s); the agent stopped every process of this node's attempt so that the group restarts "
                              "together; stacks here: %s, node %s's: %s" % (
                                  peer.get("node"), peer.get("quiet_s") or 0, peer.get("bound_s") or 0, where,
                                  peer.get("node"), peer.get("stacks") or "not captured"), HANG_HINT)
    return Classification(HUNG, status.code, status.signal,
                          "hung: no new step and no output for %.0f s at step %s (%s; bound %.0f s: %s); the agent "
                          "stopped every process of the attempt; stacks: %s" % (
                              hang.get("quiet_s") or 0, hang.get("step"), hang.get("phase"), hang.get("bound_s") or 0,
                              hang.get("rule"), where), HANG_HINT)


def session_limit_exit(status: Optional[ExitStatus], hint: str = "") -> Classification:
    """The exit of a run its deadline stopped (supervisor/deadline.py); `status` None: no child was running (a
    backoff). The hint (how to continue, naming the checkpoint) is the supervisor's, once the final commit ran."""
    what = "child ended (%s)" % describe_status(status) if status is not None else "no child was running"
    return Classification(SESSION_LIMIT, status.code if status else None, status.signal if status else None,
                          "session limit: the deadline is near; checkpoint requested, %s" % what,
                          hint or "relaunch to continue: it resumes from its newest checkpoint")


def classify(status: ExitStatus, log_tail: Sequence[str] = (), oom_before: Optional[int] = None,
             oom_after: Optional[int] = None, preempted: bool = False, stopped: bool = False,
             fenced: Optional[Dict[str, Any]] = None, session_limit: bool = False,
             hung: Optional[Dict[str, Any]] = None) -> Classification:
    """Turn an exit status plus evidence into a Classification with a message and a hint. `fenced`: the stop was
    a fence's (its event's fields); `session_limit`: the run's deadline asked for it (session_limit_exit); `hung`:
    the hang watch stopped it (hung_exit)."""
    code, sig = status.code, status.signal
    if fenced is not None:
        return fenced_exit(status, fenced)
    if hung is not None:
        return hung_exit(status, hung)
    if session_limit:
        return session_limit_exit(status)
    if preempted:
        return Classification(PREEMPTED, code, sig, "preempted: checkpoint requested, child ended (%s)"
                              % describe_status(status),
                              # not "the run restarts": only a relaunch or a scheduler's requeue brings it back
                              "a relaunch (or a scheduler's requeue) resumes it from its newest checkpoint")
    if stopped:
        return Classification(STOPPED, code, sig, "stopped on request (%s)" % describe_status(status))
    if code == 0:
        return Classification(SUCCESS, 0, None, "exited 0")
    # U9/U41: a bare SIGKILL with the cgroup oom_kill counter rising is the kernel OOM killer.
    oom_rose = oom_before is not None and oom_after is not None and oom_after > oom_before
    if oom_rose and (sig == 9 or code == 137 or (code is None and sig is None)):
        return Classification(HOST_OOM, code, sig,
                              "host OOM: killed by the kernel OOM killer (cgroup oom_kill %d -> %d)"
                              % (oom_before or 0, oom_after or 0),
                              "U9: host RAM, not VRAM: lower DataLoader num_workers, share big in-RAM objects "
                              "(memmap) instead of copying them into every worker, or rent more RAM")
    lines = list(log_tail)
    for kind, pattern, meaning, hint in LOG_PATTERNS:
        for line in reversed(lines):
            if pattern.search(line):
                return Classification(kind, code, sig, "%s (%s): %s" % (meaning, describe_status(status),
                                                                          line.strip()[:200]), hint)
    if code is None and sig is None:  # a LostExit (supervisor/shim.py) says why
        return Classification(UNKNOWN, None, None,
                              getattr(status, "why", "") or "the child ended while adopted; its exit status cannot "
                                                            "be known",
                              "see the end of the output log (`onbox logs NAME`)")
    exc = last_exception(lines)
    if sig is not None:
        return Classification(SIGNALED, None, sig, "Signal %d (%s) received by the child" % (sig, signal_name(sig))
                              + ("; last error: %s" % exc if exc else ""),
                              "a SIGKILL with no OOM record is usually a manual kill or the platform (U3)")
    return Classification(FAILED, code, None, "exited with code %s" % code + (": %s" % exc if exc else ""),
                          "see the end of the output log (`onbox logs NAME`)")


def describe_status(status: ExitStatus) -> str:
    if status.signal is not None:
        return "Signal %d (%s)" % (status.signal, signal_name(status.signal))
    if status.code is not None:
        return "exit code %d" % status.code
    return "exit status unknown"


def last_exception(lines: Sequence[str]) -> str:
    """The final `SomeError: message` line of a Python traceback in the tail, or ''."""
    for line in reversed(lines):
        text = line.strip()
        if PYTHON_EXC.match(text):
            return text[:200]
    return ""
