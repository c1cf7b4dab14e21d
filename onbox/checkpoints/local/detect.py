"""Find complete checkpoints in a run's local checkpoint dir.

What trainers write: single files (*.pt, *.pth, *.ckpt, *.safetensors, *.bin; nanoGPT rewrites ckpt.pt in place
with a non-atomic torch.save), and directories (Hugging Face checkpoint-<step>/, save_pretrained dirs,
torch.distributed.checkpoint dirs whose `.metadata` is written last, DeepSpeed tags). An entry is COMPLETE when
every file passes its format's structural checks (formats.py: a torn file is never complete) AND
  - the trainer marked it: a `<entry>.done`/`<entry>.complete` file beside it, a COMPLETE/.complete/DONE file
    inside a dir (atomic renames need no marker: a tmp name is never a candidate);           complete_by "marker"
  - or its own format says so: a torch zip or safetensors file whose structure is whole (the last bytes torch.save
    writes are the zip's central directory), a directory of a known layout whose last-written file is there
    (layouts.py: HF trainer_state.json, DCP .metadata, DeepSpeed `latest`);                  complete_by "format"
  - or, for a directory of no known layout or a legacy pickle, nothing in it changed (size, mtime, inode) for the
    settle interval.                                                                          complete_by "quiescent"
A directory of a known layout is never completed by quiescence: a Trainer killed mid-save leaves a quiet dir
without trainer_state.json that no trainer can resume from.

Past 400 lines on purpose: the bounded walk, the candidates and the completion rules read one fingerprint
(relative path, size, mtime, inode) and must agree on it; the format and layout rules themselves live in
formats.py and layouts.py.

A scan is bounded (ScanBound: entries listed, directory levels, seconds): a checkpoint dir past them is not one
(`--ckpt-dir /`, a dataset dir). It stops there with CheckpointDirTooLarge, so that an agent pointed at the wrong
directory neither reads the whole disk nor stops answering signals while it does; BoundedScan remembers such a dir
and walks it again only SCAN_RETRY_S later.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import fsutil, paths
from onbox.checkpoints import formats
from onbox.checkpoints.formats import layouts, stepread

CKPT_SUFFIXES = (*formats.TORCH_SUFFIXES, ".safetensors")
SIDE_MARKERS = (".done", ".complete")
DIR_MARKERS = ("COMPLETE", ".complete", "DONE", ".onbox-complete")
# names that are work in progress by convention: HF's tmp-checkpoint-N, torch.save-then-rename temps
IN_PROGRESS_RE = re.compile(r"(^tmp[-_.])|(\.(tmp|part|partial|incomplete|lock)$)|(^\.)", re.I)
STEP_RE = re.compile(r"(?:checkpoint|global_step|step|iter|iteration|ckpt)[-_=]?(\d+)", re.I)

Fingerprint = Tuple[Tuple[str, int, int, int], ...]  # (relpath, size, mtime_ns, inode) per file
SCAN_RETRY_S = 60.0  # a checkpoint dir found too large is walked again after this long (it may have been fixed)
TIME_CHECK_EVERY = 256  # entries read between two looks at the bound within one directory


@dataclasses.dataclass(frozen=True)
class ScanBound:
    """How much of a checkpoint dir one scan may read (RunConfig scan_max_entries/_depth/_seconds). The defaults
    leave room for the largest real layouts (a DeepSpeed or DCP checkpoint of a big job: thousands of shard files,
    a few levels deep; several of them kept) and keep one scan short enough that the loop answers a signal soon."""

    entries: int = 500000  # directory entries listed, over the whole dir
    depth: int = 32  # directory levels below the checkpoint dir
    seconds: float = 5.0

    @classmethod
    def of(cls, cfg: Any) -> "ScanBound":
        return cls(cfg.scan_max_entries, cfg.scan_max_depth, cfg.scan_max_seconds)


class CheckpointDirTooLarge(OSError):
    """A scan reached its bound: the directory holds more than a checkpoint dir plausibly can (U25: checkpoint
    tooling lives on few, large files; millions of small ones are a dataset, a home or a whole disk). `fields`
    for the event; `first` is False when BoundedScan already reported this dir."""

    def __init__(self, message: str, fields: Dict[str, Any], first: bool = True) -> None:
        super().__init__(message)
        self.fields = fields
        self.first = first


class _Budget:
    """What is left of one scan's bound; raises CheckpointDirTooLarge when it runs out."""

    def __init__(self, ckpt_dir: str, bound: ScanBound, now: Callable[[], float]) -> None:
        self.ckpt_dir, self.bound, self.now = ckpt_dir, bound, now
        self.start = now()
        self.entries = 0

    def count(self, n: int) -> None:
        self.entries += n
        if self.entries > self.bound.entries:
            self._stop("entries", "more than %d entries" % self.bound.entries)

    def level(self, depth: int, path: str) -> None:
        if depth > self.bound.depth:
            self._stop("depth", "directories nested more than %d levels deep (%s)" % (self.bound.depth, path))

    def clock(self) -> None:
        if self.now() - self.start > self.bound.seconds:
            self._stop("seconds", "not scanned within %.3g s (%d entries listed by then)" % (
                self.bound.seconds, self.entries))

    def _stop(self, which: str, why: str) -> None:
        raise CheckpointDirTooLarge(
            "the checkpoint dir %s is implausibly large for checkpoints: %s; onbox stopped scanning it and commits "
            "nothing from it (is --ckpt-dir the directory the trainer saves to?)" % (self.ckpt_dir, why),
            {"ckpt_dir": self.ckpt_dir, "bound": which, "entries": self.entries,
             "seconds": round(self.now() - self.start, 3), "max_entries": self.bound.entries,
             "max_depth": self.bound.depth, "max_seconds": self.bound.seconds})


