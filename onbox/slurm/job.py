"""The agent inside a Slurm job: who the job is, what its run is called, when it ends (its EndTime: the run's
deadline, onbox/launch/deadline.py), and how it puts itself back in the queue.

Facts (Slurm's docs): SLURM_RESTART_COUNT is ABSENT on the first run, 1 on the second; `scontrol requeue
$SLURM_JOB_ID` puts a running job back in the queue (with `--requeue`); an array task's SLURM_JOB_ID is its own id,
so requeueing it requeues only that task. A requeue is for preemption and the time limit only: a job that finished,
or failed for its own reasons, is never requeued (a crash loop is not a preemption).

Multi-node: one agent per node (`srun --ntasks-per-node=1`). Node 0 / rank 0 is the primary: it alone commits
checkpoints and requeues; every agent reports heartbeats. Non-primary agents run as `<run>.node<N>` so their
heartbeats and run dirs do not collide with the primary's. The node role and the restore-only hook are shared
with SSH node groups (onbox/multinode/).
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox import vocab
from onbox.errors import JobFailed
from onbox.multinode.hooks import PrimaryOnlyCommits, for_role
from onbox.multinode.role import NodeRole, node_run_name
from onbox.toolrun import Says, Tool, stderr_tail

__all__ = ["PrimaryOnlyCommits", "SlurmError", "SlurmJob", "checkpoint_hook_for_node", "requeue"]

SESSION_LIMIT = "session_limit"  # the notice source of a run's deadline (onbox/supervisor/deadline.py)
END_TIME_TIMEOUT = 10.0  # seconds `scontrol show job` may take at a launch
REQUEUE_TIMEOUT = 30.0  # seconds; scontrol answers in milliseconds unless slurmctld is unreachable


class SlurmError(JobFailed):
    """A Slurm client command failed; the message carries its stderr."""


def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    try:
        return int(environ.get(key, "") or default)
    except ValueError:
        return default


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """The Slurm job this process runs in, read from its environment (one typed reader for every SLURM_* var)."""

    job_id: str
    array_job_id: Optional[str] = None
    array_task_id: Optional[str] = None
    restart_count: int = 0  # SLURM_RESTART_COUNT, absent on the first run -> 0
    node_list: Optional[str] = None  # SLURM_JOB_NODELIST, e.g. "node[01-04]"
    num_nodes: int = 1
    node_id: int = 0  # SLURM_NODEID: this node's index in the allocation
    proc_id: int = 0  # SLURM_PROCID: this task's global rank (0 in the batch shell)
    job_name: Optional[str] = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Optional["SlurmJob"]:
        """The job, or None when not inside Slurm (no SLURM_JOB_ID)."""
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if not job_id:
            return None
        task = environ.get("SLURM_ARRAY_TASK_ID") or None
        return cls(
            job_id=job_id,
            array_job_id=(environ.get("SLURM_ARRAY_JOB_ID") or None) if task is not None else None,
            array_task_id=task,
            restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
            node_list=environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or None,
            num_nodes=_int(environ, "SLURM_JOB_NUM_NODES", _int(environ, "SLURM_NNODES", 1)),
            node_id=_int(environ, "SLURM_NODEID", 0),
            proc_id=_int(environ, "SLURM_PROCID", 0),
            job_name=environ.get("SLURM_JOB_NAME") or None,
        )

    @property
    def is_array_task(self) -> bool:
        return self.array_task_id is not None

    @property
    def is_primary(self) -> bool:
        """Node 0 / rank 0: the one agent that commits checkpoints and requeues the job."""
        return self.node_id == 0 and self.proc_id == 0

    def role(self) -> NodeRole:
        """This node's role in the job (onbox/multinode/role.py: the notion the SSH groups share)."""
        return NodeRole(rank=self.node_id, nnodes=self.num_nodes, source="slurm", primary=self.is_primary)

    def run_name(self, base: Optional[str] = None) -> str:
        """The run this job continues: the same on every requeue, one per array task, one per node.

        No base: `slurm-<job>` or `slurm-<array job>_<task>`. With a base (the user's --name): `<base>` or
        `<base>-<task>`. A non-primary node adds `.node<N>`. `onbox sbatch` scripts compute the same in bash.
        """
        if base:
            name = "%s-%s" % (base, self.array_task_id) if self.is_array_task else base
        elif self.is_array_task:
            name = "slurm-%s_%s" % (self.array_job_id or self.job_id, self.array_task_id)
        else:
            name = "slurm-%s" % self.job_id
        return node_run_name(name, self.node_id)

    def to_dict(self) -> Dict[str, Any]:
        """The fields a heartbeat carries under "slurm" (stable keys; None where not applicable)."""
        return {
            "job_id": self.job_id,
            "array_job_id": self.array_job_id,
            "array_task_id": self.array_task_id,
            "restart_count": self.restart_count,
            "node_list": self.node_list,
            "num_nodes": self.num_nodes,
            "node_id": self.node_id,
            "proc_id": self.proc_id,
            "is_primary": self.is_primary,
            "job_name": self.job_name,
        }


