"""When each candidate of the local checkpoint dir is complete, and which step and metrics it gets.

An entry is COMPLETE when every file passes its format's structural check (formats: a torn file is never
complete) AND, in this order (the manifest's `complete_by` says which rule applied):
  - the trainer marked it: a `<entry>.done`/`<entry>.complete` file beside it, a COMPLETE/.complete/DONE file inside
    a dir (an atomic rename needs no marker: a tmp name is never a candidate);                  "marker"
  - its own format says so: a file whose format proves a finished save by its structure (a torch zip's, a .keras
    or .npz zip's central directory is written last; safetensors, .npy, HDF5, a pickle's STOP, a UBJSON model, a
    JSON document), a directory of a known layout whose last-written file is there (HF trainer_state.json, DCP
    .metadata, DeepSpeed `latest`, Orbax _CHECKPOINT_METADATA, Keras training_metadata.json), a TensorFlow group
    with every shard and its index, named by the state file;                                     "format"
  - the trainer finished it, as the kernel saw (watch.py, inotify): renamed into the dir, or a file closed after
    writing, with nothing written to it since;                                                   "renamed" / "closed"
  - nothing in it changed (size, mtime, inode) for the settle interval: any entry no rule above covers (a file of
    no known format, a directory of no known layout, a legacy pickle), and every entry where inotify is not
    there.                                                                                       "quiescent"
A directory of a known layout is never completed by quiescence nor by its rename: a Trainer killed mid-save leaves
a quiet dir without trainer_state.json that no trainer can resume from.
"""
from __future__ import annotations

import collections
import os
from typing import Any, Dict, List, Optional, Tuple

from onbox import fsutil, paths
from onbox.checkpoints import formats
from onbox.checkpoints.formats import stepread
from onbox.checkpoints.formats.base import Format, FormatResult, Layout, StepReading
from onbox.checkpoints.local.detect import Candidate, Fingerprint, order_key
from onbox.checkpoints.local.watch import DirWatch


def read_progress(ctx: Any) -> Dict[str, Any]:
    """The trainer's newest progress (progress.json's document) for the hook built on `ctx` (a RunContext): inside a
    supervisor its progress feed; outside one (`onbox sync`, `onbox checkpoints`) progress.json as the agent last
    wrote it, or {} when absent or unreadable."""
    if ctx.progress is not None:
        return ctx.progress.snapshot()
    try:
        doc = fsutil.read_json(os.path.join(ctx.run_dir, paths.PROGRESS_FILE))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


class ProgressHistory:
    """The steps the trainer reported and when (read_progress's `time`, wall clock), so that a checkpoint whose
    format and name carry no step is labelled with the last step reported BEFORE its file was written, not
    with whatever step the trainer reached by the time onbox looked."""

    def __init__(self, keep: int = 4096) -> None:
        self.points: "collections.deque[Tuple[float, int]]" = collections.deque(maxlen=keep)
        self.reports: "collections.deque[Dict[str, Any]]" = collections.deque(maxlen=keep)  # progress, per step

    def observe(self, progress: Optional[Dict[str, Any]]) -> None:
        step, at = (progress or {}).get("step"), (progress or {}).get("time")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        if isinstance(at, (int, float)) and (not self.points or self.points[-1] != (float(at), step)):
            self.points.append((float(at), step))
        if not self.reports or self.reports[-1].get("step") != step:
            self.reports.append(dict(progress or {}))
        else:
            self.reports[-1] = dict(progress or {})  # the same step, reported again (eval loss arrived): newest

    def metrics_at(self, step: int) -> Optional[Dict[str, Any]]:
        """The newest report at or before `step` (a resumed run reports lower steps again: the newest wins); None
        when the trainer reported nothing up to that step yet. Never a later step's metrics."""
        for report in reversed(self.reports):
            if report["step"] <= step:
                return report
        return None

    def step_before(self, when: float) -> Optional[int]:
        best = None
        for at, step in self.points:
            if at <= when:
                best = step
        return best


