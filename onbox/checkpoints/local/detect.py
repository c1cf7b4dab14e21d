"""The candidates in a run's local checkpoint dir: what each entry is (a file, a directory, or a group of files that
make one checkpoint, as TensorFlow's `P.index` + `P.data-*`) and its fingerprint (relative path, size, mtime,
inode per file), read within a bound. completion.py judges which are complete.

Every top-level entry is a candidate unless its name is work in progress (formats.in_progress: `*.tmp`, `*.part`,
dot files, `tmp-*`, Orbax's `*.orbax-checkpoint-tmp*`, ...), a marker beside another (`<name>.done`), ignored
(`--ckpt-ignore`, and by default logs, TensorBoard events and images: DEFAULT_IGNORE), or, when the user named
what a checkpoint is (`--ckpt-pattern`), matched by none of those patterns.

A scan is bounded (ScanBound: entries listed, directory levels, seconds): a checkpoint dir past them is not one
(`--ckpt-dir /`, a dataset dir). It stops there with CheckpointDirTooLarge, so that an agent pointed at the wrong
directory neither reads the whole disk nor stops answering signals while it does; BoundedScan remembers such a dir
and walks it again only SCAN_RETRY_S later.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from onbox import fsutil
from onbox.checkpoints import formats

SIDE_MARKERS = (".done", ".complete")
DIR_MARKERS = ("COMPLETE", ".complete", "DONE", ".onbox-complete")
IN_PROGRESS_RE = formats.IN_PROGRESS_RE  # by convention; formats.in_progress adds each format's own
# what a trainer writes beside its checkpoints that is never one: logs, TensorBoard events, samples, tables
DEFAULT_IGNORE = ("*.log", "*.log.[0-9]*", "*.jsonl", "*.out", "*.err", "events.out.tfevents.*", "*.png", "*.jpg",
                  "*.jpeg", "*.gif", "*.svg", "*.wav", "*.mp4", "*.csv", "*.tsv", "*.md", "*.txt")
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


@dataclasses.dataclass(frozen=True)
class Selection:
    """Which top-level names may be checkpoints: `patterns` (--ckpt-pattern; empty: any name) and `ignore`
    (--ckpt-ignore, then DEFAULT_IGNORE unless a pattern names the entry)."""

    patterns: Tuple[str, ...] = ()
    ignore: Tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: Any) -> "Selection":
        return cls(tuple(cfg.ckpt_pattern), tuple(cfg.ckpt_ignore))

    def admits(self, name: str, members: Tuple[str, ...] = ()) -> bool:
        """`name` (and for a group, its member files) may be a checkpoint."""
        names = (name, *members)
        if any(fnmatch.fnmatchcase(n, g) for n in names for g in self.ignore):
            return False
        if self.patterns:
            return any(fnmatch.fnmatchcase(n, g) for n in names for g in self.patterns)
        return not any(fnmatch.fnmatchcase(name, g) for g in DEFAULT_IGNORE)


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
    format: str = ""  # the format's name ("torch-zip", "json", "other", ...); dirs and groups: its Layout's
    # "marker" | "format" | "renamed" | "closed" | "quiescent" ("" while not complete)
    complete_by: str = ""
    group: bool = False  # several top-level files of the dir that make one checkpoint (`name` is no file)

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


def entry_paths(cand: Candidate) -> List[str]:
    """The directory entries a candidate is: its file or dir, or a group's files."""
    return [os.path.join(cand.root, f) for f in cand.files] if cand.group else [cand.path]


def current_fingerprint(cand: Candidate) -> Optional[Fingerprint]:
    """The candidate's fingerprint as it is now (a group's files too), or None when any of it is gone."""
    if not cand.group:
        return path_fingerprint(cand.path)
    try:
        return _fingerprint(cand.root, cand.files)
    except OSError:
        return None


def fingerprint_of(cand: Candidate) -> Fingerprint:
    """Re-read the fingerprint now (to notice a file changed while it was being copied)."""
    return _fingerprint(cand.root, cand.files)


def scan(ckpt_dir: str, bound: Optional[ScanBound] = None, now: Callable[[], float] = time.monotonic,
         select: Selection = Selection()) -> List[Candidate]:
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
    grouped: Set[str] = set()
    for g in formats.groups([n for n in names if not formats.in_progress(n)]):
        grouped.update(g.files)
        if not select.admits(g.name, g.files):
            continue
        try:
            fp = _fingerprint(ckpt_dir, list(g.files))
        except FileNotFoundError:
            continue
        out.append(Candidate(name=g.name, path=os.path.join(ckpt_dir, g.name), is_dir=False, files=list(g.files),
                             fingerprint=fp, bytes=sum(f[1] for f in fp), newest_mtime=max(f[2] for f in fp) / 1e9,
                             marked=any((g.name + s) in present for s in SIDE_MARKERS), format=g.format,
                             group=True, step=step_from_name(g.name)))
    for name in names:
        budget.clock()
        if name in grouped or formats.in_progress(name) or name.endswith(SIDE_MARKERS) or not select.admits(name):
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
            elif os.path.isfile(path):
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

    def __init__(self, ckpt_dir: str, bound: ScanBound, now: Callable[[], float] = time.monotonic,
                 select: Selection = Selection()) -> None:
        self.ckpt_dir, self.bound, self.now, self.select = ckpt_dir, bound, now, select
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
            found = scan(self.ckpt_dir, self.bound, self.now, self.select)
        except CheckpointDirTooLarge as e:
            e.first = failed is None
            self._failed, self._retry_at = e, self.now() + SCAN_RETRY_S
            raise
        self._failed = None
        return found


def order_key(c: Candidate) -> Tuple[int, float]:
    """Newest last: by step when known, then by mtime."""
    return (c.step if c.step is not None else -1, c.newest_mtime)


def durable_name(c: Candidate) -> str:
    """The name a checkpoint gets on durable storage. An entry rewritten in place (ckpt.pt) holds many
    checkpoints over time, so its durable name carries the step (or the mtime when no step is known); one whose
    name carries its step (checkpoint-500, Orbax's 500/, XGBoost's model_4.ubj) keeps it."""
    if step_from_name(c.name) is not None or c.step_source.startswith("name"):
        return c.name
    if c.step is not None:
        return fsutil.fit_name(c.name, ".step-%d" % c.step)
    return fsutil.fit_name(c.name, ".t-%d" % int(c.newest_mtime))