def heartbeat_fields(environ: Mapping[str, str]) -> Optional[Dict[str, Any]]:
    """`SlurmJob.from_env(environ).to_dict()`, or None outside Slurm: what the heartbeat puts under "slurm"."""
    job = SlurmJob.from_env(environ)
    return job.to_dict() if job is not None else None


Runner = Callable[..., "subprocess.CompletedProcess[str]"]

SCONTROL = Tool("scontrol", SlurmError,
                missing=Says("scontrol not found on PATH", "run the agent on a Slurm node, or pass --no-requeue"),
                timed_out=Says("`{cmd}` did not answer within {timeout:.0f} s",
                               "slurmctld may be down; `scontrol ping` tells"),
                failed=Says("`{cmd}` failed (exit {rc}): {stderr}",
                            "the job needs --requeue (onbox sbatch asks for it) and JobRequeue allowed"),
                tail=stderr_tail(or_stdout=True))


def _scontrol(args: List[str], timeout: float, runner: Optional[Runner]) -> "subprocess.CompletedProcess[str]":
    return SCONTROL.run(["scontrol", *args], timeout, runner=runner)


def requeue(job_id: str, timeout: float = REQUEUE_TIMEOUT, runner: Optional[Runner] = None) -> None:
    """`scontrol requeue JOB`: back in the queue; it starts again with SLURM_RESTART_COUNT+1 after cred_expire+1 s.

    Raises SlurmError (message carries scontrol's stderr) when Slurm refuses or does not answer.
    """
    if not re.match(r"^[0-9]+(_[0-9]+)?$", str(job_id)):
        raise SlurmError("not a Slurm job id: %r" % (job_id,))
    _scontrol(["requeue", str(job_id)], timeout, runner)


def end_time(job_id: str, timeout: float = END_TIME_TIMEOUT, runner: Optional[Runner] = None) -> float:
    """The job's EndTime (`scontrol show job JOB`) as epoch seconds: when Slurm ends it (its time limit). Slurm
    prints it in the controller's local time, without a zone: read as this box's local time (a job runs in its
    cluster's zone). Raises SlurmError when scontrol fails or says no end time (`Unknown`: no time limit)."""
    import time

    if not re.match(r"^[0-9]+(_[0-9]+)?$", str(job_id)):
        raise SlurmError("not a Slurm job id: %r" % (job_id,))
    cp = _scontrol(["show", "job", str(job_id)], timeout, runner)
    m = re.search(r"\bEndTime=(\S+)", cp.stdout or "")
    if m is None:
        raise SlurmError("`scontrol show job %s` says no EndTime" % job_id,
                         hint="give --deadline WHEN, or --deadline none")
    text = m.group(1)
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        raise SlurmError("Slurm job %s has no end time it can say (EndTime=%s: no time limit?)" % (job_id, text),
                         hint="give --deadline WHEN, or --deadline none")


def kill_wait(timeout: float = 10.0, runner: Optional[Runner] = None) -> Optional[float]:
    """KillWait in seconds (the grace between SIGTERM at the time limit and SIGKILL), None when unknown."""
    try:
        cp = _scontrol(["show", "config"], timeout, runner)
    except SlurmError:
        return None
    m = re.search(r"^KillWait\s*=\s*(\d+)", cp.stdout, re.MULTILINE)
    return float(m.group(1)) if m else None


