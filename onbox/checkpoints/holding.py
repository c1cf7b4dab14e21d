"""What the checkpoint hook does as its run's lease holder (fencing.py): the guard its committer calls before each
write, the stamp each manifest gets, the lineage restore and retention keep to, the fenced orphans it moves to
quarantine/, and the fence the supervisor asks about. A mixin of CheckpointCommitHook (hook.py).

The hook's lease is the agent's RunLease (taken before the supervisor starts, onbox.subsystems), or for any other
committer on the box (`onbox sync`, the stop of an agentless run) a PassiveLease on what the agent recorded.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from onbox.checkpoints import SyncFailed
from onbox.checkpoints.leases.fencing import Fenced, PassiveLease
from onbox.checkpoints.local.detect import Candidate, order_key
from onbox.checkpoints.local.restore import set_aside


class HolderMixin:
    """The lease side of CheckpointCommitHook. State it adds: `lease` (RunLease, PassiveLease or None without a
    durable target), `_first_restore_done`."""

    # provided by CheckpointCommitHook
    ctx: Any
    committer: Any
    status: Dict[str, Any]
    cands: List[Candidate]
    ckpt_dir: str
    _update_status: Callable[..., None]

    lease: Any = None
    _first_restore_done = False

    def _init_lease(self, target: Any, lease: Any) -> None:
        """The agent's lease, or a passive one on the lease this box's agent recorded in checkpoint_status.json."""
        self.lease = lease if lease is not None or target is None else PassiveLease(
            target, self.ctx.name, self.status.get("lease") if isinstance(self.status.get("lease"), dict) else None)

    def lease_changed(self) -> None:
        """The lease was taken, renewed, fenced or released: checkpoint_status.json says so."""
        if self.lease is not None and hasattr(self.lease, "status"):
            self._update_status(lease=self.lease.status())

    # -- what the committer calls ---------------------------------------------------------------------------------
    def lease_guard(self, what: str) -> None:
        if self.lease is not None:
            self.lease.check(what)

    def lease_stamp(self) -> Optional[Dict[str, Any]]:
        return self.lease.stamp() if self.lease is not None else None

    def in_lineage(self, entry: Dict[str, Any]) -> bool:
        lineage = getattr(self.lease, "lineage", None)
        return lineage is None or lineage.contains(entry)

    # -- what the supervisor asks ---------------------------------------------------------------------------------
    def fenced(self) -> Optional[Dict[str, Any]]:
        """The fenced event's fields once a newer lease holds the run (for good), else None."""
        return getattr(self.lease, "fence", None)

    def said_fenced(self, e: Fenced, checkpoint: Optional[str] = None) -> None:
        """A write was refused for the fence (the lease said `fenced` once): the status, not a sync failure."""
        self._update_status(fenced=e.info)
        if isinstance(self.lease, PassiveLease):  # the agent's RunLease said it already, once
            self.ctx.emit("fenced", checkpoint=checkpoint, **e.info, hint=e.hint)

    # -- lineage --------------------------------------------------------------------------------------------------
    def restorable(self, entries: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """`entries` (committed, oldest first) less the fenced orphans, which go to quarantine/ now (the caller
        holds the commit lock), and less anything else outside this holder's lineage."""
        lineage = getattr(self.lease, "lineage", None)
        if lineage is None:
            return entries
        for e in entries:
            if lineage.orphan(e):
                self._quarantine_orphan(e, lineage)
        return [e for e in entries if lineage.contains(e)]

    def _quarantine_orphan(self, e: Dict[str, Any], lineage: Any) -> None:
        by = "epoch %s (%s)" % (e.get("epoch"), e.get("holder")) if e.get("epoch") is not None else \
            "an agent without leases"
        reason = "a fenced orphan: committed by %s outside the lineage of lease epoch %d" % (by, lineage.epoch)
        try:
            dest = self.committer.quarantine(e["name"], reason)
        except (SyncFailed, OSError) as err:
            if not isinstance(err, Fenced):
                self.ctx.emit("quarantine_failed", checkpoint=e["name"], error=str(err))
            return
        entry = {"name": e["name"], "step": e.get("step"), "reason": reason, "at": self.ctx.clock.time(),
                 "moved_to": {"durable": dest}}
        self._update_status(quarantined=[*list(self.status.get("quarantined") or []), entry])
        self.ctx.emit("checkpoint_quarantined", checkpoint=e["name"], step=e.get("step"), reason=reason,
                      fallback=None, moved_to={"durable": dest}, epoch=e.get("epoch"), holder=e.get("holder"))

    def sweep_orphans(self) -> None:
        """After a commit: fenced orphans that appeared since (an old holder's race-window commit) leave for
        quarantine/. The caller holds the commit lock."""
        if getattr(self.lease, "lineage", None) is not None:
            self.restorable(self.committer.committed())

    def local_counts(self) -> bool:
        """A local checkpoint newer than the durable ones may be resumed from: after this launch's first restore
        (the trainer here writes this lineage), or when the previous holder was this box (lineage.local_ok)."""
        lineage = getattr(self.lease, "lineage", None)
        return lineage is None or lineage.local_ok or self._first_restore_done

    def set_aside_foreign(self, keep: Optional[str], step: Optional[int], when: Optional[float]) -> None:
        """At the first restore after another box held the run: this box's complete local checkpoints newer than
        the resume point (`keep`, its step and time; None: none) were written under a lease that was superseded.
        They are another timeline: kept aside (never deleted), so no trainer that picks its newest checkpoint
        by itself loads them."""
        lineage = getattr(self.lease, "lineage", None)
        for c in list(self.cands):
            if not c.complete or c.path == keep:
                continue
            if keep is not None and (c.step <= step if c.step is not None and step is not None
                                     else order_key(c)[1] <= (when or 0.0)):
                continue
            try:
                set_aside(self.ckpt_dir, c.path, "written under an older lease, outside the lineage of lease epoch "
                          "%s" % (lineage.epoch if lineage is not None else "?"), self.ctx.emit)
            except OSError as e:
                self.ctx.emit("set_aside_failed", path=c.path, error=str(e))

    def note_resumed(self, name: Optional[str]) -> None:
        """The first restore of this launch is done (from committed checkpoint `name`, or None): the lease says
        which one."""
        self._first_restore_done = True
        if name is not None and hasattr(self.lease, "resumed"):
            self.lease.resumed(name)
