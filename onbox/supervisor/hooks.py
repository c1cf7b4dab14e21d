"""The seams between the supervisor loop and the subsystems it drives: interfaces only.

The supervisor owns the loop; checkpoints, heartbeats and the GPU reaper plug in through these protocols, built by
onbox.subsystems.make_hooks. A subsystem imports this module; this module imports no subsystem. Each protocol has
a no-op implementation so the supervisor runs without them (`no_hooks`).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

if TYPE_CHECKING:
    from onbox.clock import Clock
    from onbox.config import RunConfig
    from onbox.telemetry.progress import ProgressFeed


@dataclasses.dataclass
class RunContext:
    """What every hook is constructed with. The supervisor owns it.

    Files in run_dir that hooks share (each written atomically by its owner, read by anyone; named in onbox.paths):
      state.json              supervisor: run, state, attempt, child_pid, attempts[{n, pid, sid, pgid, ...}], last_exit
      events.jsonl            supervisor's recorder (hooks write through `emit`)
      progress.json           supervisor: the progress feed's newest step, loss, eval_loss, lr, tokens_per_s, ..., time
      checkpoint_status.json  checkpoints: latest_local, latest_durable, verified, last_sync {ok, error, at}
    Inside the supervisor a hook reads the trainer's progress from `progress`, not from progress.json.
    """

    name: str
    run_dir: str
    ckpt_dir: str
    config: "RunConfig"
    clock: "Clock"
    emit: Callable[..., None]  # emit(event_type: str, **fields): one line in events.jsonl (+ telemetry)
    attempt: Callable[[], int]  # the current attempt number (0 on the first)
    # write_failed(what, error): a write into run_dir met a disk fault (fsutil.disk_fault: full, failing,
    # read-only). A hook that reports it carries on; the supervisor says so once and retries its own records.
    # None (a hook built outside a supervisor): the error is raised as before.
    write_failed: Optional[Callable[[str, OSError], None]] = None
    # the trainer's progress, parsed once by the loop (onbox.telemetry.progress). None (a hook built outside a
    # supervisor: `onbox sync`, `onbox checkpoints`): progress.json is all there is to know.
    progress: Optional["ProgressFeed"] = None
    # summary_due(): a hook rewrote its file beside state.json (checkpoint_status.json), which training_status.md
    # shows: the loop rewrites the summary at its next tick. From any thread; None outside a supervisor.
    summary_due: Optional[Callable[[], None]] = None
    # the agent's environment, as the Supervisor was given it (the box's name, Slurm's variables); None: os.environ
    environ: Optional[Mapping[str, str]] = None


class CheckpointHook(Protocol):
    def restore(self) -> Optional[str]:
        """Before an attempt: make the newest verified checkpoint available locally; return its path or None."""

    def periodic(self) -> None:
        """Called from the loop every tick; commits a newly completed checkpoint when its interval is due."""

    def after_failure(self, seconds: float) -> bool:
        """The attempt failed after `seconds`: if it resumed from a checkpoint it never got past, take that
        checkpoint out of use so the next attempt falls back to an older one. True when it did (the failure
        then says nothing about the next attempt's starting point: the crash-loop count starts again)."""

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        """On preemption/stop, and when the run ends without one (done, or failed with no restart to come;
        deadline = now + config.final_sync_timeout): wait for a commit in flight, then commit the newest complete
        checkpoint that can finish before `deadline` (a monotonic time). Returns a summary (name, step, durable
        path) or None when nothing was committed."""

    def commit_estimate(self) -> Optional[Dict[str, Any]]:
        """Asked every loop step while the run has a deadline, cheap (no scan, no I/O): what the final commit of
        the newest complete checkpoint would take now by the run's measured throughput: {seconds, bytes,
        checkpoint, throughput_bytes_per_s}; None when nothing would be committed (no durable storage). The
        deadline's ask_at moves with it (onbox/supervisor/deadline.py)."""

    def fenced(self) -> Optional[Dict[str, Any]]:
        """Asked every loop step, cheap: None while this agent holds the run's lease; once a newer lease holds it
        (for good), what the `fenced` event said: {epoch, newer_epoch, newer_holder, host, ...}. The supervisor
        then stops the run and ends FENCED; the hook writes nothing more to durable storage."""


class TelemetryHook(Protocol):
    def on_output(self, line: str) -> None:
        """Each line of the child's output (already decoded, without the newline)."""

    def on_progress(self, fields: Dict[str, float]) -> None:
        """Each record of the trainer's progress, in order, once RunContext.progress has taken it: the canonical
        fields (step, loss, ...) of a line of its output or of ONBOX_METRICS_FILE."""

    def on_event(self, event: Dict[str, Any]) -> None:
        """Each lifecycle event the supervisor records (state changes, exits, restarts, preemption)."""

    def tick(self, state: Dict[str, Any]) -> None:
        """Every loop tick with the current state.json document; sends a heartbeat when one is due."""

    def close(self, state: Dict[str, Any]) -> None:
        """Final heartbeat and flush, best effort within a short bound."""


class ReapHook(Protocol):
    """May also have `gpu_state()`: the GPUs' readings now (onbox.gpu.readings), for a hang's evidence (hang.py)."""

    def before_attempt(self, earlier_sessions: List[int]) -> None:
        """Kill GPU holders left by earlier attempts (their session ids) and wait, bounded, for memory to return."""


PEER_RESTART = "restart:"  # the source of a peer's group restart: "restart:node<K>" (NodeHook.start)


class NodeHook(Protocol):
    """The other agents of a multi-node group (onbox/multinode/): they hear of this node's notices and of its hang
    restarts, and theirs become this node's own."""

    def start(self, put_notice: Callable[[Tuple[Optional[float], str, str]], None]) -> None:
        """Begin listening; a peer's notice arrives as put_notice((lead seconds or None, source, detail)), from
        any thread. A peer's group restart (its hang watch stopped its attempt) arrives as put_notice((None,
        "restart:node<K>", detail)), `detail` the JSON of what on_restart was given: this node stops its own
        attempt the same way (its stacks first) and restarts it, so a node whose trainer reports nothing (its
        rank stopped, or one that prints no steps) is covered by node K's judgement."""

    def on_notice(self, source: str, detail: str, lead: float) -> None:
        """This agent accepted a notice (`lead`: seconds to its deadline): tell the peers."""

    def on_restart(self, detail: Dict[str, Any]) -> None:
        """This node's hang watch judged the attempt hung and restarts it (its stacks are kept): tell the peers,
        whose agents restart theirs. `detail`: the hang_detected event's judgement (step, quiet_s, bound_s, rule,
        stacks). Called before this node's attempt is stopped, so the peers take their stacks of the hung group."""

    def close(self) -> None:
        """Stop listening, after the notices under way are delivered (bounded)."""


class NoCheckpoints:
    def restore(self) -> Optional[str]:
        return None

    def after_failure(self, seconds: float) -> bool:
        return False

    def periodic(self) -> None:
        return None

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        return None

    def commit_estimate(self) -> Optional[Dict[str, Any]]:
        return None

    def fenced(self) -> Optional[Dict[str, Any]]:
        return None


class NoTelemetry:
    def on_output(self, line: str) -> None:
        return None

    def on_progress(self, fields: Dict[str, float]) -> None:
        return None

    def on_event(self, event: Dict[str, Any]) -> None:
        return None

    def tick(self, state: Dict[str, Any]) -> None:
        return None

    def close(self, state: Dict[str, Any]) -> None:
        return None


class NoReaper:
    def before_attempt(self, earlier_sessions: List[int]) -> None:
        return None


class NoNodes:
    def start(self, put_notice: Callable[[Tuple[Optional[float], str, str]], None]) -> None:
        return None

    def on_notice(self, source: str, detail: str, lead: float) -> None:
        return None

    def on_restart(self, detail: Dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


@dataclasses.dataclass
class Hooks:
    checkpoints: CheckpointHook
    telemetry: TelemetryHook
    reaper: ReapHook
    nodes: NodeHook = dataclasses.field(default_factory=NoNodes)  # a single-node run has no peers
    # copy the run's logs (a hang's stacks file among them) to durable storage now, after the commit in flight;
    # None: this agent writes no logs there (no --durable, or a node that does not commit)
    logs: Optional[Callable[[], None]] = None


def no_hooks(ctx: RunContext) -> Hooks:
    """Hooks that do nothing: the supervisor alone (tests, and the default when no subsystems are wired)."""
    return Hooks(checkpoints=NoCheckpoints(), telemetry=NoTelemetry(), reaper=NoReaper())
