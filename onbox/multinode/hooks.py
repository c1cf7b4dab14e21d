"""What a node's role changes in a run's hooks: who commits, where a node restores from, who tells whom to stop.

- Every non-primary node (Slurm or SSH): PrimaryOnlyCommits, restore-only; node 0 commits for the run.
- SSH group, node 0: GroupPrimary commits its newest complete checkpoint before each attempt, resumes from it and
  publishes which one it is (ResumePoint), so the other nodes can fetch exactly that one.
- SSH group, node N > 0: GroupRestore asks node 0 (bounded) and restores that checkpoint, read-only, from node 0's
  durable run dir (`<durable>/<node 0's run>`): every node of an attempt starts from the same step.
- SSH group, every node: GroupNotices (the supervisor's `nodes` seam) sends a preemption or a stop to the peers
  and turns theirs into this agent's own notice; and a hang restart, so the group restarts together (a node whose
  rank is stopped, or that prints no step, is covered by the judging node's word), each node's stacks taken first.
  A restart names the group attempt it ends (node 0's resume point seq): a late one, for an attempt the group has
  left already, is ignored, never a reason to stop the next one.

Without coordination a failure-restart could split the group: node 0 resumes from a checkpoint it commits a
moment later, another node restores the older committed one, and the ranks run different steps. While any node
has not rejoined, the group cannot train, so nothing newer can be saved: node 0's word is final for the attempt.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import fsutil
from onbox.multinode.notices import PeerChannel
from onbox.multinode.role import NodeGroup, NodeRole

Emit = Callable[..., Any]
ASK_TIMEOUT_EXTRA = 30.0  # seconds a non-primary waits for node 0 beyond node 0's own bound (its commit)
RESTART_KEYS = ("step", "quiet_s", "bound_s", "rule", "phase", "stacks")  # what a restart says of the judgement


class PrimaryOnlyCommits:
    """A checkpoint hook for a non-primary node: it restores (every rank must resume from the same step) but
    never commits; node 0 commits for the run. `restore` replaces the inner hook's restore (SSH groups fetch the
    checkpoint node 0 names); without it the inner hook restores as on a single node (Slurm: a shared --ckpt-dir)."""

    def __init__(self, inner: Any, node_id: int, emit: Optional[Emit] = None,
                 restore: Optional[Callable[[], Optional[str]]] = None, source: str = "slurm") -> None:
        self.inner = inner
        self.node_id = node_id
        self.told = False
        self.emit = emit
        self._restore = restore
        self.source = source

    def restore(self) -> Optional[str]:
        if self._restore is not None:
            return self._restore()
        return self.inner.restore() if self.inner is not None else None  # type: ignore[no-any-return]

    def after_failure(self, seconds: float) -> bool:
        return False  # node 0 decides about the job's checkpoints

    def periodic(self) -> None:
        if not self.told and self.emit is not None:
            self.told = True
            self.emit("commit_skipped", reason="%s node %d is not the primary; node 0 commits"
                      % (self.source, self.node_id))

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        return None

    def commit_estimate(self) -> Optional[Dict[str, Any]]:
        return None  # nothing is committed here; node 0's deadline notice reaches the group

    def fenced(self) -> Optional[Dict[str, Any]]:
        return None  # only node 0 holds the run's lease; a fenced node 0 stops the group


def for_role(inner: Any, role: Optional[NodeRole], emit: Optional[Emit] = None) -> Any:
    """`inner` on the primary (and outside any group); a restore-only wrapper on the other nodes."""
    if role is None or role.primary:
        return inner
    return PrimaryOnlyCommits(inner, role.rank, emit, source=role.source)


class ResumePoint:
    """Node 0's answer to `ask`: which checkpoint its current attempt resumed from. `seq` counts its restores
    since the agent started (0: none yet), so a node that restored for seq N waits for N+1 next time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.doc: Dict[str, Any] = {"seq": 0, "name": None, "step": None}

    def publish(self, name: Optional[str], step: Optional[int]) -> None:
        with self._lock:
            self.doc = {"seq": int(self.doc["seq"]) + 1, "name": name, "step": step}

    def answer(self) -> Dict[str, Any]:
        with self._lock:
            return dict(self.doc)


class GroupPrimary:
    """Node 0 of an SSH group: the inner CheckpointCommitHook, plus a commit before each restore (what node 0
    resumes from must be durable, or no other node can fetch it) and the resume point it publishes."""

    def __init__(self, inner: Any, point: ResumePoint, clock: Any, final_timeout: float) -> None:
        self.inner = inner
        self.point = point
        self.clock = clock
        self.final_timeout = final_timeout

    def restore(self) -> Optional[str]:
        if self.inner.scan_now(settle=0.0):  # no child runs now: a torn file still fails its format check
            self.inner.final(self.clock.monotonic() + self.final_timeout)
        path = self.inner.restore()
        resumed = getattr(self.inner, "resumed", None) or {}
        self.point.publish(resumed.get("name") if path else None, resumed.get("step") if path else None)
        return path  # type: ignore[no-any-return]

    def periodic(self) -> None:
        self.inner.periodic()

    def after_failure(self, seconds: float) -> bool:
        return bool(self.inner.after_failure(seconds))

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        return self.inner.final(deadline)  # type: ignore[no-any-return]

    def commit_estimate(self) -> Optional[Dict[str, Any]]:
        ask = getattr(self.inner, "commit_estimate", None)
        return ask() if ask is not None else None  # type: ignore[no-any-return]

    def fenced(self) -> Optional[Dict[str, Any]]:
        return self.inner.fenced()  # type: ignore[no-any-return]


