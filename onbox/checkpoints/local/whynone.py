"""Why nothing in the checkpoint dir counts as a checkpoint, in words a person acts on: what IS there and why none of
it counts, and what to do (the `no_checkpoint` warning of checkpoint_status.json, `onbox stop`, `onboxctl pull` and
`down`). For example:

    14 files in /ck, none a checkpoint: state_000020.txt, state_000040.txt and 12 more are *.txt, a name onbox
    ignores by default (logs, notes, tables) — if they are the trainer's saves, pass --ckpt-pattern '*.txt'

Each top-level name of the dir is one of (survey()):
  candidate   a checkpoint entry (detect.scan), complete or not: its completion.py reason says why not (torn, still
              being written, a directory missing its last-written file, ...)
  temp        a temp name by convention (`*.tmp`, `*.part`, `tmp-*`, ...): a save that is never renamed into place
  format      a name a format keeps for itself (TensorFlow's `checkpoint` state file, Orbax's tmp dirs)
  marker      `<name>.done` beside another entry
  ignored     --ckpt-ignore names it, or it is a log, table or image onbox ignores by default
  unmatched   the user gave --ckpt-pattern and none of the patterns matches it
Dot files (onbox's own `.onbox-*` among them) are left out.

FinishWatch says when the trainer first FINISHED something that looks like a save and still none counts — the
moment the warning is due (after a short grace: a save of several files, such as a TensorFlow checkpoint and its
state file, completes a moment after its first file). Finished: renamed into the dir or closed after writing, as the
dir's inotify watch saw it (watch.py), or, without one, unchanged (size, mtime, inode; a candidate's whole
fingerprint) for the settle period. What looks like a save: a candidate, a file under a temp name, a file the
user's --ckpt-pattern or --ckpt-ignore leaves out, and a file onbox ignores by default whose name carries a number
(`state_000020.txt`: one of a series); never a log, an image or TensorBoard's events (a trainer that writes those
beside its checkpoints would be warned before its first save), nor a directory under a temp name (its own stat
stays still while a large file inside it is written).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.checkpoints import formats
from onbox.checkpoints.local.completion import CompletionTracker
from onbox.checkpoints.local.detect import (
    DEFAULT_IGNORE,
    SIDE_MARKERS,
    Candidate,
    CheckpointDirTooLarge,
    ScanBound,
    Selection,
    scan,
)
from onbox.checkpoints.local.watch import DirWatch

NOT_SAVES = ("*.log", "*.log.[0-9]*", "*.jsonl", "*.out", "*.err", "events.out.tfevents.*", "*.png", "*.jpg",
             "*.jpeg", "*.gif", "*.svg", "*.wav", "*.mp4")  # ignored by default, and never a trainer's save
MAX_NAMES = 2  # names shown per group, then "and N more"
MAX_ENTRIES = 100_000  # names looked at (a dir past detect's bound never gets here)
NUMBERED = re.compile(r"\d")
HINT = ("until one counts nothing is committed and a lost box loses every step; `onbox checkpoints RUN` lists each "
        "entry of the dir and why it does not count")
EMPTY_FIX = "point the trainer's saves at $ONBOX_CKPT_DIR or give --ckpt-dir its output dir"


@dataclasses.dataclass
class Entry:
    name: str
    kind: str  # candidate | temp | format | marker | ignored | unmatched (module docstring)
    why: str = ""  # a candidate's reason; the glob that ignores or matches; ...
    is_dir: bool = False
    complete: bool = False
    key: Tuple = ()  # what changes while it is written: a candidate's fingerprint, else (size, mtime_ns, inode)
    save_like: bool = False  # the trainer finishing it starts the warning's clock (module docstring)


def _stat_key(path: str) -> Optional[Tuple[int, int, int]]:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _default_glob(name: str) -> Optional[str]:
    return next((g for g in DEFAULT_IGNORE if fnmatch.fnmatchcase(name, g)), None)


def survey(ckpt_dir: str, select: Selection, cands: Sequence[Candidate]) -> List[Entry]:
    """Every top-level name of `ckpt_dir` but dot files, classified; `cands` are the scan's candidates (judged)."""
    try:
        names = sorted(n for n in os.listdir(ckpt_dir)[:MAX_ENTRIES] if not n.startswith("."))
    except OSError:
        return []
    out: List[Entry] = []
    taken = set()
    for c in cands:
        taken.update(c.files if c.group else [c.name])
        out.append(Entry(c.name, "candidate", c.reason, c.is_dir, c.complete, c.fingerprint, True))
    for name in names:
        if name in taken:
            continue
        path = os.path.join(ckpt_dir, name)
        is_dir = os.path.isdir(path)
        key = _stat_key(path)
        if key is None:
            continue  # gone while we looked
        if formats.IN_PROGRESS_RE.search(name):
            out.append(Entry(name, "temp", _temp_glob(name), is_dir, key=key, save_like=not is_dir))
        elif formats.in_progress(name):
            out.append(Entry(name, "format", "", is_dir, key=key))
        elif name.endswith(SIDE_MARKERS) and name.rsplit(".", 1)[0] in names:
            out.append(Entry(name, "marker", "", is_dir, key=key))
        elif any(fnmatch.fnmatchcase(name, g) for g in select.ignore):
            mine = next(g for g in select.ignore if fnmatch.fnmatchcase(name, g))
            out.append(Entry(name, "ignored", "--ckpt-ignore %s" % _quote(mine), is_dir, key=key,
                             save_like=not is_dir))
        elif select.patterns:
            if not any(fnmatch.fnmatchcase(name, g) for g in select.patterns):
                out.append(Entry(name, "unmatched", "", is_dir, key=key, save_like=not is_dir))
        else:
            glob = _default_glob(name)
            if glob is not None:  # else no entry a scan takes (a symlink, an empty dir without a step in its name)
                out.append(Entry(name, "ignored", glob, is_dir, key=key, save_like=not is_dir and glob not in
                                 NOT_SAVES and bool(NUMBERED.search(name))))
    return out