@dataclasses.dataclass
class Candidate:
    """One checkpoint entry in the local dir: a file or a directory."""

    name: str  # the entry's name in ckpt_dir
    path: str
    is_dir: bool
    files: List[str]  # paths relative to `path` for a dir, [name] for a file
    fingerprint: Fingerprint
    bytes: int
    newest_mtime: float
    marked: bool
    step: Optional[int] = None  # see step_source
    # where the step came from: what the checkpoint records ("ckpt.pt:iter_num", "trainer_state.json:global_step"),
    # else "name", else "progress before the file's mtime"
    step_source: str = ""
    metrics: Dict[str, Any] = dataclasses.field(default_factory=dict)
    complete: bool = False
    reason: str = ""  # why complete, or why not, in words
    format: str = ""  # "torch-zip", "safetensors", "torch-legacy", "other"; dirs: layouts.Layout.format
    complete_by: str = ""  # "marker" | "format" | "quiescent" ("" while not complete)

    @property
    def root(self) -> str:
        """The directory the relative `files` live in."""
        return self.path if self.is_dir else os.path.dirname(self.path)


def step_from_name(name: str) -> Optional[int]:
    m = STEP_RE.search(name)
    return int(m.group(1)) if m else None


def _listing(path: str, budget: Optional[_Budget]) -> List["os.DirEntry[str]"]:
    """The entries of the directory `path`, counted against `budget` as they are read: a directory of millions of
    names stops at the bound, not after all of them are in memory."""
    out: List["os.DirEntry[str]"] = []
    with os.scandir(path) as it:
        for entry in it:
            out.append(entry)
            if budget is not None and len(out) % TIME_CHECK_EVERY == 0:
                budget.count(TIME_CHECK_EVERY)
                budget.clock()
    if budget is not None:
        budget.count(len(out) % TIME_CHECK_EVERY)
    return out


def walk_files(top: str, budget: Optional[_Budget] = None, depth: int = 1) -> List[str]:
    """Every regular file under `top` (no symlinks, none followed), relative, in a stable order: a directory's
    files by name, then each subdirectory's by name. A directory that cannot be listed is skipped. With a
    `budget`, the listing counts against it (`top` being `depth` levels below the checkpoint dir)."""
    out: List[str] = []
    stack: List[Tuple[str, int]] = [("", depth)]
    while stack:
        rel, level = stack.pop()
        if budget is not None:
            budget.level(level, os.path.join(top, rel) if rel else top)
            budget.clock()
        try:
            entries = _listing(os.path.join(top, rel) if rel else top, budget)
        except CheckpointDirTooLarge:
            raise
        except OSError:
            continue
        files, dirs = [], []
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    dirs.append(entry.name)
                elif entry.is_file(follow_symlinks=False):
                    files.append(entry.name)
            except OSError:
                continue
        out.extend(os.path.join(rel, f) if rel else f for f in sorted(files))
        stack.extend((os.path.join(rel, d) if rel else d, level + 1) for d in sorted(dirs, reverse=True))
    return out


def _fingerprint(root: str, files: List[str]) -> Fingerprint:
    fp = []
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        fp.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(fp)


def path_fingerprint(path: str) -> Optional[Fingerprint]:
    """The fingerprint of a checkpoint file or dir as it is now, or None when it is gone."""
    try:
        if os.path.isdir(path):
            return _fingerprint(path, walk_files(path))
        return _fingerprint(os.path.dirname(path), [os.path.basename(path)])
    except OSError:
        return None


