"""CheckpointCommitHook: what the supervisor calls (onbox.supervisor.hooks.CheckpointHook), a thin façade over its
parts, each built with what it needs and nothing more:

  status.py     StatusFile: checkpoint_status.json (the heartbeat reads it, training_status.md shows it), and the
                measured commit throughput
  localdir.py   LocalDirScanner: the bounded scans of the box's checkpoint dir and what each found complete; an
                unreadable newest entry, an empty dir, pruning committed copies when the disk runs low (U6)
  holder.py     LeaseHolder: the run's lease (the committer's guard and stamp, lineage, fenced orphans, fenced())
  scheduler.py  CommitScheduler: the periodic commit (in a thread), the final one against a deadline, the estimate
                of it, the run's logs copied after each commit
  restorer.py   Restorer: the restore before each attempt, torn saves kept aside, quarantine and fallback

restore()   before each attempt (after the commit in flight, bounded by final_sync_timeout): the newest verified
            checkpoint, fetched from durable storage when the local dir lacks it; its local path becomes
            ONBOX_RESUME_FROM.
periodic()  every loop tick, cheap: rescans at most once a second, and when sync_interval is due and a newer
            complete checkpoint exists, commits it in a background thread so the loop never blocks on I/O.
final(d)    on preemption/stop, and when the run ends (done, or failed for good): commits the newest complete
            checkpoint whose commit can finish before the monotonic deadline `d` by measured throughput (after
            the commit in flight, if any); says so when none can.
commit_estimate()  cheap, from the last scan: the seconds the final commit of the newest complete checkpoint takes
            by the measured throughput (plus the overhead and the final settle), which moves a deadline's ask_at.
fenced()    the run's lease: once a newer lease holds the run, nothing more is written and the supervisor stops
            the run.

The step fallback reads the trainer's progress from RunContext.progress (detect.read_progress).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from onbox import paths
from onbox.checkpoints.commit import CheckpointCommitter, CommitResult
from onbox.checkpoints.durable import DurableTarget
from onbox.checkpoints.durable.targets import make_target, overlap_problem
from onbox.checkpoints.hook.holder import Lease, LeaseHolder
from onbox.checkpoints.hook.localdir import LocalDirScanner
from onbox.checkpoints.hook.restorer import Restorer
from onbox.checkpoints.hook.scheduler import CommitScheduler
from onbox.checkpoints.hook.status import StatusFile
from onbox.checkpoints.local.completion import CompletionTracker, read_progress
from onbox.checkpoints.local.detect import BoundedScan, Candidate
from onbox.errors import UsageError


class CheckpointCommitHook:
    def __init__(self, ctx: Any, target: Optional[DurableTarget] = None, lease: Optional[Lease] = None) -> None:
        """`ctx`: the RunContext. `lease`: the agent's fencing.RunLease; None for any other committer (a passive
        lease on what the agent recorded, holder.py)."""
        self.ctx = ctx
        self.cfg = ctx.config
        self.clock = ctx.clock
        self.ckpt_dir = ctx.ckpt_dir
        if target is None and self.cfg.durable:
            problem = overlap_problem(self.cfg.durable, ctx.name, ctx.ckpt_dir)
            if problem:  # runhooks.preflight refuses this before a run starts; `onbox sync` flags meet it here
                raise UsageError(problem, hint="give --durable a directory outside --ckpt-dir (and vice versa)")
            # the lease's own target where the agent took one: one rclone rcd per agent (rcd.py), not one each
            store = getattr(lease, "store", None)
            target = store.target if store is not None else make_target(self.cfg.durable, ctx.name)
        self.target = target

        def progress() -> Dict[str, Any]:
            return read_progress(ctx)

        self.status_file = StatusFile(os.path.join(ctx.run_dir, paths.CHECKPOINT_STATUS_FILE), ctx.name, ctx.clock,
                                      ctx.emit, target.url if target else None, ctx.summary_due)
        self.scanner = LocalDirScanner(ctx.ckpt_dir, self.cfg, ctx.clock, ctx.emit, self.status_file, progress)
        self.holder = LeaseHolder(lease, target, ctx.name, self.status_file, ctx.emit, ctx.clock, ctx.ckpt_dir)
        self.committer = CheckpointCommitter(target, ctx.name, ctx.clock, ctx.emit, guard=self.holder.guard,
                                             stamp=self.holder.stamp, in_lineage=self.holder.in_lineage) \
            if target else None
        self.scheduler = CommitScheduler(ctx.run_dir, self.cfg, ctx.clock, ctx.emit, target, self.committer,
                                         self.scanner, self.holder, self.status_file,
                                         pinned=lambda: self.restorer.pinned())
        self.restorer = Restorer(ctx.ckpt_dir, ctx.run_dir, self.cfg, ctx.clock, ctx.emit, target, self.committer,
                                 self.scanner, self.scheduler, self.holder, self.status_file, progress)

    # -- the CheckpointHook protocol --------------------------------------------------------------------------------
    def restore(self) -> Optional[str]:
        return self.restorer.restore()

    def periodic(self) -> None:
        self.scheduler.tick()

    def after_failure(self, seconds: float) -> bool:
        return self.restorer.after_failure(seconds)

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        return self.scheduler.final(deadline)

    def commit_estimate(self) -> Optional[Dict[str, Any]]:
        return self.scheduler.estimate()

    def fenced(self) -> Optional[Dict[str, Any]]:
        return self.holder.fenced()

    # -- what the agent, `onbox sync` and `onbox checkpoints` also use ---------------------------------------------
    def lease_changed(self) -> None:
        self.holder.lease_changed()

    def scan_now(self, settle: Optional[float] = None) -> List[Candidate]:
        """Rescan the checkpoint dir; the complete candidates, newest last (all of them stay in `cands`)."""
        return self.scanner.scan(settle)

    def commit_one(self, cand: Candidate) -> Optional[CommitResult]:
        return self.scheduler.commit_one(cand)

    def join_worker(self, deadline: Optional[float]) -> None:
        self.scheduler.join_worker(deadline)

    def sync_logs(self) -> None:
        self.scheduler.sync_logs()

    def prune_local(self, low_fraction: float = 0.05) -> List[str]:
        assert self.committer is not None
        return self.scanner.prune(self.committer, low_fraction)

    # -- read-only views ----------------------------------------------------------------------------------------------
    @property
    def status(self) -> Dict[str, Any]:
        """checkpoint_status.json's document as this hook keeps it."""
        return self.status_file.doc

    @property
    def cands(self) -> List[Candidate]:
        return self.scanner.cands

    @property
    def scans(self) -> BoundedScan:
        return self.scanner.scans

    @property
    def tracker(self) -> CompletionTracker:
        return self.scanner.tracker

    @property
    def lease(self) -> Optional[Lease]:
        return self.holder.lease

    @property
    def resumed(self) -> Optional[Dict[str, Any]]:
        return self.restorer.resumed

    @property
    def box_logs(self) -> str:
        return self.scheduler.box_logs

    @property
    def throughput(self) -> float:
        return self.status_file.throughput

    @throughput.setter
    def throughput(self, value: float) -> None:
        self.status_file.throughput = value