class CompletionTracker:
    """Judges each candidate's completeness (module docstring); remembers when each entry's fingerprint last
    changed, to judge quiescence across loop ticks, and caches each file's format check by its identity.

    `now_mono`/`now_wall` come from the clock seam. An entry whose files are older than the settle interval by
    their mtimes (an old checkpoint found at start-up) is quiescent at once. `watch`: the dir's inotify watch
    (None or unavailable: the quiet rule alone).
    """

    def __init__(self, settle_seconds: float, watch: Optional[DirWatch] = None) -> None:
        self.settle = settle_seconds
        self.watch = watch
        self.history = ProgressHistory()
        self._seen: Dict[str, Tuple[Fingerprint, float, Optional[int], Dict[str, Any]]] = {}
        self._checked: Dict[Tuple[str, int, int, int], Tuple[FormatResult, Optional[Format]]] = {}
        self._layouts: Dict[Tuple[str, Fingerprint], Layout] = {}
        self._steps: Dict[Tuple[str, Fingerprint], Optional[StepReading]] = {}
        self._finished: Dict[str, Tuple[str, Fingerprint]] = {}  # name -> (how, the content it was finished with)

    def update(self, cands: List[Candidate], now_mono: float, now_wall: float,
               progress: Optional[Dict[str, Any]] = None, settle: Optional[float] = None) -> List[Candidate]:
        """Fill in step/metrics/format/complete/reason on each candidate; returns them (newest last).
        `settle` (default: the tracker's) is the quiet period of entries that only quiescence can complete."""
        settle = self.settle if settle is None else settle
        self.history.observe(progress)
        if self.watch is not None:
            self.watch.poll()
        names = {c.name for c in cands}
        for gone in set(self._seen) - names:
            del self._seen[gone]
        for gone in set(self._finished) - names:
            del self._finished[gone]
        for c in cands:
            seen = self._seen.get(c.name)
            if seen is None or seen[0] != c.fingerprint:
                # first sight of this content: the newest metrics now are the metrics "at save time"
                p = dict(progress or {})
                step = p.get("step") if isinstance(p.get("step"), int) else None
                seen = (c.fingerprint, now_mono, step, p)
                self._seen[c.name] = seen
            quiet = (now_mono - seen[1] >= settle) or (now_wall - c.newest_mtime >= settle)
            self._judge(c, quiet, settle)
            self._step(c)
            if c.step is None:
                c.metrics = seen[3]  # no step to match: the newest metrics when the content was first seen
            else:  # the metrics AT its step: the trainer's last report up to it, never a later step's
                c.metrics = self.history.metrics_at(c.step) or {}
        if len(self._checked) > 16384:
            self._checked.clear()
        if len(self._layouts) > 4096:
            self._layouts.clear()
        if len(self._steps) > 4096:
            self._steps.clear()
        return sorted(cands, key=order_key)

    def _step(self, c: Candidate) -> None:
        """What the checkpoint records about itself beats its name, which beats the trainer's log."""
        reading = self._content_step(c)
        if c.is_dir or c.group or not c.fingerprint:
            fmt = formats.named(c.format)
        else:  # the format that claimed the file (its kind may be a variant's: "keras" of the zip format)
            fmt = self._file_check(c, c.fingerprint[0])[1]
        named = fmt.step_of_name(c.name) if fmt is not None else None
        if reading is not None:
            c.step, c.step_source = reading.step, reading.source
        elif named is not None and c.step is None:
            c.step, c.step_source = named, "name (%s)" % c.format
        elif c.step is None:
            c.step = self.history.step_before(c.newest_mtime)
            if c.step is not None:
                c.step_source = "progress before the file's mtime"

    def _content_step(self, c: Candidate) -> Optional[StepReading]:
        key = (c.path, c.fingerprint)
        if key not in self._steps:
            if c.group:
                self._steps[key] = None
            elif c.is_dir:
                self._steps[key] = stepread.step_of_dir(c.path, c.files)
            else:
                self._steps[key] = stepread.step_of_file(c.path)
        return self._steps[key]

    def _file_check(self, c: Candidate, fp: Tuple[str, int, int, int]) -> Tuple[FormatResult, Optional[Format]]:
        path = os.path.join(c.root, fp[0])
        key = (path, fp[1], fp[2], fp[3])
        res = self._checked.get(key)
        if res is None:
            res = self._checked[key] = formats.inspect(path, full=False)
        return res

    def _layout(self, c: Candidate) -> Optional[Layout]:
        """The directory's or the group's layout (cached by content); None for a single file."""
        if not (c.is_dir or c.group):
            return None
        key = (c.path, c.fingerprint)
        layout = self._layouts.get(key)
        if layout is None:
            try:
                if c.group:
                    fmt = formats.named(c.format)
                    group = formats.Group(c.name, tuple(c.files), c.format)
                    layout = fmt.group_layout(c.root, group, c.files) if fmt is not None else formats.UNKNOWN
                else:
                    layout = formats.dir_layout(c.path, c.files)
            except OSError as e:  # a file vanished or changed under us: judge again at the next scan
                layout = Layout("unknown", "cannot read: %s" % e)
            self._layouts[key] = layout
        return layout

    def _finished_by(self, c: Candidate) -> Optional[str]:
        """"renamed" or "closed" when the watch saw the trainer finish this entry and its content is still what it
        was at the first scan after that; else None."""
        how = self.watch.finished(c.name) if self.watch is not None else None
        if how is None:
            self._finished.pop(c.name, None)
            return None
        was = self._finished.get(c.name)
        if was is None or was[0] != how:
            self._finished[c.name] = was = (how, c.fingerprint)
        return how if was[1] == c.fingerprint else None

    def _judge(self, c: Candidate, quiet: bool, settle: float) -> None:
        problem, kinds, finished = None, set(), True
        for fp in c.fingerprint:
            res, fmt = self._file_check(c, fp)
            kinds.add(res.kind)
            finished = finished and fmt is not None and fmt.finished(res)
            if problem is None and not res.ok:
                problem = "%s: %s" % (fp[0], res.problem)
        layout = self._layout(c)
        c.format = layout.format if layout is not None else (next(iter(kinds)) if kinds else "other")
        if c.group and layout is not None and layout.format == "unknown":
            c.format = "files"
        c.complete, c.complete_by = False, ""
        what = ("a directory of no known layout" if c.is_dir else "files of no known format" if c.group
                else c.format if c.format != "other" else "a file of no known format")
        if not c.files:
            c.reason = "empty directory (a save cut short before its first file)"
        elif problem and problem.split(": ", 1)[-1].startswith(formats.UNREADABLE):
            # not torn: the bytes may be fine, this box cannot read them (permissions, an I/O error, a device)
            c.reason = "unreadable: %s" % problem
        elif problem:
            # a file being written fails the same checks as a torn one; only time tells them apart
            c.reason = ("torn: %s" if quiet else "still being written (%s)") % problem
        elif c.marked:
            c.complete, c.complete_by, c.reason = True, "marker", "marked complete by the trainer"
        elif layout is not None and layout.format != "unknown" and (layout.problem or layout.done_by):
            if layout.problem:
                c.reason = "%s: %s" % (layout.format, layout.problem)
            else:
                c.complete, c.complete_by, c.reason = True, "format", "%s: %s" % (layout.format, layout.done_by)
        elif layout is None and finished:
            c.complete, c.complete_by = True, "format"
            c.reason = "%s: structure whole (its last bytes are written last)" % c.format
        elif self._finished_by(c) is not None:
            how = self._finished_by(c)
            c.complete, c.complete_by = True, str(how)
            c.reason = ("renamed into the checkpoint dir by the trainer" if how == "renamed" else
                        "closed by the trainer after writing, unchanged since") + " (%s)" % what
        elif quiet:
            c.complete, c.complete_by = True, "quiescent"
            c.reason = "unchanged for %.3gs (%s: no format rule says when it is complete)" % (settle, what)
        else:
            c.reason = "still changing (settle %.3gs; %s)" % (settle, what)