class GroupRestore:
    """A non-primary SSH node's restore: node 0's resume point, fetched read-only from node 0's durable run dir.

    `channel()` gives the started PeerChannel (None until the agent started it); `abort()` says to stop waiting
    (a peer's stop or preemption arrived). Returns the local path for ONBOX_RESUME_FROM, or None (a fresh start,
    as node 0's)."""

    def __init__(self, group: NodeGroup, durable: Optional[str], ckpt_dir: str, emit: Emit,
                 channel: Callable[[], Optional[PeerChannel]], wait_s: float,
                 abort: Callable[[], bool] = lambda: False, target: Any = None) -> None:
        self.group = group
        self.durable = durable
        self.ckpt_dir = ckpt_dir
        self.emit = emit
        self.channel = channel
        self.wait_s = wait_s
        self.abort = abort
        self.target = target
        self.last_seq = 0

    def _target(self) -> Any:
        if self.target is None and self.durable:
            from onbox.checkpoints.durable.targets import make_target

            self.target = make_target(self.durable, self.group.run)  # node 0's run: read, never written
        return self.target

    def wait_for_node0(self) -> Optional[Dict[str, Any]]:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and not self.abort():
            ch = self.channel()
            if ch is None:
                return None
            reply = ch.ask(0, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            seq = reply.get("seq") if reply else None
            if isinstance(seq, int) and seq > self.last_seq:
                self.last_seq = seq
                return reply
            if reply is not None:  # node 0 answers but has not restored for this attempt yet
                time.sleep(0.2)
        return None

    def __call__(self) -> Optional[str]:
        reply = self.wait_for_node0()
        ch = self.channel()
        if ch is not None:  # the group attempt this node's next attempt joins (GroupNotices.group_seq)
            ch.joined = self.last_seq if reply is not None else None
        if reply is None and self.abort():
            self.emit("node_resume", node=self.group.rank, checkpoint=None,
                      reason="a peer stopped the group while this node waited for node 0's resume point")
            return None  # the attempt is stopped at once: what it would resume from does not matter
        if reply is None:
            self.emit("node_resume_fallback", node=self.group.rank,
                      reason="node 0 gave no resume point within %.0f s: restoring the newest committed checkpoint"
                      % self.wait_s)
            return self._restore(None)
        name, step = reply.get("name"), reply.get("step")
        if name is None and step is None:
            self.emit("node_resume", node=self.group.rank, checkpoint=None, reason="node 0 starts without a checkpoint")
            return None
        if name is None:
            self.emit("node_resume_mismatch", node=self.group.rank, step=step,
                      reason="node 0 resumes from an uncommitted local checkpoint (step %s) no other node can "
                             "fetch: restoring the newest committed one" % step)
            return self._restore(None)
        return self._restore(str(name))

    def _restore(self, name: Optional[str]) -> Optional[str]:
        from onbox.checkpoints import SyncFailed
        from onbox.checkpoints.local.restore import restore_newest

        target = self._target()
        if target is None:
            self.emit("node_resume_failed", node=self.group.rank, checkpoint=name,
                      reason="this node has no --durable: it cannot fetch node 0's checkpoints")
            return None
        res = None
        try:
            names = [name] if name else self._newest_first(target)
            if not names:
                self.emit("node_resume", node=self.group.rank, checkpoint=None, reason="nothing committed yet")
                return None
            os.makedirs(self.ckpt_dir, exist_ok=True)
            res = restore_newest(target, names, self.ckpt_dir, self.emit)
            error = "; ".join("%s: %s" % r for r in res.rejected) or "not found"
        except (SyncFailed, OSError) as e:
            error = str(e)
        if res is None or not res.path:
            self.emit("node_resume_failed", node=self.group.rank, checkpoint=name, durable=target.url,
                      reason="cannot restore node 0's checkpoint from %s: %s (the durable target must be one "
                             "every node reaches: an rclone remote or a shared mount)" % (target.url, error))
            return None
        self.emit("checkpoint_resume", path=res.path, checkpoint=res.name, step=res.step, source="node0:" + res.source)
        return res.path

    @staticmethod
    def _newest_first(target: Any) -> List[str]:
        from onbox.checkpoints.durable.manifest import BadManifest

        entries: List[Tuple[Any, str]] = []
        for n in target.list_names():
            try:
                m = target.read_manifest(n)
            except BadManifest:  # refused: it does not exist for a restore (node 0's restore quarantines it)
                continue
            if m is not None and not n.startswith("."):
                entries.append(((m.get("step") if isinstance(m.get("step"), int) else -1, m.get("created") or 0), n))
        return [n for _k, n in sorted(entries, reverse=True)]


class GroupNotices:
    """The supervisor's `nodes` seam for an SSH group: this agent's notices go to the peers, theirs come back as
    this agent's own (source `peer:node<N>`). A stop travels as a stop request, so every node ends `stopped`."""

    def __init__(self, group: NodeGroup, stop_request: str, emit: Emit, point: Optional[ResumePoint] = None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.group = group
        self.stop_request = stop_request  # the run dir's stop request file, which the loop watches
        self.emit = emit
        self.point = point or ResumePoint()
        self.log = log
        self.channel: Optional[PeerChannel] = None
        self._put: Optional[Callable[[Tuple[Optional[float], str, str]], None]] = None
        self.stopping = threading.Event()  # a peer asked this node to stop or preempted it
        self._stop_from_peer = False

    def start(self, put_notice: Callable[[Tuple[Optional[float], str, str]], None]) -> None:
        self._put = put_notice
        try:
            self.channel = PeerChannel(self.group, on_notice=self._on_peer, answer=self.point.answer,
                                       log=self.log).start()
        except OSError as e:  # the port was taken since `onbox run` checked it: said loudly, never silently off
            self.emit("thread_died", thread="onbox-peers", what="notices between the nodes (a preemption of "
                      "another node will not stop this one)", error=repr(e),
                      hint="stop the group and relaunch it: `onboxctl run ... --nodes` picks free ports")
            return
        self.emit("peers_listening", node=self.group.rank, port=self.group.me.port, nnodes=self.group.nnodes)

    def on_notice(self, source: str, detail: str, lead: float) -> None:
        if self.channel is None or source.startswith("peer:"):
            return  # a peer's notice is not sent around again
        if source == "stop":
            if self._stop_from_peer:
                return
            self.channel.broadcast("stop", grace=round(lead, 3))
        else:
            self.channel.broadcast("preempt", lead=round(lead, 3), source=source, detail=detail)
        self.emit("peer_notice_sent", kind="stop" if source == "stop" else "preempt",
                  to=[p.rank for p in self.group.others()])

    def group_seq(self) -> Optional[int]:
        """The group attempt this node's attempt belongs to: node 0's resume point seq (its own on node 0, the one
        this node restored for elsewhere); None when unknown."""
        if self.group.role.primary:
            return int(self.point.answer()["seq"])
        return self.channel.joined if self.channel is not None else None

    def on_restart(self, detail: Dict[str, Any]) -> None:
        """This node's hang watch restarts its attempt: every peer restarts its own (NodeHook.on_restart)."""
        if self.channel is None:
            return
        self.channel.broadcast("restart", seq=self.group_seq(), **{k: v for k, v in detail.items() if k in RESTART_KEYS})
        self.emit("peer_notice_sent", kind="restart", to=[p.rank for p in self.group.others()])

    def _peer_restart(self, rank: int, msg: Dict[str, Any]) -> None:
        theirs, mine = msg.get("seq"), self.group_seq()
        if isinstance(theirs, int) and isinstance(mine, int) and theirs != mine:
            self.emit("peer_restart_ignored", node=rank, seq=theirs, joined=mine,
                      reason="node %d restarts group attempt %d; this node runs group attempt %d already"
                             % (rank, theirs, mine))
            return
        self.emit("peer_notice", kind="restart", node=rank, seq=theirs, stacks=msg.get("stacks"))
        if self._put is not None:  # the supervisor's own wire for it (hooks.NodeHook.start)
            self._put((None, "restart:node%d" % rank, json.dumps({k: msg.get(k) for k in RESTART_KEYS})))

    def _on_peer(self, kind: str, rank: int, msg: Dict[str, Any]) -> None:
        if kind == "restart":
            return self._peer_restart(rank, msg)
        lead = msg.get("lead") if kind == "preempt" else msg.get("grace")
        lead = float(lead) if isinstance(lead, (int, float)) and not isinstance(lead, bool) and lead >= 0 else None
        self.stopping.set()
        self.emit("peer_notice", kind=kind, node=rank, lead=lead, source=msg.get("source"))
        if kind == "stop":
            self._stop_from_peer = True
            req = {"grace": lead, "requested_at": time.time(), "by": "node %d" % rank}
            fsutil.atomic_write_json(self.stop_request, req)
        elif self._put is not None:
            self._put((lead, "peer:node%d" % rank, "node %d: %s %s" % (rank, msg.get("source") or "notice",
                                                                       msg.get("detail") or "")))

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()  # waits (bounded) for notices still being resent
