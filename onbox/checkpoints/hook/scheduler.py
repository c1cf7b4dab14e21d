"""When the checkpoint hook commits: every tick a cheap rescan (at most once a second), and when sync_interval is
due and a newer complete checkpoint exists, a commit in a background thread so that the loop never blocks on I/O;
the final commit at a stop, against a monotonic deadline, by the measured throughput; the estimate of that commit
that moves a deadline's ask_at; the run's logs copied beside the checkpoints after each commit.

Events (emit; ALSO CALLED FROM THE COMMIT THREAD: the CheckpointHook protocol has no close() to flush a queue at
exit, so queued events could be lost; the recorder's append is one O_APPEND write, and telemetry.on_event must be
thread-safe): checkpoint_committed, sync_failed, durable_full, final_sync_skipped, final_sync_none, ...
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from onbox import paths
from onbox.checkpoints import SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter, CommitResult
from onbox.checkpoints.durable import DurableTarget
from onbox.checkpoints.durable.runlock import commit_lock
from onbox.checkpoints.hook.holder import LeaseHolder
from onbox.checkpoints.hook.localdir import LocalDirScanner
from onbox.checkpoints.hook.status import StatusFile
from onbox.checkpoints.leases.fencing import Fenced
from onbox.checkpoints.local.detect import Candidate
from onbox.proc import boot_id

COMMIT_OVERHEAD_S = 0.5  # fsyncs, manifest, index: per commit, on top of bytes/throughput
FINAL_SETTLE_S = 2.0  # at the final sync the child has stopped: a shorter quiet period suffices
RESCAN_S = 1.0
SETTLE_POLL_S = 0.1  # how often the final commit looks again at a checkpoint still inside its quiet period
LOG_FILES = (paths.OUTPUT_LOG, paths.EVENTS_FILE)  # copied to <durable>/<run>/logs/<box>/ after each commit


def commit_seconds(nbytes: float, throughput: float, settle: float = 0.0) -> float:
    """Seconds a commit of `nbytes` takes at `throughput` bytes/s, with the commit's overhead and `settle` (the
    final quiet period, final_settle()): the one estimate, for the final commit here and a launch's deadline
    (onbox/subsystems.py)."""
    return nbytes / throughput + COMMIT_OVERHEAD_S + settle


def final_settle(settle_seconds: float) -> float:
    """The quiet period of the final commit: the run's settle_seconds, at most FINAL_SETTLE_S."""
    return min(settle_seconds, FINAL_SETTLE_S)


def summary(r: CommitResult) -> Dict[str, Any]:
    return {"name": r.name, "step": r.step, "status": r.status, "bytes": r.bytes, "seconds": round(r.seconds, 3),
            "digest": r.digest, "durable": r.url}


def _step_time(entry: Dict[str, Any]) -> Optional[float]:
    """When the trainer reported the checkpoint's step (its metrics' `time`: the progress report at its step), the
    moment work at risk is measured from; None when it reported none (the commit time is then the nearest)."""
    metrics = entry.get("metrics")
    at = metrics.get("time") if isinstance(metrics, dict) else None
    if isinstance(at, bool) or not isinstance(at, (int, float)) or at != at or abs(at) == float("inf"):
        return None
    created = entry.get("created")
    return None if isinstance(created, (int, float)) and at > created else float(at)