# Why a run ended -> whether Slurm should run it again. Only the Slurm warning signal (`--signal=B:SIG@T` before the
# time limit, or `scancel --signal=SIG --batch`) is a reason to requeue. SIGTERM is not: it is the time limit itself
# (the job is already ending) or a user's `scancel`, and `scontrol requeue` would bring back a job the user cancelled
# (it requeues finished jobs too). A run that finished or failed for its own reasons is never requeued.
def requeue_decision(job: Optional[SlurmJob], outcome: str, notice_signal: Optional[str],
                     slurm_signal: str = "USR1", enabled: Optional[bool] = None) -> Tuple[bool, str]:
    """(requeue?, why) for a run that ended with `outcome` (the supervisor's final state: "preempted",
    "succeeded", "failed", "stopped", ...) after a notice from `notice_signal` (e.g. "SIGUSR1"; None when no
    signal). The reason is meant for the log: a user must see why a job did or did not come back."""
    if job is None:
        return False, "not inside a Slurm job"
    if enabled is False:
        return False, "requeue disabled"
    if not job.is_primary:
        return False, "node %d is not the primary; node 0 requeues the job" % job.node_id
    if outcome in (vocab.DONE, vocab.SUCCEEDED, vocab.STOPPED):
        return False, "the run ended as %s: not requeued" % outcome
    if outcome == vocab.FENCED:  # another agent holds the run's lease: a requeued job would be a second writer
        return False, "the run was fenced (a newer lease holds it elsewhere): never requeued"
    if outcome != vocab.PREEMPTED:
        return False, ("the run ended as %s for its own reasons, not a preemption: not requeued "
                       "(a crash loop is not a preemption)" % outcome)
    if notice_signal == SESSION_LIMIT:  # the run's deadline (onbox/supervisor/deadline.py): only when asked for
        if enabled is not True:
            return False, "stopped by its deadline (session_limit): not requeued (--requeue asks for it)"
        return True, "stopped by its deadline (session_limit), --requeue: requeueing job %s (restart %d -> %d)" % (
            job.job_id, job.restart_count, job.restart_count + 1)
    want = _signame(slurm_signal)
    got = _signame(notice_signal) if notice_signal else None
    if got != want:
        return False, ("preempted by %s, not by the Slurm signal %s: the job is ending (time limit or scancel): "
                       "not requeued" % (got or "a notice", want))
    return True, "preempted by %s: requeueing job %s (restart %d -> %d)" % (
        want, job.job_id, job.restart_count, job.restart_count + 1)


def _signame(value: str) -> str:
    from onbox.config import parse_signal
    from onbox.errors import UsageError

    text = str(value)
    if text.startswith("signal:"):  # the supervisor's notice source, e.g. "signal:SIGUSR1"
        text = text[len("signal:"):]
    try:
        return parse_signal(text).name
    except UsageError:
        return text


def default_run_name(environ: Mapping[str, str]) -> Optional[str]:
    """The run name inside a Slurm job when the user gave none (`SlurmJob.run_name()`), None outside Slurm."""
    job = SlurmJob.from_env(environ)
    return job.run_name() if job is not None else None


def sigterm_grace(environ: Mapping[str, str], timeout: float = 10.0, runner: Optional[Runner] = None
                  ) -> Optional[float]:
    """Inside Slurm, SIGTERM means the time limit (or scancel) and SIGKILL follows after KillWait: the seconds a
    SIGTERM notice really has. None outside Slurm or when scontrol does not say."""
    if SlurmJob.from_env(environ) is None:
        return None
    return kill_wait(timeout, runner)


def on_run_end(outcome: str, notice_source: Optional[str], preempt_signal: str, enabled: Optional[bool],
               environ: Mapping[str, str], log: Callable[[str], Any], emit: Callable[..., Any],
               timeout: float = REQUEUE_TIMEOUT, runner: Optional[Runner] = None,
               requeue_fn: Optional[Callable[[str], Any]] = None) -> Optional[bool]:
    """What the agent does with its job when the run reaches a terminal state: requeue it (only after the Slurm
    signal) or say why not, in the log and as an event. True when requeued; None outside Slurm.
    `requeue_fn(job_id)` replaces `requeue()` (a seam for tests; a false return is a failure)."""
    job = SlurmJob.from_env(environ)
    if job is None:
        return None
    ok, why = requeue_decision(job, outcome, notice_source, preempt_signal, enabled)
    if not ok:
        log("slurm job %s: %s" % (job.job_id, why))
        emit("requeue_skipped", job_id=job.job_id, reason=why, slurm=job.to_dict())
        return False
    try:
        if requeue_fn is None:
            requeue(job.job_id, timeout, runner)
        elif not requeue_fn(job.job_id):
            raise SlurmError("requeue of job %s was refused" % job.job_id)
    except SlurmError as e:
        log("slurm job %s: requeue FAILED: %s%s" % (job.job_id, e.message, (" (hint: %s)" % e.hint) if e.hint else ""))
        emit("requeue", job_id=job.job_id, ok=False, error=e.message, slurm=job.to_dict())
        return False
    log("slurm job %s: %s" % (job.job_id, why))
    emit("requeue", job_id=job.job_id, ok=True, reason=why, slurm=job.to_dict())
    return True


def checkpoint_hook_for_node(inner: Any, environ: Mapping[str, str], emit: Optional[Callable[..., Any]] = None
                             ) -> Any:
    """`inner` on the primary (and outside Slurm); a restore-only wrapper on the other nodes."""
    job = SlurmJob.from_env(environ)
    return for_role(inner, job.role() if job is not None else None, emit)