def fingerprint_of(cand: Candidate) -> Fingerprint:
    """Re-read the fingerprint now (to notice a file changed while it was being copied)."""
    return _fingerprint(cand.root, cand.files)


def scan(ckpt_dir: str, bound: Optional[ScanBound] = None,
         now: Callable[[], float] = time.monotonic) -> List[Candidate]:
    """Every checkpoint entry in ckpt_dir (complete or not), without format checks. CheckpointDirTooLarge when
    the dir is past `bound` (default ScanBound()): nothing of a scan cut short is returned, as a candidate whose
    walk was cut would look like a checkpoint missing files."""
    budget = _Budget(ckpt_dir, bound or ScanBound(), now)
    try:
        names = sorted(entry.name for entry in _listing(ckpt_dir, budget))
    except FileNotFoundError:
        return []
    present = set(names)
    out = []
    for name in names:
        budget.clock()
        if IN_PROGRESS_RE.search(name) or name.endswith(SIDE_MARKERS):
            continue
        path = os.path.join(ckpt_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                files = walk_files(path, budget)
                # an empty dir is a candidate only when its name carries a step: a save killed right after its
                # mkdir (HF creates checkpoint-N/ first), which a trainer picking its newest dir would load
                if not files and step_from_name(name) is None:
                    continue
                marked = any(m in files for m in DIR_MARKERS)
                fp = _fingerprint(path, files)
                is_dir = True
            elif os.path.isfile(path) and name.endswith(CKPT_SUFFIXES):
                files = [name]
                fp = _fingerprint(ckpt_dir, files)
                marked = False
                is_dir = False
            else:
                continue
            newest = max(f[2] for f in fp) / 1e9 if fp else os.stat(path).st_mtime
        except FileNotFoundError:  # vanished while we looked (the trainer's own retention)
            continue
        marked = marked or any((name + s) in present for s in SIDE_MARKERS)
        out.append(Candidate(name=name, path=path, is_dir=is_dir, files=files, fingerprint=fp,
                             bytes=sum(f[1] for f in fp), newest_mtime=newest, marked=marked,
                             step=step_from_name(name)))
        if out[-1].step is not None:
            out[-1].step_source = "name"
    return out


class BoundedScan:
    """scan() of one checkpoint dir within its bound, remembering a dir found too large: for SCAN_RETRY_S it is not
    walked again (every loop tick would read up to the bound once more, and the stop path must not wait on it) and
    the same CheckpointDirTooLarge is raised at once; `first` is True only when a dir that was fine (or not yet
    looked at) is found too large, so the caller says it once."""

    def __init__(self, ckpt_dir: str, bound: ScanBound, now: Callable[[], float] = time.monotonic) -> None:
        self.ckpt_dir, self.bound, self.now = ckpt_dir, bound, now
        self._failed: Optional[CheckpointDirTooLarge] = None
        self._retry_at = 0.0

    @property
    def failed(self) -> Optional[CheckpointDirTooLarge]:
        """The error of the newest walk when it found the dir too large, else None."""
        return self._failed

    def scan(self) -> List[Candidate]:
        failed = self._failed
        if failed is not None and self.now() < self._retry_at:
            raise CheckpointDirTooLarge(str(failed), failed.fields, first=False)
        try:
            found = scan(self.ckpt_dir, self.bound, self.now)
        except CheckpointDirTooLarge as e:
            e.first = failed is None
            self._failed, self._retry_at = e, self.now() + SCAN_RETRY_S
            raise
        self._failed = None
        return found


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


SELF_CHECKING = ("torch-zip", "zip", "safetensors")  # kinds whose structure exposes a torn or unfinished write


class CompletionTracker:
    """Judges each candidate's completeness (module docstring); remembers when each entry's fingerprint last
    changed, to judge quiescence across loop ticks, and caches each file's format check by its identity.

    `now_mono`/`now_wall` come from the clock seam. An entry whose files are older than the settle interval by
    their mtimes (an old checkpoint found at start-up) is quiescent at once.
    """

    def __init__(self, settle_seconds: float) -> None:
        self.settle = settle_seconds
        self.history = ProgressHistory()
        self._seen: Dict[str, Tuple[Fingerprint, float, Optional[int], Dict[str, Any]]] = {}
        self._checked: Dict[Tuple[str, int, int, int], "formats.FormatResult"] = {}
        self._layouts: Dict[Tuple[str, Fingerprint], layouts.Layout] = {}
        self._steps: Dict[Tuple[str, Fingerprint], Optional[stepread.StepReading]] = {}

    def update(self, cands: List[Candidate], now_mono: float, now_wall: float,
               progress: Optional[Dict[str, Any]] = None, settle: Optional[float] = None) -> List[Candidate]:
        """Fill in step/metrics/format/complete/reason on each candidate; returns them (newest last).
        `settle` (default: the tracker's) is the quiet period of entries that only quiescence can complete."""
        settle = self.settle if settle is None else settle
        self.history.observe(progress)
        names = {c.name for c in cands}
        for gone in set(self._seen) - names:
            del self._seen[gone]
        for c in cands:
            seen = self._seen.get(c.name)
            if seen is None or seen[0] != c.fingerprint:
                # first sight of this content: the newest metrics now are the metrics "at save time"
                p = dict(progress or {})
                step = p.get("step") if isinstance(p.get("step"), int) else None
                seen = (c.fingerprint, now_mono, step, p)
                self._seen[c.name] = seen
            reading = self._content_step(c)
            if reading is not None:  # what the checkpoint records about itself beats its name and the log
                c.step, c.step_source = reading.step, reading.source
            elif c.step is None:
                c.step = self.history.step_before(c.newest_mtime)
                if c.step is not None:
                    c.step_source = "progress before the file's mtime"
            if c.step is None:
                c.metrics = seen[3]  # no step to match: the newest metrics when the content was first seen
            else:  # the metrics AT its step: the trainer's last report up to it, never a later step's
                c.metrics = self.history.metrics_at(c.step) or {}
            quiet = (now_mono - seen[1] >= settle) or (now_wall - c.newest_mtime >= settle)
            self._judge(c, quiet, settle)
        if len(self._checked) > 16384:
            self._checked.clear()
        if len(self._layouts) > 4096:
            self._layouts.clear()
        if len(self._steps) > 4096:
            self._steps.clear()
        return sorted(cands, key=order_key)

    def _content_step(self, c: Candidate) -> Optional[stepread.StepReading]:
        key = (c.path, c.fingerprint)
        if key not in self._steps:
            self._steps[key] = stepread.step_of_dir(c.path) if c.is_dir else stepread.step_of_file(c.path)
        return self._steps[key]

    def _file_check(self, c: Candidate, fp: Tuple[str, int, int, int]) -> "formats.FormatResult":
        path = os.path.join(c.root, fp[0])
        key = (path, fp[1], fp[2], fp[3])
        res = self._checked.get(key)
        if res is None:
            res = self._checked[key] = formats.check_file(path, full=False)
        return res

    def _judge(self, c: Candidate, quiet: bool, settle: float) -> None:
        problem, kinds = None, set()
        for fp in c.fingerprint:
            res = self._file_check(c, fp)
            kinds.add(res.kind)
            if problem is None and not res.ok:
                problem = "%s: %s" % (fp[0], res.problem)
        if c.is_dir:
            key = (c.path, c.fingerprint)
            layout = self._layouts.get(key)
            if layout is None:
                try:
                    layout = layouts.dir_layout(c.path, c.files)
                except OSError as e:  # a file vanished or changed under us: judge again at the next scan
                    layout = layouts.Layout("unknown", "cannot read: %s" % e)
                self._layouts[key] = layout
            c.format = layout.format
        else:
            layout = None
            c.format = next(iter(kinds)) if kinds else "other"
        c.complete, c.complete_by = False, ""
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
        elif layout is not None and layout.format != "unknown":
            if layout.problem:
                c.reason = "%s: %s" % (layout.format, layout.problem)
            else:
                c.complete, c.complete_by, c.reason = True, "format", "%s: %s" % (layout.format, layout.done_by)
        elif layout is None and kinds <= set(SELF_CHECKING):
            c.complete, c.complete_by = True, "format"
            c.reason = "%s: structure whole (its last bytes are written last)" % c.format
        elif quiet:
            c.complete, c.complete_by = True, "quiescent"
            c.reason = "unchanged for %.3gs (%s: no format rule says when it is complete)" % (
                settle, "a directory of no known layout" if c.is_dir else c.format)
        else:
            c.reason = "still changing (settle %.3gs; %s)" % (
                settle, "a directory of no known layout" if c.is_dir else c.format)


def order_key(c: Candidate) -> Tuple[int, float]:
    """Newest last: by step when known, then by mtime."""
    return (c.step if c.step is not None else -1, c.newest_mtime)


def durable_name(c: Candidate) -> str:
    """The name a checkpoint gets on durable storage. An entry rewritten in place (ckpt.pt) holds many
    checkpoints over time, so its durable name carries the step (or the mtime when no step is known)."""
    if step_from_name(c.name) is not None:
        return c.name
    if c.step is not None:
        return fsutil.fit_name(c.name, ".step-%d" % c.step)
    return fsutil.fit_name(c.name, ".t-%d" % int(c.newest_mtime))
