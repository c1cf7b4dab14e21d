"""CheckpointCommitHook: what the supervisor calls (onbox.supervisor.hooks.CheckpointHook).

restore()   before each attempt (after the commit in flight, bounded by final_sync_timeout): the newest verified checkpoint, fetched from durable storage when the local dir
            lacks it; its local path becomes ONBOX_RESUME_FROM.
periodic()  every loop tick, cheap: rescans at most once a second, and when sync_interval is due and a newer
            complete checkpoint exists, commits it in a background thread so the loop never blocks on I/O.
final(d)    on preemption/stop, and when the run ends (done, or failed for good): commits the newest complete
            checkpoint whose commit can finish before the monotonic deadline `d` by measured throughput (after
            the commit in flight, if any); says so when none can.
commit_estimate()  cheap, from the last scan: the seconds the final commit of the newest complete checkpoint takes
            by the measured throughput (plus the overhead and the final settle), which moves a deadline's ask_at.
fenced()    the run's lease (holding.py, fencing.py): once a newer lease holds the run, nothing more is written and
            the supervisor stops the run.

State for others: <run_dir>/checkpoint_status.json (atomic), read by the heartbeat and shown in training_status.md
(each rewrite tells the supervisor through RunContext.summary_due). The step fallback reads the trainer's progress
from RunContext.progress (detect.read_progress).
Events (ctx.emit; ALSO CALLED FROM THE COMMIT THREAD: the CheckpointHook protocol has no close() to flush a queue
at exit, so queued events could be lost; the recorder's append is one O_APPEND write, and telemetry.on_event must
be thread-safe): checkpoint_committed, sync_failed, durable_full,
checkpoint_restored, restore_verify_failed, final_sync_skipped, checkpoint_resume, local_pruned, ...
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

from onbox import fsutil, paths
from onbox.checkpoints import SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter, CommitResult
from onbox.checkpoints.durable import DurableTarget
from onbox.checkpoints.durable.runlock import commit_lock
from onbox.checkpoints.durable.targets import make_target, overlap_problem
from onbox.checkpoints.holding import HolderMixin
from onbox.checkpoints.leases.fencing import Fenced
from onbox.checkpoints.local.detect import (
    BoundedScan,
    Candidate,
    CheckpointDirTooLarge,
    CompletionTracker,
    ScanBound,
    read_progress,
)
from onbox.checkpoints.localdir import LocalDirMixin
from onbox.checkpoints.resuming import ResumeMixin
from onbox.errors import UsageError
from onbox.proc import boot_id

STATUS_SCHEMA = "onbox.checkpoint_status/1"
DEFAULT_THROUGHPUT = 100 * 1024 * 1024  # bytes/s assumed before the first commit is measured
COMMIT_OVERHEAD_S = 0.5  # fsyncs, manifest, index: per commit, on top of bytes/throughput
FINAL_SETTLE_S = 2.0  # at the final sync the child has stopped: a shorter quiet period suffices
RESCAN_S = 1.0
SETTLE_POLL_S = 0.1  # how often the final commit looks again at a checkpoint still inside its quiet period
LOG_FILES = (paths.OUTPUT_LOG, paths.EVENTS_FILE)  # copied to <durable>/<run>/logs/<box>/ after each commit


def summary(r: CommitResult) -> Dict[str, Any]:
    return {"name": r.name, "step": r.step, "status": r.status, "bytes": r.bytes, "seconds": round(r.seconds, 3),
            "digest": r.digest, "durable": r.url}


class CheckpointCommitHook(ResumeMixin, HolderMixin, LocalDirMixin):
    def __init__(self, ctx: Any, target: Optional[DurableTarget] = None, lease: Any = None) -> None:
        """`lease`: the agent's fencing.RunLease; None for any other committer (a passive lease, holding.py)."""
        self.ctx = ctx
        self.cfg = ctx.config
        self.clock = ctx.clock
        self.ckpt_dir = ctx.ckpt_dir
        self.tracker = CompletionTracker(self.cfg.settle_seconds)
        self.scans = BoundedScan(ctx.ckpt_dir, ScanBound.of(self.cfg), self.clock.monotonic)
        if target is None and self.cfg.durable:
            problem = overlap_problem(self.cfg.durable, ctx.name, ctx.ckpt_dir)
            if problem:  # runhooks.preflight refuses this before a run starts; `onbox sync` flags meet it here
                raise UsageError(problem, hint="give --durable a directory outside --ckpt-dir (and vice versa)")
            # the lease's own target where the agent took one: one rclone rcd per agent (rcd.py), not one each
            store = getattr(lease, "store", None)
            target = store.target if store is not None else make_target(self.cfg.durable, ctx.name)
        self.target = target
        self.status_path = os.path.join(ctx.run_dir, paths.CHECKPOINT_STATUS_FILE)
        self._status_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self.status = self._load_status()
        self._init_lease(target, lease)
        self.committer = CheckpointCommitter(target, ctx.name, self.clock, ctx.emit, guard=self.lease_guard,
                                             stamp=self.lease_stamp, in_lineage=self.in_lineage) if target else None
        self.throughput = float(self.status.get("throughput_bytes_per_s") or DEFAULT_THROUGHPUT)
        self._last_scan = float("-inf")
        self._last_sync = float("-inf")
        # the last commit found its source rewritten (an in-place trainer saved again): try the new content at the
        # next scan instead of a sync interval later, or a trainer saving more often than that never gets one
        self._retry_now = False
        self._done: Dict[str, Any] = {}  # candidate name -> fingerprint already committed (or found committed)
        self._worker: Optional[threading.Thread] = None
        self.cands: List[Candidate] = []
        self.resumed: Optional[Dict[str, Any]] = None  # what the current attempt started from (restore())
        # this box and agent launch, for its own folder under <durable>/<run>/logs/ (containers may share a
        # hostname: the boot id tells boxes apart)
        self.box_logs = "%s-%s.%s" % (re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "box",
                                      (boot_id() or "noboot")[:8],
                                      time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock.time())))

    # -- status file -----------------------------------------------------------------------------------------
    def _load_status(self) -> Dict[str, Any]:
        try:
            doc = fsutil.read_json(self.status_path)
            if isinstance(doc, dict):
                return doc
        except (OSError, ValueError):
            pass
        return {"schema": STATUS_SCHEMA, "run": self.ctx.name, "latest_local": None, "latest_durable": None,
                "verified": False, "last_sync": None}

    def _update_status(self, **fields: Any) -> None:
        with self._status_lock:
            self.status.update(fields)
            self.status["schema"] = STATUS_SCHEMA
            self.status["durable"] = self.target.url if self.target else None
            self.status["updated"] = self.clock.time()
            self.status["throughput_bytes_per_s"] = round(self.throughput)
            try:
                fsutil.atomic_write_json(self.status_path, self.status)
            except OSError as e:  # a full local disk must not kill the supervisor loop
                self.ctx.emit("checkpoint_status_unwritable", error=str(e))
                return
        if self.ctx.summary_due is not None:  # training_status.md shows this file
            self.ctx.summary_due()

    # -- scanning ----------------------------------------------------------------------------------------------
    def scan_now(self, settle: Optional[float] = None) -> List[Candidate]:
        """Rescan the checkpoint dir; the complete candidates, newest last (all of them stay in self.cands)."""
        try:
            found = self.scans.scan()
        except CheckpointDirTooLarge as e:  # nothing in it is a checkpoint onbox can know: said once, found none
            if e.first:
                self.ctx.emit("checkpoint_dir_too_large", error=str(e), **e.fields)
                self._update_status(warning=str(e))
            found = []
        cands = self.tracker.update(found, self.clock.monotonic(), self.clock.time(),
                                    read_progress(self.ctx), settle=settle)
        self.cands = cands
        self._watch_unreadable(cands)
        complete = [c for c in cands if c.complete]
        if complete:
            c = complete[-1]
            latest = {"name": c.name, "step": c.step, "path": c.path, "bytes": c.bytes}
            if latest != self.status.get("latest_local"):
                self._update_status(latest_local=latest)
        return complete

    # -- the protocol --------------------------------------------------------------------------------------------
    def periodic(self) -> None:
        if self.fenced():
            return  # nothing more is written; the supervisor stops the run
        now = self.clock.monotonic()
        if now - self._last_scan < min(RESCAN_S, self.cfg.sync_interval):
            return
        self._last_scan = now
        try:
            complete = self.scan_now()
        except OSError as e:
            self.ctx.emit("checkpoint_scan_failed", error=str(e))
            return
        if self.scans.failed is not None:  # its warning stands (no "no checkpoint yet" over it)
            return
        self._watch_for_none(now)
        if self.committer is None or not complete or (self._worker is not None and self._worker.is_alive()):
            return
        if now - self._last_sync < self.cfg.sync_interval and not self._retry_now:
            return
        newest = complete[-1]
        if self._done.get(newest.name) == newest.fingerprint:
            return
        self._last_sync = now
        self._retry_now = False
        self._worker = threading.Thread(target=self.commit_one, args=(newest,), name="onbox-commit", daemon=True)
        self._worker.start()

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        self.join_worker(deadline)
        if self.committer is None:
            return None
        if self.fenced():  # the commit in flight (waited for above) ended refused, or as a race-window orphan
            self.ctx.emit("final_sync_none", reason="fenced: a newer lease holds the run")
            return None
        if self._worker is not None and self._worker.is_alive():  # never block past the deadline on its lock
            self.ctx.emit("final_sync_none", reason="the periodic commit still runs at the deadline")
            return None
        complete = self._scan_settled(deadline)
        for cand in reversed(complete):
            if self._done.get(cand.name) == cand.fingerprint:
                return self._already(cand)
            left = deadline - self.clock.monotonic()
            estimate = self._estimate(cand)
            if estimate <= left:
                r = self.commit_one(cand)
                if r is not None and r.status in ("committed", "already"):
                    return summary(r)
                continue
            self.ctx.emit("final_sync_skipped", checkpoint=cand.name, step=cand.step, bytes=cand.bytes,
                          estimate_s=round(estimate, 3), left_s=round(left, 3),
                          throughput_bytes_per_s=round(self.throughput))
        self.ctx.emit("final_sync_none", reason="no complete checkpoint could be committed before the deadline"
                      if complete else "no complete checkpoint")
        return None

    def commit_estimate(self) -> Optional[Dict[str, Any]]:
        """What the final commit would take now (the protocol's commit_estimate): the newest complete checkpoint of
        the last scan, by the measured throughput, plus the commit overhead and the final quiet period. None
        without durable storage: nothing is committed."""
        if self.committer is None:
            return None
        complete = [c for c in self.cands if c.complete]
        settle = min(self.cfg.settle_seconds, FINAL_SETTLE_S)
        if not complete:
            return {"seconds": COMMIT_OVERHEAD_S + settle, "bytes": 0, "checkpoint": None,
                    "throughput_bytes_per_s": round(self.throughput)}
        newest = complete[-1]
        return {"seconds": round(self._estimate(newest) + settle, 3), "bytes": newest.bytes,
                "checkpoint": newest.name, "throughput_bytes_per_s": round(self.throughput)}

    def _scan_settled(self, deadline: float) -> List[Candidate]:
        """The complete candidates for the final commit. The child has stopped (or is out of time): a shorter
        quiet period, none at all for files whose format exposes a torn write (the checkpoint it just saved on
        the signal, or right before it exited, is the one worth committing). When the newest entry is still
        inside that quiet period, wait it out, but only while the deadline leaves room for its commit AND for the
        fallback's (the newest complete one): a short preemption grace commits what is complete at once."""
        settle = min(self.cfg.settle_seconds, FINAL_SETTLE_S)
        give_up = self.clock.monotonic() + settle + SETTLE_POLL_S
        while True:
            complete = self.scan_now(settle=settle)
            newest = self.cands[-1] if self.cands else None
            if newest is None or newest.complete or not newest.reason.startswith(("still changing", "still being")):
                return complete
            need = self._estimate(newest) + (self._estimate(complete[-1]) if complete else 0.0)
            now = self.clock.monotonic()
            if now >= give_up or now + SETTLE_POLL_S + need > deadline:
                return complete
            self.clock.sleep(SETTLE_POLL_S)

    def _estimate(self, cand: Candidate) -> float:
        """Seconds a commit of `cand` takes by the measured throughput."""
        return cand.bytes / self.throughput + COMMIT_OVERHEAD_S

    # -- work ------------------------------------------------------------------------------------------------------
    def join_worker(self, deadline: Optional[float]) -> None:
        w = self._worker
        if w is not None and w.is_alive():
            w.join(None if deadline is None else max(0.0, deadline - self.clock.monotonic()))

    def _already(self, cand: Candidate) -> Optional[Dict[str, Any]]:
        d = self.status.get("latest_durable") or {}
        return {"name": d.get("name"), "step": cand.step, "status": "already", "bytes": 0, "seconds": 0.0,
                "digest": d.get("digest"), "durable": self.target.url if self.target else None}

    def _durable_entry(self, name: Optional[str]) -> Optional[Dict[str, Any]]:
        if self.committer is None or name is None:
            return None
        for e in self.committer.committed():
            if e["name"] == name:
                return {"name": name, "step": e.get("step"), "committed_at": e.get("created"),
                        "digest": e.get("digest"), "bytes": e.get("bytes")}
        return None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One committer per run on this box: the agent's thread, `onbox sync` and `onbox verify` (recording a
        re-check in the index) take the same flock (runlock.commit_lock), so a commit never meets another one's
        staging or manifest-less dir (which start() would clean), nor an index rewritten under it."""
        with self._commit_lock, commit_lock(self.ctx.run_dir):
            yield

    def commit_one(self, cand: Candidate) -> Optional[CommitResult]:
        """Commit one candidate under the commit lock; failures become events and status, never exceptions."""
        assert self.committer is not None
        with self._locked(), self.committer.held():
            at = self.clock.time()
            try:
                r = self.committer.commit(cand)
            except Fenced as e:  # the lease said so (the `fenced` event); nothing more is written from here
                self.said_fenced(e, cand.name)
                return None
            except SyncFailed as e:
                if self.fenced():  # the fence stopped this call on its way (fencing.halt): no failure of the storage
                    self.said_fenced(Fenced(self.fenced() or {}), cand.name)
                    return None
                fields = dict(e.details)
                fields.update(checkpoint=cand.name, error=e.message, errno=e.errno_name,
                              durable=self.committer.target.url)
                self.ctx.emit("sync_failed", **fields)
                self._update_status(last_sync={"ok": False, "error": e.message, "at": at, "bytes": 0,
                                               "seconds": 0.0, "checkpoint": cand.name})
                return None
            except Exception as e:  # a bug in the committer must not kill the supervisor loop; say it loudly
                self.ctx.emit("sync_failed", checkpoint=cand.name, error="%s: %s" % (type(e).__name__, e))
                self._update_status(last_sync={"ok": False, "error": "%s: %s" % (type(e).__name__, e),
                                               "at": at, "bytes": 0, "seconds": 0.0, "checkpoint": cand.name})
                return None
            if r.status == "source_changed":
                self._retry_now = True
                return r
            self._done[cand.name] = cand.fingerprint
            if r.status == "committed" and r.bytes >= 16 * 1024 * 1024:
                self.throughput = 0.5 * self.throughput + 0.5 * (r.bytes / r.seconds)
            try:  # the commit stands whatever retention meets: an error here is said, never the commit undone
                self.sweep_orphans()  # an old holder's race-window commit, seen since: to quarantine/
                # the attempt's resume point stays while it runs: a group's other nodes fetch it (and a node that
                # restarts fetches it again) while node 0 trains on and commits
                resumed = (self.resumed or {}).get("name")
                self.committer.apply_retention(self.cfg.keep_last, self.cfg.keep_best_metric,
                                               self.cfg.keep_best_mode, self.cfg.keep_every_steps,
                                               pinned=[resumed] if isinstance(resumed, str) else [])
            except Fenced as e:
                self.said_fenced(e, r.name)
            except (SyncFailed, OSError) as e:
                self.ctx.emit("retention_failed", checkpoint=r.name, error=getattr(e, "message", None) or str(e),
                              hint="older checkpoints stay on durable storage until a later commit retires them")
            self._update_status(latest_durable=self._durable_entry(r.name), verified=True,
                                last_sync={"ok": True, "error": None, "at": at, "bytes": r.bytes,
                                           "seconds": round(r.seconds, 3), "checkpoint": r.name, "status": r.status})
            if self.cfg.prune_local:
                self.prune_local()
            self.sync_logs()
            return r

    def sync_logs(self) -> None:
        """Copy the run's output log (with its rotated parts) and events next to the checkpoints, best effort,
        into <durable>/<run>/logs/<box>/: one folder per box and agent launch, so a replacement box (or a
        relaunch) never replaces what an earlier one left there."""
        assert self.target is not None
        try:
            self.lease_guard("the run's logs")
        except (SyncFailed, OSError):
            return  # fenced (said), or the leases cannot be listed: the logs wait for the next commit
        names = [n for n in LOG_FILES if os.path.isfile(os.path.join(self.ctx.run_dir, n))]
        names += sorted(n for n in os.listdir(self.ctx.run_dir) if re.match(r"^%s\.\d+$" % re.escape(paths.OUTPUT_LOG), n))
        names += sorted(n for n in os.listdir(self.ctx.run_dir) if paths.HANG_STACKS_RE.match(n))  # a hang's evidence
        try:
            self.target.put_logs(self.ctx.run_dir, names, self.box_logs)
        except (SyncFailed, OSError) as e:
            self.ctx.emit("log_sync_failed", files=names, error=str(e))