class CommitScheduler:
    """The commits of one run on this box: the periodic one (in the thread `onbox-commit`) and the final one.
    `pinned()` names the checkpoints retention must keep whatever its rules say (the current resume point)."""

    def __init__(self, run_dir: str, cfg: Any, clock: Any, emit: Callable[..., None],
                 target: Optional[DurableTarget], committer: Optional[CheckpointCommitter],
                 scanner: LocalDirScanner, holder: LeaseHolder, status: StatusFile,
                 pinned: Callable[[], List[str]]) -> None:
        self.run_dir = run_dir
        self.cfg = cfg
        self.clock = clock
        self.emit = emit
        self.target = target
        self.committer = committer
        self.scanner = scanner
        self.holder = holder
        self.status = status
        self.pinned = pinned
        self._commit_lock = threading.Lock()
        self.last_scan = float("-inf")
        self.last_sync = float("-inf")
        # the last commit found its source rewritten (an in-place trainer saved again): try the new content at the
        # next scan instead of a sync interval later, or a trainer saving more often than that never gets one
        self.retry_now = False
        self.done: Dict[str, Any] = {}  # candidate name -> fingerprint already committed (or found committed)
        self.worker: Optional[threading.Thread] = None
        # this box and agent launch, for its own folder under <durable>/<run>/logs/ (containers may share a
        # hostname: the boot id tells boxes apart)
        self.box_logs = "%s-%s.%s" % (re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "box",
                                      (boot_id() or "noboot")[:8],
                                      time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock.time())))

    @property
    def busy(self) -> bool:
        """A periodic commit runs now."""
        return self.worker is not None and self.worker.is_alive()

    def tick(self) -> None:
        """The loop's tick (CheckpointHook.periodic): a rescan when one is due, and a commit when one is."""
        if self.holder.fenced():
            return  # nothing more is written; the supervisor stops the run
        now = self.clock.monotonic()
        if now - self.last_scan < min(RESCAN_S, self.cfg.sync_interval):
            return
        self.last_scan = now
        try:
            complete = self.scanner.scan()
        except OSError as e:
            self.emit("checkpoint_scan_failed", error=str(e))
            return
        if self.scanner.scans.failed is not None:  # its warning stands (no "no checkpoint yet" over it)
            return
        self.scanner.watch_for_none(now)
        if self.committer is None or not complete or self.busy:
            return
        if now - self.last_sync < self.cfg.sync_interval and not self.retry_now:
            return
        newest = complete[-1]
        if self.done.get(newest.name) == newest.fingerprint:
            return
        self.last_sync = now
        self.retry_now = False
        self.worker = threading.Thread(target=self.commit_one, args=(newest,), name="onbox-commit", daemon=True)
        self.worker.start()

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        """CheckpointHook.final: the newest complete checkpoint whose commit can finish before `deadline`."""
        self.join_worker(deadline)
        if self.committer is None:
            return None
        if self.holder.fenced():  # the commit in flight (waited for above) ended refused, or as a race-window orphan
            self.emit("final_sync_none", reason="fenced: a newer lease holds the run")
            return None
        if self.busy:  # never block past the deadline on its lock
            self.emit("final_sync_none", reason="the periodic commit still runs at the deadline")
            return None
        complete = self._scan_settled(deadline)
        for cand in reversed(complete):
            if self.done.get(cand.name) == cand.fingerprint:
                return self._already(cand)
            left = deadline - self.clock.monotonic()
            estimate = self._estimate(cand)
            if estimate <= left:
                r = self.commit_one(cand)
                if r is not None and r.status in ("committed", "already"):
                    return summary(r)
                continue
            self.emit("final_sync_skipped", checkpoint=cand.name, step=cand.step, bytes=cand.bytes,
                      estimate_s=round(estimate, 3), left_s=round(left, 3),
                      throughput_bytes_per_s=round(self.status.throughput))
        self.emit("final_sync_none", reason="no complete checkpoint could be committed before the deadline"
                  if complete else "no complete checkpoint")
        return None

    def estimate(self) -> Optional[Dict[str, Any]]:
        """What the final commit would take now (CheckpointHook.commit_estimate): the newest complete checkpoint
        of the last scan, by the measured throughput, plus the commit overhead and the final quiet period. None
        without durable storage: nothing is committed."""
        if self.committer is None:
            return None
        complete = self.scanner.complete()
        settle = final_settle(self.cfg.settle_seconds)
        throughput = round(self.status.throughput)
        if not complete:
            return {"seconds": commit_seconds(0, self.status.throughput, settle), "bytes": 0, "checkpoint": None,
                    "throughput_bytes_per_s": throughput}
        newest = complete[-1]
        seconds = commit_seconds(newest.bytes, self.status.throughput, settle)
        return {"seconds": round(seconds, 3), "bytes": newest.bytes, "checkpoint": newest.name,
                "throughput_bytes_per_s": throughput}

    def _scan_settled(self, deadline: float) -> List[Candidate]:
        """The complete candidates for the final commit. The child has stopped (or is out of time): a shorter
        quiet period, none at all for files whose format exposes a torn write (the checkpoint it just saved on
        the signal, or right before it exited, is the one worth committing). When the newest entry is still
        inside that quiet period, wait it out, but only while the deadline leaves room for its commit AND for the
        fallback's (the newest complete one): a short preemption grace commits what is complete at once."""
        settle = final_settle(self.cfg.settle_seconds)
        give_up = self.clock.monotonic() + settle + SETTLE_POLL_S
        while True:
            complete = self.scanner.scan(settle=settle)
            cands = self.scanner.cands
            newest = cands[-1] if cands else None
            if newest is None or newest.complete or not newest.reason.startswith(("still changing", "still being")):
                return complete
            need = self._estimate(newest) + (self._estimate(complete[-1]) if complete else 0.0)
            now = self.clock.monotonic()
            if now >= give_up or now + SETTLE_POLL_S + need > deadline:
                return complete
            self.clock.sleep(SETTLE_POLL_S)

    def _estimate(self, cand: Candidate) -> float:
        """Seconds a commit of `cand` takes by the measured throughput."""
        return commit_seconds(cand.bytes, self.status.throughput)

    def join_worker(self, deadline: Optional[float]) -> None:
        w = self.worker
        if w is not None and w.is_alive():
            w.join(None if deadline is None else max(0.0, deadline - self.clock.monotonic()))

    def _already(self, cand: Candidate) -> Optional[Dict[str, Any]]:
        d = self.status.get("latest_durable") or {}
        return {"name": d.get("name"), "step": cand.step, "status": "already", "bytes": 0, "seconds": 0.0,
                "digest": d.get("digest"), "durable": self.target.url if self.target else None}

    def durable_entry(self, name: Optional[str]) -> Optional[Dict[str, Any]]:
        """latest_durable of checkpoint_status.json for the committed checkpoint `name`."""
        if self.committer is None or name is None:
            return None
        for e in self.committer.committed():
            if e["name"] == name:
                return {"name": name, "step": e.get("step"), "committed_at": e.get("created"),
                        "digest": e.get("digest"), "bytes": e.get("bytes"), "step_time": _step_time(e)}
        return None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One committer per run on this box: the agent's thread, `onbox sync` and `onbox verify` (recording a
        re-check in the index) take the same flock (runlock.commit_lock), so a commit never meets another one's
        staging or manifest-less dir (which start() would clean), nor an index rewritten under it."""
        with self._commit_lock, commit_lock(self.run_dir):
            yield

    def commit_one(self, cand: Candidate) -> Optional[CommitResult]:
        """Commit one candidate under the commit lock; failures become events and status, never exceptions."""
        committer = self.committer
        assert committer is not None
        with self.locked(), committer.held():
            at = self.clock.time()
            try:
                r = committer.commit(cand)
            except Fenced as e:  # the lease said so (the `fenced` event); nothing more is written from here
                self.holder.said_fenced(e, cand.name)
                return None
            except SyncFailed as e:
                if self.holder.fenced():  # the fence stopped this call on its way (fencing.halt): not the storage's
                    self.holder.said_fenced(Fenced(self.holder.fenced() or {}), cand.name)
                    return None
                fields = dict(e.details)
                fields.update(checkpoint=cand.name, error=e.message, errno=e.errno_name, durable=committer.target.url)
                self.emit("sync_failed", **fields)
                self.status.update(last_sync={"ok": False, "error": e.message, "at": at, "bytes": 0,
                                              "seconds": 0.0, "checkpoint": cand.name})
                return None
            except Exception as e:  # a bug in the committer must not kill the supervisor loop; say it loudly
                self.emit("sync_failed", checkpoint=cand.name, error="%s: %s" % (type(e).__name__, e))
                self.status.update(last_sync={"ok": False, "error": "%s: %s" % (type(e).__name__, e),
                                              "at": at, "bytes": 0, "seconds": 0.0, "checkpoint": cand.name})
                return None
            if r.status == "source_changed":
                self.retry_now = True
                return r
            self.done[cand.name] = cand.fingerprint
            if r.status == "committed" and r.bytes >= 16 * 1024 * 1024:
                self.status.throughput = 0.5 * self.status.throughput + 0.5 * (r.bytes / r.seconds)
            try:  # the commit stands whatever retention meets: an error here is said, never the commit undone
                self.holder.sweep_orphans(committer)  # an old holder's race-window commit, seen since: to quarantine/
                # the attempt's resume point stays while it runs: a group's other nodes fetch it (and a node that
                # restarts fetches it again) while node 0 trains on and commits
                committer.apply_retention(self.cfg.keep_last, self.cfg.keep_best_metric, self.cfg.keep_best_mode,
                                          self.cfg.keep_every_steps, pinned=self.pinned())
            except Fenced as e:
                self.holder.said_fenced(e, r.name)
            except (SyncFailed, OSError) as e:
                self.emit("retention_failed", checkpoint=r.name, error=getattr(e, "message", None) or str(e),
                          hint="older checkpoints stay on durable storage until a later commit retires them")
            self.status.update(latest_durable=self.durable_entry(r.name), verified=True,
                               last_sync={"ok": True, "error": None, "at": at, "bytes": r.bytes,
                                          "seconds": round(r.seconds, 3), "checkpoint": r.name, "status": r.status})
            if self.cfg.prune_local:
                self.scanner.prune(committer)
            self.sync_logs()
            return r

    def sync_logs(self) -> None:
        """Copy the run's output log (with its rotated parts) and events next to the checkpoints, best effort,
        into <durable>/<run>/logs/<box>/: one folder per box and agent launch, so a replacement box (or a
        relaunch) never replaces what an earlier one left there."""
        assert self.target is not None
        try:
            self.holder.guard("the run's logs")
        except (SyncFailed, OSError):
            return  # fenced (said), or the leases cannot be listed: the logs wait for the next commit
        names = [n for n in LOG_FILES if os.path.isfile(os.path.join(self.run_dir, n))]
        names += sorted(n for n in os.listdir(self.run_dir) if re.match(r"^%s\.\d+$" % re.escape(paths.OUTPUT_LOG), n))
        names += sorted(n for n in os.listdir(self.run_dir) if paths.HANG_STACKS_RE.match(n))  # a hang's evidence
        try:
            self.target.put_logs(self.run_dir, names, self.box_logs)
        except (SyncFailed, OSError) as e:
            self.emit("log_sync_failed", files=names, error=str(e))
