"""The checkpoint hook's look at the box's own checkpoint dir: the scans (bounded) and what each found complete,
its newest entry unreadable here (nothing newer than durable storage holds is committed), nothing in the dir counting
as a checkpoint (what is there and why none counts, local/whynone.py: the trainer writes elsewhere, under names onbox
leaves out, or never finishes a save), and committed local copies pruned when the local disk runs low (U6).
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, List, Optional

from onbox import fsutil, vocab
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.hook.status import StatusFile
from onbox.checkpoints.local import whynone
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import (
    BoundedScan,
    Candidate,
    CheckpointDirTooLarge,
    ScanBound,
    Selection,
    entry_paths,
)
from onbox.checkpoints.local.watch import DirWatch

NO_CHECKPOINT_INTERVALS = 5  # sync intervals with an empty checkpoint dir before it is worth a warning


class LocalDirScanner:
    """Scans `ckpt_dir` within its bound, judges each entry's completeness (CompletionTracker) with the trainer's
    progress, and keeps the newest scan's candidates (`cands`, newest last)."""

    def __init__(self, ckpt_dir: str, cfg: Any, clock: Any, emit: Callable[..., None], status: StatusFile,
                 progress: Callable[[], Dict[str, Any]]) -> None:
        self.ckpt_dir = ckpt_dir
        self.cfg = cfg
        self.clock = clock
        self.emit = emit
        self.status = status
        self.progress = progress
        self.watch: Optional[DirWatch] = None
        self.tracker = CompletionTracker(cfg.settle_seconds)
        self.scans = BoundedScan(ckpt_dir, ScanBound.of(cfg), clock.monotonic, Selection.of(cfg))
        self.cands: List[Candidate] = []
        self._first_look: Optional[float] = None
        self._warned_none = False
        self.finished = whynone.FinishWatch(cfg.settle_seconds)  # when the trainer first finished a save-like entry

    def complete(self) -> List[Candidate]:
        """The complete candidates of the last scan, newest last (no scan)."""
        return [c for c in self.cands if c.complete]

    def _watching(self) -> None:
        """The dir's inotify watch, started once the dir exists (the trainer may create it): a rename into it or a
        close after writing finishes an entry at once; without one, quiet does (watch.py)."""
        if self.watch is None and os.path.isdir(self.ckpt_dir):
            self.watch = DirWatch(self.ckpt_dir)
            self.tracker.watch = self.watch
            select = self.scans.select
            fields = {"watch": None if self.watch.available else self.watch.problem,
                      "selection": {"patterns": list(select.patterns), "ignore": list(select.ignore)}
                      if select.patterns or select.ignore else None}
            if any(self.status.get(k) != v for k, v in fields.items()):
                self.status.update(**fields)

    def scan(self, settle: Optional[float] = None) -> List[Candidate]:
        """Rescan the checkpoint dir; the complete candidates, newest last (all of them stay in `cands`)."""
        self._watching()
        try:
            found = self.scans.scan()
        except CheckpointDirTooLarge as e:  # nothing in it is a checkpoint onbox can know: said once, found none
            if e.first:
                self.emit("checkpoint_dir_too_large", error=str(e), **e.fields)
                self.status.update(warning=str(e), warning_code=vocab.CHECKPOINT_DIR_TOO_LARGE,
                                   warning_hint="give --ckpt-dir the directory the trainer saves its checkpoints to")
            found = []
        cands = self.tracker.update(found, self.clock.monotonic(), self.clock.time(), self.progress(),
                                    settle=settle)
        self.cands = cands
        self._watch_unreadable(cands)
        complete = [c for c in cands if c.complete]
        if complete:
            c = complete[-1]
            latest = {"name": c.name, "step": c.step, "path": c.path, "bytes": c.bytes}
            if latest != self.status.get("latest_local"):
                self.status.update(latest_local=latest)
        return complete

    def _watch_unreadable(self, cands: List[Candidate]) -> None:
        """When the newest entry of the checkpoint dir cannot be read here (permissions, an I/O error), nothing
        newer than what durable storage holds is committed, whatever the last sync's "ok" says: an event and a
        status line when that starts (checkpoint_unreadable) and when it ends (checkpoint_readable)."""
        # by time: a file that cannot be read may not tell its step either
        newest = max(cands, key=lambda c: c.newest_mtime) if cands else None
        bad = newest is not None and newest.reason.startswith("unreadable: ")
        was = self.status.get("unreadable")
        if bad and newest is not None and (not was or was.get("name") != newest.name):
            problem = newest.reason[len("unreadable: "):]
            self.status.update(unreadable={"name": newest.name, "path": newest.path, "problem": problem})
            self.emit("checkpoint_unreadable", checkpoint=newest.name, path=newest.path, problem=problem)
        elif not bad and was:
            self.status.update(unreadable=None)
            self.emit("checkpoint_readable", checkpoint=was.get("name"))

    def watch_for_none(self, now: float) -> None:
        """Say why nothing counts (an event once, `no_checkpoint_yet`, and the `no_checkpoint` warning in
        checkpoint_status.json that `onbox status`, the beats, `onboxctl status` and the dashboard show: what IS in
        the dir and why none of it is a checkpoint, local/whynone.py) while nothing in the checkpoint dir is
        complete: a short grace (the settle period, at most a sync interval) after the trainer first finished
        something save-like there, or after NO_CHECKPOINT_INTERVALS sync intervals with no candidate at all (the
        trainer writes elsewhere, or not at all). It goes once a checkpoint is complete."""
        if self._first_look is None:
            self._first_look = now
        if any(c.complete for c in self.cands):
            self.finished.reset()
            if self.status.get("warning"):
                self.status.update(warning=None, warning_code=None, warning_hint=None)
            return
        if self.status.get("warning_code") == vocab.CHECKPOINT_DIR_TOO_LARGE:  # the scan passed: it is no longer
            self.status.update(warning=None, warning_code=None, warning_hint=None)
        entries = whynone.survey(self.ckpt_dir, self.scans.select, self.cands)
        first = self.finished.update(entries, now, self.watch)
        waited = now - self._first_look
        grace = min(self.cfg.sync_interval, self.cfg.settle_seconds)
        if not ((first is not None and now - first >= grace) or
                (not self.cands and waited >= NO_CHECKPOINT_INTERVALS * self.cfg.sync_interval)):
            return
        msg = whynone.explain(self.ckpt_dir, entries, self.scans.select, waited)
        if not msg or msg == self.status.get("warning"):
            return
        if not self._warned_none:
            self._warned_none = True
            self.emit("no_checkpoint_yet", ckpt_dir=self.ckpt_dir, seconds=round(waited, 1), why=msg)
        self.status.update(warning=msg, warning_code=vocab.NO_CHECKPOINT, warning_hint=whynone.HINT)

    def prune(self, committer: CheckpointCommitter, low_fraction: float = 0.05) -> List[str]:
        """U6: when the local disk runs low, delete local copies already committed (never the newest)."""
        complete = self.complete()
        if len(complete) < 2:
            return []
        need = max(2 * complete[-1].bytes, 0)
        removed = []
        for c in complete[:-1]:
            fs = fsutil.free_space(self.ckpt_dir)
            if fs.free_bytes >= max(need, int(fs.total_bytes * low_fraction)):
                break
            if committer.find_same_source(c) is None:
                continue  # not committed: the only copy
            try:
                if c.is_dir:
                    shutil.rmtree(c.path, ignore_errors=True)
                else:
                    for path in entry_paths(c):  # one file, or a group's
                        os.unlink(path)
            except FileNotFoundError:
                continue  # the trainer's own retention (Lightning's save_top_k) deleted it since the scan
            except OSError as e:  # a failed prune frees less; it must not undo the commit it follows
                self.emit("local_prune_failed", path=c.path, error=str(e))
                continue
            removed.append(c.name)
        if removed:
            self.emit("local_pruned", removed=removed, ckpt_dir=self.ckpt_dir)
        return removed
