"""Where the next attempt starts: the restore before each attempt, keeping aside what the trainer left torn, and the
fallback when an attempt crashes on the checkpoint it resumed from (quarantine). A part of CheckpointCommitHook
(the package's __init__), built on the scanner, the scheduler (its commit lock, the commit in flight) and the lease
holder."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import fsutil, paths
from onbox.checkpoints import SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import DurableTarget
from onbox.checkpoints.durable.index import make_check
from onbox.checkpoints.hook.holder import LeaseHolder
from onbox.checkpoints.hook.localdir import LocalDirScanner
from onbox.checkpoints.hook.scheduler import CommitScheduler
from onbox.checkpoints.hook.status import StatusFile
from onbox.checkpoints.leases.fencing import Fenced
from onbox.checkpoints.local.detect import (
    Candidate,
    current_fingerprint,
    entry_paths,
    order_key,
    path_fingerprint,
)
from onbox.checkpoints.local.restore import RestoreResult, restore_newest, set_aside


def newer(c: Candidate, manifest: Dict[str, Any]) -> bool:
    """The local candidate holds a later checkpoint than the committed one (by step, else by time)."""
    step = manifest.get("step")
    if c.step is not None and isinstance(step, int):
        return c.step > step
    return c.newest_mtime > (manifest.get("created") or 0)


class Restorer:
    """restore() and after_failure() of the CheckpointHook protocol; `resumed`: what the current attempt started
    from (path, committed name or None, step, when), or None."""

    def __init__(self, ckpt_dir: str, run_dir: str, cfg: Any, clock: Any, emit: Callable[..., None],
                 target: Optional[DurableTarget], committer: Optional[CheckpointCommitter],
                 scanner: LocalDirScanner, scheduler: CommitScheduler, holder: LeaseHolder, status: StatusFile,
                 progress: Callable[[], Dict[str, Any]]) -> None:
        self.ckpt_dir = ckpt_dir
        self.run_dir = run_dir
        self.cfg = cfg
        self.clock = clock
        self.emit = emit
        self.target = target
        self.committer = committer
        self.scanner = scanner
        self.scheduler = scheduler
        self.holder = holder
        self.status = status
        self.progress = progress
        self.resumed: Optional[Dict[str, Any]] = None

    def pinned(self) -> List[str]:
        """The committed checkpoint the current attempt resumed from, for retention to keep."""
        name = (self.resumed or {}).get("name")
        return [name] if isinstance(name, str) else []

    def restore(self) -> Optional[str]:
        # a restart waits for the commit the previous attempt left in flight (bounded: a hung mount must not
        # keep the job down); if it still runs, the local checkpoint it is committing is the newest anyway
        self.scheduler.join_worker(self.clock.monotonic() + self.cfg.final_sync_timeout)
        # no child runs before an attempt: nothing is being written, so no quiet period (torn files still fail)
        local = self.scanner.scan(settle=0.0)
        # a local checkpoint newer than the durable ones is this lineage's only if this box held the run last
        local_ok = self.holder.local_counts()
        newest_local = local[-1] if local and local_ok else None
        self.resumed = None
        if self.scheduler.busy:
            self.emit("restore_durable_skipped", reason="a commit still runs after %.0f s"
                          % self.cfg.final_sync_timeout)
            return self._resume_local(newest_local)
        if self.committer is not None:
            try:
                with self.scheduler.locked(), self.committer.held():
                    committed = self.committer.committed()
                    self.committer.start()  # after the read: its listing serves the cleanup too
                    entries = self.holder.restorable(self.committer, committed)  # this lease's lineage only
                    names = [e["name"] for e in reversed(entries)]
                    res = restore_newest(self.committer.target, names, self.ckpt_dir, self.emit,
                                         local_wins=lambda m: newest_local is not None and newer(newest_local, m))
                    self._record_restore_checks(res)
                    self._quarantine_unusable(res.unusable)
            except Fenced as e:  # a newer lease holds the run: no attempt starts here (the supervisor ends it)
                self.holder.said_fenced(e)
                return None
            except (SyncFailed, OSError) as e:
                self.emit("restore_failed", error=str(e), durable=self.target.url if self.target else None)
                res = None
            if res is not None and res.rejected:
                self.status.update(restore_rejected=[{"name": n, "problem": p} for n, p in res.rejected])
            if (res is None or not res.path) and newest_local is None:
                self._say_from_scratch(res)
            if not local_ok:
                self.holder.set_aside_foreign(self.scanner.cands, res.path if res is not None else None, res.step if res is not None else None,
                                       res.created if res is not None else None)
            self.holder.note_resumed(res.name if res is not None and res.path else None)
            if res is not None and res.path:
                self._set_aside_torn(res.step, res.created, keep=res.path)
                self.status.update(latest_durable=self.scheduler.durable_entry(res.name), verified=True,
                                    resume_from={"path": res.path, "source": res.source, "name": res.name})
                self.emit("checkpoint_resume", path=res.path, checkpoint=res.name, step=res.step,
                              source=res.source)
                self.resumed = {"path": res.path, "name": res.name, "step": res.step, "at": self.clock.time(),
                                "when": res.created or 0.0, "fingerprint": path_fingerprint(res.path)}
                return res.path
        return self._resume_local(newest_local)

    def _quarantine_unusable(self, unusable: List[Tuple[str, str]]) -> None:
        """Checkpoints that can never be restored (a refused manifest, a copy that does not match its manifest)
        leave <run>/checkpoints/ for <run>/quarantine/, whole and never deleted, so that no box tries them again
        and retention counts only what can be restored. The caller holds the commit lock."""
        assert self.committer is not None
        for name, problem in unusable:
            reason = "it cannot be restored: %s" % problem
            try:
                dest = self.committer.quarantine(name, reason)
            except (SyncFailed, OSError) as e:
                self.emit("quarantine_failed", checkpoint=name, error=str(e))
                continue
            entry = {"name": name, "step": None, "reason": reason, "at": self.clock.time(),
                     "moved_to": {"durable": dest}}
            self.status.add_quarantined(entry)
            self.emit("checkpoint_quarantined", checkpoint=name, step=None, reason=reason, fallback=None,
                          moved_to={"durable": dest})

    def _say_from_scratch(self, res: Optional[RestoreResult]) -> None:
        """The attempt is about to start from step 0: when durable storage holds (or held until this restore)
        checkpoints, that is never silent — an alert (a state warning, via the run notes) and a status line."""
        try:
            left = len(self.committer.committed()) if self.committer is not None else 0
        except (SyncFailed, OSError):
            left = 0
        refused = [{"name": n, "problem": p} for n, p in (res.rejected if res is not None else [])]
        if not left and not refused and res is not None:
            if self.status.get("from_scratch"):
                self.status.update(from_scratch=None)
            return
        why = ("durable storage could not be read" if res is None else
               "none of the %d checkpoint(s) on durable storage could be restored" % (left + len(res.unusable))
               if refused else "durable storage holds %d checkpoint(s) but none was restored" % left)
        self.status.update(from_scratch={"at": self.clock.time(), "why": why, "rejected": refused[:10]})
        self.emit("resume_from_scratch", why=why, rejected=refused[:10],
                      durable=self.target.url if self.target else None)

    def _record_restore_checks(self, res: RestoreResult) -> None:
        """The durable copies this restore fetched and checked against their manifests, recorded in the index
        (the caller holds the commit lock). A failure to write it is said, never fatal: the restore stands."""
        if not res.checks or self.committer is None:
            return
        now = self.clock.time()
        checks = {name: {"digest": digest, "check": make_check("restore", ok, problems, ["size", "sha256",
                                                                                        "format"], now)}
                  for name, digest, ok, problems in res.checks}
        try:
            self.committer.record_checks(checks)
        except (SyncFailed, OSError) as e:
            self.emit("index_update_failed", error=str(e), durable=self.committer.target.url)

    def _resume_local(self, newest_local: Optional[Candidate]) -> Optional[str]:
        self._set_aside_torn(newest_local.step if newest_local else None,
                             newest_local.newest_mtime if newest_local else None,
                             keep=newest_local.path if newest_local else None)
        if newest_local is None:
            return None
        self.status.update(resume_from={"path": newest_local.path, "source": "local-unsynced",
                                         "name": newest_local.name})
        self.emit("checkpoint_resume", path=newest_local.path, checkpoint=newest_local.name,
                      step=newest_local.step, source="local")
        self.resumed = {"path": newest_local.path, "name": None, "step": newest_local.step,
                        "at": self.clock.time(), "when": newest_local.newest_mtime,
                        "fingerprint": newest_local.fingerprint}
        return newest_local.path

    def after_failure(self, seconds: float) -> bool:
        """The attempt failed after `seconds`. When it had resumed from a checkpoint and failed before getting
        past that checkpoint's step, within restore_probation seconds, the checkpoint is quarantined (moved
        aside whole, on durable storage and locally, never deleted) so that the next attempt falls back to the
        newest older one: True. False when the failure says nothing against the checkpoint, or when no older
        checkpoint is left (the checkpoint stays; the supervisor's crash-loop rule decides)."""
        r = self.resumed
        if r is None or seconds > self.cfg.restore_probation:
            return False
        progress = self.progress()
        step, at = progress.get("step"), progress.get("time")
        if (isinstance(step, int) and isinstance(r["step"], int) and isinstance(at, (int, float))
                and at >= r["at"] and step > r["step"]):
            return False  # it got past the checkpoint: the failure is the training's, not the checkpoint's
        label = r["name"] or os.path.basename(r["path"])
        # the quarantine takes the commit lock: wait for the commit in flight no longer than restore() does (a
        # commit hung on a dead mount holds the lock for good, and the supervisor must go on); if it still runs,
        # restore() skips the durable side too, and the crash-loop rule decides
        self.scheduler.join_worker(self.clock.monotonic() + self.cfg.final_sync_timeout)
        if self.scheduler.busy:
            self.emit("quarantine_skipped", checkpoint=label, step=r["step"], reason="a commit still runs "
                          "after %.0f s" % self.cfg.final_sync_timeout)
            return False
        fallback = self._fallback_for(r)
        if fallback is None:
            self.emit("restore_fallback_exhausted", checkpoint=label, step=r["step"], seconds=round(seconds, 3))
            return False
        reason = "an attempt resumed from it and failed after %.1f s before getting past step %s" % (
            seconds, r["step"])
        moved: Dict[str, str] = {}
        try:
            if self.committer is not None:
                with self.scheduler.locked():
                    # a local checkpoint the attempt resumed from may have been committed while it ran (the
                    # periodic commit of the newest one): that copy goes too, or the next restore fetches it back
                    names = [r["name"]] if r["name"] is not None else self._committed_copies(r)
                    dests = [self.committer.quarantine(n, reason) for n in names]
                    if dests:
                        moved["durable"] = ", ".join(dests)
            if r["fingerprint"] is not None and path_fingerprint(r["path"]) == r["fingerprint"]:
                moved["local"] = set_aside(self.ckpt_dir, r["path"], "quarantined: " + reason, self.emit)
        except (SyncFailed, OSError) as e:
            self.emit("quarantine_failed", checkpoint=label, error=str(e), **moved)
            return bool(moved)
        self.resumed = None
        entry = {"name": label, "step": r["step"], "reason": reason, "at": self.clock.time(), "moved_to": moved}
        self.status.add_quarantined(entry)
        self.emit("checkpoint_quarantined", checkpoint=label, step=r["step"], reason=reason, fallback=fallback,
                      moved_to=moved)
        return True

    def _committed_copies(self, r: Dict[str, Any]) -> List[str]:
        """The committed checkpoints holding exactly the local files an attempt resumed from (same name, sizes
        and mtimes as when it resumed)."""
        fp = r["fingerprint"]
        if fp is None or self.committer is None:
            return []
        want = [[rel, size, mtime_ns] for rel, size, mtime_ns, _ino in fp]
        local_name = os.path.basename(r["path"])
        return [e["name"] for e in self.committer.committed()
                if e.get("local_name") == local_name and e.get("source_fingerprint") == want]

    def _fallback_for(self, r: Dict[str, Any]) -> Optional[str]:
        """The newest checkpoint older than the one an attempt resumed from, committed or local, or None."""
        def older(step: Any, when: float) -> bool:
            if isinstance(step, int) and isinstance(r["step"], int):
                return step < r["step"]
            return when < r["when"]

        found: List[Any] = []
        if self.committer is not None:
            try:
                found += [((e.get("step") if isinstance(e.get("step"), int) else -1), e.get("created") or 0.0,
                           e["name"]) for e in self.committer.committed()
                          if self.holder.in_lineage(e) and e["name"] != r["name"]
                          and older(e.get("step"), e.get("created") or 0.0)]
            except (SyncFailed, OSError):
                pass
        found += [(*order_key(c), c.name) for c in self.scanner.cands
                  if c.complete and c.path != r["path"] and older(c.step, c.newest_mtime)]
        return max(found)[2] if found else None

    def _set_aside_torn(self, step: Optional[int], when: Optional[float], keep: Optional[str]) -> None:
        """Before an attempt, keep aside what this run's trainer left torn or half-saved and that is newer than
        the checkpoint the attempt resumes from: a trainer that picks its newest checkpoint by itself (HF
        `resume_from_checkpoint=True`, a glob for the highest step) would otherwise load it and crash. Only
        entries written since the run started: a user's own files are never moved."""
        started = (self._run_state().get("started_at") or self.clock.time())
        for c in list(self.scanner.cands):
            if c.complete or c.newest_mtime < started or c.path == keep:
                continue
            if current_fingerprint(c) != c.fingerprint:  # not what was judged (or gone): leave it
                continue
            if step is not None and c.step is not None:
                if c.step <= step:
                    continue
            elif when is not None and c.newest_mtime <= when:
                continue
            for path in entry_paths(c):  # its file or dir, or a group's files
                try:
                    set_aside(self.ckpt_dir, path, c.reason, self.emit)
                except OSError as e:
                    self.emit("set_aside_failed", path=path, error=str(e))

    def _run_state(self) -> Dict[str, Any]:
        try:
            doc = fsutil.read_json(os.path.join(self.run_dir, paths.STATE_FILE))
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

