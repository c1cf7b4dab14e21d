"""What the checkpoint hook says and does about the box's own checkpoint dir: its newest entry unreadable here
(nothing newer than durable storage holds is committed), the dir staying empty (the trainer writes elsewhere, or
not at all), and committed local copies pruned when the local disk runs low (U6). A mixin of
CheckpointCommitHook (hook.py).
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Dict, List, Optional

from onbox import fsutil
from onbox.checkpoints.local.detect import Candidate

NO_CHECKPOINT_INTERVALS = 5  # sync intervals with an empty checkpoint dir before it is worth a warning


class LocalDirMixin:
    """The local-dir side of CheckpointCommitHook. State it adds: `_first_look`, `_warned_none`."""

    # provided by CheckpointCommitHook
    ctx: Any
    cfg: Any
    committer: Any
    status: Dict[str, Any]
    cands: List[Candidate]
    ckpt_dir: str
    _update_status: Callable[..., None]

    _first_look: Optional[float] = None
    _warned_none = False

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
            self._update_status(unreadable={"name": newest.name, "path": newest.path, "problem": problem})
            self.ctx.emit("checkpoint_unreadable", checkpoint=newest.name, path=newest.path, problem=problem)
        elif not bad and was:
            self._update_status(unreadable=None)
            self.ctx.emit("checkpoint_readable", checkpoint=was.get("name"))

    def _watch_for_none(self, now: float) -> None:
        """Say so (once: an event, and a warning in checkpoint_status.json that `onbox status` shows) when the
        checkpoint dir stayed empty for NO_CHECKPOINT_INTERVALS sync intervals: the trainer writes elsewhere,
        or not at all, and a preemption would lose everything."""
        if self._first_look is None:
            self._first_look = now
        if self.cands:
            if self.status.get("warning"):
                self._update_status(warning=None)
            return
        waited = now - self._first_look
        if self._warned_none or waited < NO_CHECKPOINT_INTERVALS * self.cfg.sync_interval:
            return
        self._warned_none = True
        msg = ("no checkpoint in %s after %.0f s: nothing can be committed or resumed; point the trainer's "
               "saves at $ONBOX_CKPT_DIR or give --ckpt-dir its output dir" % (self.ckpt_dir, waited))
        self.ctx.emit("no_checkpoint_yet", ckpt_dir=self.ckpt_dir, seconds=round(waited, 1))
        self._update_status(warning=msg)

    def prune_local(self, low_fraction: float = 0.05) -> List[str]:
        """U6: when the local disk runs low, delete local copies already committed (never the newest)."""
        assert self.committer is not None
        complete = [c for c in self.cands if c.complete]
        if len(complete) < 2:
            return []
        need = max(2 * complete[-1].bytes, 0)
        removed = []
        for c in complete[:-1]:
            fs = fsutil.free_space(self.ckpt_dir)
            if fs.free_bytes >= max(need, int(fs.total_bytes * low_fraction)):
                break
            if self.committer.find_same_source(c) is None:
                continue  # not committed: the only copy
            try:
                if c.is_dir:
                    shutil.rmtree(c.path, ignore_errors=True)
                else:
                    os.unlink(c.path)
            except FileNotFoundError:
                continue  # the trainer's own retention (Lightning's save_top_k) deleted it since the scan
            except OSError as e:  # a failed prune frees less; it must not undo the commit it follows
                self.ctx.emit("local_prune_failed", path=c.path, error=str(e))
                continue
            removed.append(c.name)
        if removed:
            self.ctx.emit("local_pruned", removed=removed, ckpt_dir=self.ckpt_dir)
        return removed
