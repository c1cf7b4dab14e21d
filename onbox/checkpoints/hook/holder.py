"""What the checkpoint hook does as its run's lease holder (onbox.checkpoints.leases.fencing): the guard its
committer calls before each write, the stamp each manifest gets, the lineage restore and retention keep to, the
fenced orphans it moves to quarantine/, and the fence the supervisor asks about.

The lease is the agent's RunLease (taken before the supervisor starts, onbox.subsystems), or for any other
committer on the box (`onbox sync`, the stop of an agentless run) a PassiveLease on what the agent recorded.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

from onbox.checkpoints import SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import DurableTarget
from onbox.checkpoints.hook.status import StatusFile
from onbox.checkpoints.leases import Lineage
from onbox.checkpoints.leases.fencing import Fenced, PassiveLease, RunLease
from onbox.checkpoints.local.detect import Candidate, entry_paths, order_key
from onbox.checkpoints.local.restore import set_aside

Lease = Union[RunLease, PassiveLease]


class LeaseHolder:
    """The lease side of the hook. `lease`: the agent's RunLease, a PassiveLease on the lease this box's agent
    recorded in checkpoint_status.json, or None without a durable target."""

    def __init__(self, lease: Optional[Lease], target: Optional[DurableTarget], run: str, status: StatusFile,
                 emit: Callable[..., None], clock: Any, ckpt_dir: str) -> None:
        recorded = status.get("lease")
        self.lease: Optional[Lease] = lease if lease is not None or target is None else PassiveLease(
            target, run, recorded if isinstance(recorded, dict) else None)
        self.status = status
        self.emit = emit
        self.clock = clock
        self.ckpt_dir = ckpt_dir
        self.first_restore_done = False

    @property
    def lineage(self) -> Optional[Lineage]:
        return getattr(self.lease, "lineage", None)

    def lease_changed(self) -> None:
        """The lease was taken, renewed, fenced or released: checkpoint_status.json says so."""
        if self.lease is not None and hasattr(self.lease, "status"):
            self.status.update(lease=self.lease.status())

    # -- what the committer calls ---------------------------------------------------------------------------------
    def guard(self, what: str) -> None:
        if self.lease is not None:
            self.lease.check(what)

    def stamp(self) -> Optional[Dict[str, Any]]:
        return self.lease.stamp() if self.lease is not None else None

    def in_lineage(self, entry: Dict[str, Any]) -> bool:
        lineage = self.lineage
        return lineage is None or lineage.contains(entry)

    # -- what the supervisor asks ---------------------------------------------------------------------------------
    def fenced(self) -> Optional[Dict[str, Any]]:
        """The fenced event's fields once a newer lease holds the run (for good), else None."""
        return getattr(self.lease, "fence", None)

    def said_fenced(self, e: Fenced, checkpoint: Optional[str] = None) -> None:
        """A write was refused for the fence (the lease said `fenced` once): the status, not a sync failure."""
        self.status.update(fenced=e.info)
        if isinstance(self.lease, PassiveLease):  # the agent's RunLease said it already, once
            self.emit("fenced", checkpoint=checkpoint, **e.info, hint=e.hint)

    # -- lineage --------------------------------------------------------------------------------------------------
    def restorable(self, committer: CheckpointCommitter, entries: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """`entries` (committed, oldest first) less the fenced orphans, which go to quarantine/ now (the caller
        holds the commit lock), and less anything else outside this holder's lineage."""
        lineage = self.lineage
        if lineage is None:
            return entries
        for e in entries:
            if lineage.orphan(e):
                self._quarantine_orphan(committer, e, lineage)
        return [e for e in entries if lineage.contains(e)]

    def _quarantine_orphan(self, committer: CheckpointCommitter, e: Dict[str, Any], lineage: Lineage) -> None:
        by = "epoch %s (%s)" % (e.get("epoch"), e.get("holder")) if e.get("epoch") is not None else \
            "an agent without leases"
        reason = "a fenced orphan: committed by %s outside the lineage of lease epoch %d" % (by, lineage.epoch)
        try:
            dest = committer.quarantine(e["name"], reason)
        except (SyncFailed, OSError) as err:
            if not isinstance(err, Fenced):
                self.emit("quarantine_failed", checkpoint=e["name"], error=str(err))
            return
        self.status.add_quarantined({"name": e["name"], "step": e.get("step"), "reason": reason,
                                     "at": self.clock.time(), "moved_to": {"durable": dest}})
        self.emit("checkpoint_quarantined", checkpoint=e["name"], step=e.get("step"), reason=reason,
                  fallback=None, moved_to={"durable": dest}, epoch=e.get("epoch"), holder=e.get("holder"))

    def sweep_orphans(self, committer: CheckpointCommitter) -> None:
        """After a commit: fenced orphans that appeared since (an old holder's race-window commit) leave for
        quarantine/. The caller holds the commit lock."""
        if self.lineage is not None:
            self.restorable(committer, committer.committed())

    def local_counts(self) -> bool:
        """A local checkpoint newer than the durable ones may be resumed from: after this launch's first restore
        (the trainer here writes this lineage), or when the previous holder was this box (lineage.local_ok)."""
        lineage = self.lineage
        return lineage is None or lineage.local_ok or self.first_restore_done

    def set_aside_foreign(self, cands: List[Candidate], keep: Optional[str], step: Optional[int],
                          when: Optional[float]) -> None:
        """At the first restore after another box held the run: this box's complete local checkpoints newer than
        the resume point (`keep`, its step and time; None: none) were written under a lease that was superseded.
        They are another timeline: kept aside (never deleted), so no trainer that picks its newest checkpoint
        by itself loads them."""
        lineage = self.lineage
        for c in list(cands):
            if not c.complete or c.path == keep:
                continue
            if keep is not None and (c.step <= step if c.step is not None and step is not None
                                     else order_key(c)[1] <= (when or 0.0)):
                continue
            for path in entry_paths(c):
                try:
                    set_aside(self.ckpt_dir, path, "written under an older lease, outside the lineage of lease "
                              "epoch %s" % (lineage.epoch if lineage is not None else "?"), self.emit)
                except OSError as e:
                    self.emit("set_aside_failed", path=path, error=str(e))

    def note_resumed(self, name: Optional[str]) -> None:
        """The first restore of this launch is done (from committed checkpoint `name`, or None): the lease says
        which one."""
        self.first_restore_done = True
        resumed = getattr(self.lease, "resumed", None)
        if name is not None and resumed is not None:
            resumed(name)