def _temp_glob(name: str) -> str:
    m = formats.IN_PROGRESS_RE.search(name)
    text = m.group(0) if m else ""
    return "*" + text if text.startswith(".") else text + "*"


def _quote(glob: str) -> str:
    return "'%s'" % glob.replace("'", "'\\''")


def _names(entries: Sequence[Entry]) -> str:
    shown = [e.name + ("/" if e.is_dir else "") for e in entries[-MAX_NAMES:]]  # the newest names sort last
    more = len(entries) - len(shown)
    if more:
        return "%s and %d more" % (", ".join(shown), more)
    return " and ".join(shown) if len(shown) == 2 else shown[0]


def _verb(entries: Sequence[Entry]) -> str:
    return "is" if len(entries) == 1 else "are"


def explain(ckpt_dir: str, entries: Sequence[Entry], select: Optional[Selection] = None,
            waited: Optional[float] = None) -> str:
    """The sentence: what is in the dir and why none of it counts, each reason with its fix ("" when something is
    complete: then a checkpoint counts). `waited`: seconds the agent has looked at the dir (said of an empty one)."""
    if any(e.complete for e in entries):
        return ""
    shown = [e for e in entries if e.kind != "marker"]
    if not shown:
        return "no checkpoint in %s%s: it is empty, so nothing can be committed or resumed; %s" % (
            ckpt_dir, " after %.0f s" % waited if waited is not None else "", EMPTY_FIX)
    files = sum(1 for e in shown if not e.is_dir)
    what = ("%d file%s" % (files, "" if files == 1 else "s")) if files == len(shown) else "%d entries" % len(shown)
    parts: List[str] = []
    cands = [e for e in shown if e.kind == "candidate"]
    if cands:
        newest = cands[-1]
        parts.append("%s %s not complete (%s: %s) — finish each save by renaming it into place (write a temp name, "
                     "then os.replace), or drop <name>.done beside it" % (
                         _names(cands), _verb(cands), newest.name, newest.why))
    by_glob: Dict[str, List[Entry]] = {}
    for e in shown:
        if e.kind == "ignored":
            by_glob.setdefault(e.why, []).append(e)
    for glob, group in sorted(by_glob.items(), key=lambda kv: -len(kv[1])):
        if glob.startswith("--ckpt-ignore"):
            parts.append("%s %s left out by %s" % (_names(group), _verb(group), glob))
        else:
            parts.append("%s %s %s, a name onbox ignores by default (logs, notes, tables, images) — if %s the "
                         "trainer's save%s, pass --ckpt-pattern %s" % (
                             _names(group), _verb(group), glob, "it is" if len(group) == 1 else "they are",
                             "" if len(group) == 1 else "s", _quote(glob)))
    unmatched = [e for e in shown if e.kind == "unmatched"]
    if unmatched:
        parts.append("%s %s named by no --ckpt-pattern (%s) — give a pattern that names the trainer's saves" % (
            _names(unmatched), _verb(unmatched), " ".join(_quote(g) for g in (select or Selection()).patterns)))
    temps = [e for e in shown if e.kind == "temp"]
    if temps:
        parts.append("%s %s a temp name (%s), work in progress onbox never takes — rename each save to its final "
                     "name once it is written" % (_names(temps), _verb(temps), temps[-1].why))
    own = [e for e in shown if e.kind == "format"]
    if own and not parts:
        parts.append("%s %s a format's own work in progress (a save not finished yet)" % (_names(own), _verb(own)))
    return "%s in %s, none a checkpoint: %s" % (what, ckpt_dir, "; ".join(parts))


