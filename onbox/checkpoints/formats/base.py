"""What every format module of this package defines, and what they share.

A format is one object (a Format subclass, FORMAT in its module) that the registry (the package's __init__) asks,
in order:

  names          in_progress(name): a name the format uses for work in progress (Orbax's `<step>.orbax-checkpoint-
                 tmp*`): never a candidate, whatever it holds;
                 claims_file(name, head): a file of this format, by its name or its first bytes;
                 layout(path, files): a directory of this format and whether its own rule says it is complete
                 (Layout; None: not this format's directory);
                 groups(names): files of the checkpoint dir's top level that make ONE checkpoint together
                 (TensorFlow's `<prefix>.index` + `<prefix>.data-*`);
  completeness   check(path, size, full): the structural check of one file (a torn file is a problem);
                 self_checking: a whole structure means a finished save (its last bytes are written last), so no
                 quiet period is needed: committed at once, however often the trainer rewrites it;
                 a directory's completeness is its Layout's (the format's own last-written file);
  step           step_of_file(path), step_of_dir(path, files), step_of_name(name): what the checkpoint records;
  restore        after_restore(ckpt_dir, local_name, files): what the framework also needs beside the restored
                 files (TensorFlow's `checkpoint` state file naming them).

Nothing here runs a framework's code: files are read as bytes, pickles by the safe unpickler (torchpickle.py).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

# how a problem that is this box's, not the file's, begins: never called torn (the bytes may be whole)
UNREADABLE = ("cannot read", "not a regular file")
EMPTY = "empty file (torn: its save was killed before any byte reached the disk)"
HEAD_BYTES = 64  # what sniffing reads of a file

# top-level keys, most specific first: Lightning and HF-style `global_step`, DeepSpeed's `global_steps`
# (mp_rank_*_model_states.pt), nanoGPT's `iter_num`, then what hand-written loops use
STEP_KEYS = ("global_step", "global_steps", "iter_num", "step", "iteration", "iter")


class FormatResult(NamedTuple):
    kind: str  # the format's name: "torch-zip", "torch-legacy", "safetensors", "json", "zip", "npy", ... "other"
    problem: Optional[str]  # None when the checks passed (or the format has none)
    note: str = ""  # what could not be checked, when something could not (e.g. a pickle over the size limit)

    @property
    def ok(self) -> bool:
        return self.problem is None


class Layout(NamedTuple):
    format: str  # "hf-trainer" | "hf-model" | "dcp" | "deepspeed" | "orbax" | "keras-backup" | "unknown"
    problem: Optional[str]  # None: complete by the format's own rule (or unknown: the caller decides)
    # what completes it, for the manifest and listings ("trainer_state.json present"); "" with no problem: the
    # format has no rule for this one, and the generic rules decide (its rename, its close, quiet)
    done_by: str = ""


class StepReading(NamedTuple):
    step: int
    source: str  # "<file>:<key>", e.g. "ckpt.pt:iter_num", "trainer_state.json:global_step"


class Group(NamedTuple):
    """Files of the checkpoint dir's top level that are one checkpoint (TensorFlow's `ckpt-3.index` and its
    `ckpt-3.data-00000-of-00001`): `name` is what the framework calls it (the prefix), `files` its members."""

    name: str
    files: Tuple[str, ...]
    format: str


class Format:
    """One checkpoint format; every method has the answer of a format that does not know the thing asked."""

    name = "other"
    self_checking = False  # a whole structure proves a finished save

    def in_progress(self, name: str) -> bool:
        return False

    def claims_file(self, name: str, head: bytes) -> bool:
        return False

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        return FormatResult(self.name, None)

    def finished(self, res: FormatResult) -> bool:
        """The check's result proves the save finished (no quiet period needed)."""
        return self.self_checking and res.ok

    def layout(self, path: str, files: List[str]) -> Optional[Layout]:
        return None

    def groups(self, names: List[str]) -> List[Group]:
        return []

    def group_layout(self, root: str, group: Group, names: List[str]) -> Layout:
        return Layout(group.format, None, "")

    def step_of_file(self, path: str) -> Optional[StepReading]:
        return None

    def step_of_dir(self, path: str, files: List[str]) -> Optional[StepReading]:
        return None

    def step_of_name(self, name: str) -> Optional[int]:
        return None

    def after_restore(self, ckpt_dir: str, local_name: str, files: List[str]) -> Optional[str]:
        """Write what the framework needs beside a restored checkpoint; the path written, or None."""
        return None


def read_json_object(path: str, limit: int = 16 * 1024 * 1024) -> Optional[Dict[str, Any]]:
    """A small JSON file's object, or None when absent, partial (still being written) or not an object."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(limit).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def step_in(obj: Any) -> Optional[StepReading]:
    """The step in a checkpoint's top-level dict (a dict, or the placeholder of an OrderedDict): source is the key."""
    entries = obj if isinstance(obj, dict) else getattr(obj, "entries", None)
    if not isinstance(entries, dict):
        return None
    for key in STEP_KEYS:
        value = entries.get(key)
        if type(value) is int and value >= 0:  # bool is an int subclass: `step: True` is no step
            return StepReading(value, key)
    return None


def as_text(head: bytes) -> Optional[str]:
    """`head` as text when it reads as text (UTF-8, printable), else None."""
    if b"\x00" in head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut at the end of the sample
            return None
        text = head[:e.start].decode("utf-8")
    printable = sum(c.isprintable() or c in "\t\r\n" for c in text)
    return text if text and printable >= 0.95 * len(text) else None
