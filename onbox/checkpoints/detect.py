"""Find complete checkpoints in a run's local checkpoint dir.

What trainers write: single files (*.pt, *.pth, *.ckpt, *.safetensors, *.bin; nanoGPT rewrites ckpt.pt in place
with a non-atomic torch.save), and directories (Hugging Face checkpoint-<step>/, Lightning, torch.distributed
.checkpoint dirs whose `.metadata` is written last). An entry is COMPLETE when
  - the trainer marked it: a `<entry>.done`/`<entry>.complete` file beside it, a COMPLETE/.complete/DONE file
    inside a dir, or the `.metadata` of a DCP dir (atomic renames need no marker: a tmp name is never a candidate);
  - or it has been quiescent (no size/mtime/inode change) for the settle interval;
AND, either way, the structural format checks of every file pass (formats.py). A torn file is never complete.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from onbox.checkpoints import formats

CKPT_SUFFIXES = (*formats.TORCH_SUFFIXES, ".safetensors")
SIDE_MARKERS = (".done", ".complete")
DIR_MARKERS = ("COMPLETE", ".complete", "DONE", ".onbox-complete")
DCP_MARKER = ".metadata"
# names that are work in progress by convention: HF's tmp-checkpoint-N, torch.save-then-rename temps
IN_PROGRESS_RE = re.compile(r"(^tmp[-_.])|(\.(tmp|part|partial|incomplete|lock)$)|(^\.)", re.I)
STEP_RE = re.compile(r"(?:checkpoint|global_step|step|iter|iteration|ckpt)[-_=]?(\d+)", re.I)

Fingerprint = Tuple[Tuple[str, int, int, int], ...]  # (relpath, size, mtime_ns, inode) per file


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
    step: Optional[int] = None  # from the name, else from progress.json when the entry was first seen
    metrics: Dict[str, Any] = dataclasses.field(default_factory=dict)
    complete: bool = False
    reason: str = ""  # why complete ("marker", "quiescent") or why not

    @property
    def root(self) -> str:
        """The directory the relative `files` live in."""
        return self.path if self.is_dir else os.path.dirname(self.path)


def step_from_name(name: str) -> Optional[int]:
    m = STEP_RE.search(name)
    return int(m.group(1)) if m else None


def _walk_files(top: str) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for fn in sorted(filenames):
            full = os.path.join(dirpath, fn)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, top))
    return out


def _fingerprint(root: str, files: List[str]) -> Fingerprint:
    fp = []
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        fp.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(fp)


def fingerprint_of(cand: Candidate) -> Fingerprint:
    """Re-read the fingerprint now (to notice a file changed while it was being copied)."""
    return _fingerprint(cand.root, cand.files)


def scan(ckpt_dir: str) -> List[Candidate]:
    """Every checkpoint entry in ckpt_dir (complete or not), without format checks."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return []
    present = set(names)
    out = []
    for name in names:
        if IN_PROGRESS_RE.search(name) or name.endswith(SIDE_MARKERS):
            continue
        path = os.path.join(ckpt_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                files = _walk_files(path)
                if not files:
                    continue
                marked = any(m in files for m in DIR_MARKERS) or DCP_MARKER in files
                fp = _fingerprint(path, files)
                is_dir = True
            elif os.path.isfile(path) and name.endswith(CKPT_SUFFIXES):
                files = [name]
                fp = _fingerprint(ckpt_dir, files)
                marked = False
                is_dir = False
            else:
                continue
        except FileNotFoundError:  # vanished while we looked (the trainer's own retention)
            continue
        marked = marked or any((name + s) in present for s in SIDE_MARKERS)
        out.append(Candidate(name=name, path=path, is_dir=is_dir, files=files, fingerprint=fp,
                             bytes=sum(f[1] for f in fp), newest_mtime=max(f[2] for f in fp) / 1e9,
                             marked=marked, step=step_from_name(name)))
    return out


def self_checking(cand: Candidate) -> bool:
    """Every file is a torch zip or safetensors (formats whose structure exposes a torn write)."""
    try:
        return all(formats.sniff(os.path.join(cand.root, rel)) in ("zip", "safetensors") for rel in cand.files)
    except OSError:
        return False


def check_formats(cand: Candidate) -> Optional[str]:
    """The structural checks of every file; a problem string naming the file, or None."""
    for rel in cand.files:
        res = formats.check_file(os.path.join(cand.root, rel), full=False)
        if not res.ok:
            return "%s: %s" % (rel, res.problem)
    return None


class CompletionTracker:
    """Remembers when each entry's fingerprint last changed, to judge quiescence across loop ticks.

    `now_mono`/`now_wall` come from the clock seam. An entry whose files are older than the settle interval by
    their mtimes (an old checkpoint found at start-up) is quiescent at once.
    """

    def __init__(self, settle_seconds: float) -> None:
        self.settle = settle_seconds
        self._seen: Dict[str, Tuple[Fingerprint, float, Optional[int], Dict[str, Any]]] = {}
        self._checked: Dict[Tuple[str, Fingerprint], Optional[str]] = {}

    def update(self, cands: List[Candidate], now_mono: float, now_wall: float,
               progress: Optional[Dict[str, Any]] = None, settle: Optional[float] = None,
               settle_self_checking: Optional[float] = None) -> List[Candidate]:
        """Fill in step/metrics/complete/reason on each candidate; returns them (newest last).

        `settle_self_checking` (if given) applies instead of `settle` to candidates whose every file carries its
        own integrity structure (torch zip, safetensors): a torn one fails the format checks anyway.
        """
        default_settle = self.settle if settle is None else settle
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
            if c.step is None:
                c.step = seen[2]
            c.metrics = seen[3]
            settle = default_settle
            if settle_self_checking is not None and self_checking(c):
                settle = min(settle, settle_self_checking)
            quiet = (now_mono - seen[1] >= settle) or (now_wall - c.newest_mtime >= settle)
            if not (c.marked or quiet):
                c.complete, c.reason = False, "still changing (settle %.3gs)" % settle
                continue
            key = (c.name, c.fingerprint)
            if key not in self._checked:
                self._checked[key] = check_formats(c)
            problem = self._checked[key]
            if problem:
                c.complete, c.reason = False, "format check failed: %s" % problem
            else:
                c.complete, c.reason = True, "marker" if c.marked else "quiescent"
        if len(self._checked) > 4096:
            self._checked.clear()
        return sorted(cands, key=order_key)


def order_key(c: Candidate) -> Tuple[int, float]:
    """Newest last: by step when known, then by mtime."""
    return (c.step if c.step is not None else -1, c.newest_mtime)


def durable_name(c: Candidate) -> str:
    """The name a checkpoint gets on durable storage. An entry rewritten in place (ckpt.pt) holds many
    checkpoints over time, so its durable name carries the step (or the mtime when no step is known)."""
    if step_from_name(c.name) is not None:
        return c.name
    if c.step is not None:
        return "%s.step-%d" % (c.name, c.step)
    return "%s.t-%d" % (c.name, int(c.newest_mtime))