class FinishWatch:
    """When the trainer first finished something save-like in the dir (module docstring), on the monotonic clock;
    None until it has. Fed the same survey at each look."""

    def __init__(self, settle: float) -> None:
        self.settle = settle
        self._since: Dict[str, Tuple[Tuple, float]] = {}  # name -> (key, when that key was first seen)
        self.first: Optional[float] = None

    def update(self, entries: Sequence[Entry], now: float, watch: Optional[DirWatch]) -> Optional[float]:
        seen = {e.name for e in entries}
        for gone in set(self._since) - seen:
            del self._since[gone]
        for e in entries:
            was = self._since.get(e.name)
            if was is None or was[0] != e.key:
                self._since[e.name] = was = (e.key, now)
            if not e.save_like or self.first is not None:
                continue
            by_kernel = watch is not None and watch.available and watch.finished(e.name) is not None
            if by_kernel or now - was[1] >= self.settle:
                self.first = now if by_kernel else was[1] + self.settle
        return self.first

    def reset(self) -> None:
        self.first = None


def diagnose(ckpt_dir: str, cfg: Any, progress: Optional[Dict[str, Any]] = None) -> str:
    """Why nothing in `ckpt_dir` counts, judged now with the trainer stopped (nothing is "still being written": what
    fails a check is torn), as `onbox stop` and `onbox status RUN --json` say it once a run has ended. `cfg`: the
    run's RunConfig (its selection and scan bound). "" when a checkpoint there is complete."""
    select = Selection.of(cfg)
    try:
        found = scan(ckpt_dir, ScanBound.of(cfg), select=select)
    except CheckpointDirTooLarge as e:
        return str(e)
    cands = CompletionTracker(0.0).update(found, 0.0, time.time(), progress or {})
    return explain(ckpt_dir, survey(ckpt_dir, select, cands), select)


def nothing_committed(durable: Optional[str], status: Optional[Mapping[str, Any]] = None,
                      why: Optional[str] = None) -> str:
    """Why a run has no committed checkpoint, one line, from what the box says of it: no durable target; its last
    sync failed; `why` (diagnose() of the dir now: "" when a complete checkpoint is there, None when not looked
    at); the `no_checkpoint` warning of checkpoint_status.json (`status`)."""
    status = status if isinstance(status, Mapping) else {}
    if not durable:
        return "nothing is committed: the run has no durable storage (no --durable); its checkpoints stay on the box"
    head = "nothing committed to %s" % durable
    last = status.get("last_sync")
    if isinstance(last, Mapping) and last.get("ok") is False:
        return "%s: its last commit FAILED: %s" % (head, last.get("error") or "?")
    if why:
        return "%s: %s" % (head, why)
    if why == "":
        return ("%s: a complete checkpoint is in the checkpoint dir but was not committed before the run ended (the "
                "run's events say why: final_sync_none, final_sync_skipped); `onbox sync RUN --now` on the box "
                "commits it" % head)
    warning = status.get("warning")
    if isinstance(warning, str) and warning:
        return "%s: %s" % (head, warning)
    return "%s: no complete checkpoint was found in the run's checkpoint dir (`onbox checkpoints RUN` says why)" % head
