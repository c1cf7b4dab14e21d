"""Checkpoint formats, without any framework installed: one module per format, in a registry (this module). Adding a
framework is adding one module (a Format, base.py says what it answers) and one line in FILE_FORMATS, DIR_FORMATS
or GROUP_FORMATS below, and its tests.

  base.py       what a format answers (names, completeness, structural check, step, restore) and what they share
  torch.py      torch.save's files (.pt .pth .ckpt .bin) and legacy torch pickles; torchpickle.py: the layouts
                torch.save writes and a safe unpickler (imports nothing, runs nothing)
  zips.py       zips: torch zips, Keras 3 `.keras`, numpy `.npz`, stable-baselines3 `.zip` (central directory whole)
  safetensors.py  safetensors (the header parses, its tensors cover the buffer)
  numpy.py      `.npy` (the header's shape and dtype against the file's size)
  hdf5.py       HDF5 `.h5` (the superblock's end-of-file address against the file's size)
  pickles.py    pickles and joblib dumps (protocol 2+, ends in STOP)
  xgboost.py    XGBoost `.ubj` models (the UBJSON document whole; `.json` models are JSON)
  jsonfile.py   JSON (parses)
  hf.py         Hugging Face Trainer `checkpoint-N/` and save_pretrained dirs
  dcp.py        torch.distributed.checkpoint dirs (`.metadata` last); deepspeed.py: DeepSpeed tags (`latest`)
  orbax.py      Orbax CheckpointManager step dirs (`_CHECKPOINT_METADATA`; `*.orbax-checkpoint-tmp*` in progress)
  kerasbackup.py  Keras BackupAndRestore dirs (training_metadata.json written after the weights)
  tfcheckpoint.py  TensorFlow checkpoints (`P.index` + `P.data-*`, and the `checkpoint` state file)
  stepread.py   the step a checkpoint records about itself, through the registry

Two depths. check_file(path, full=False) (detection, restore) reads the ends and headers only, never the payload;
full=True (verify) also reads every byte a format can check (zip CRCs, a large JSON whole).

May import: the shared leaves and onbox.checkpoints (the base). Nothing else of the package.
"""
from __future__ import annotations

import os
import re
import stat
from typing import List, Optional, Sequence, Tuple

from onbox import untrusted
from onbox.checkpoints.formats import (
    dcp,
    deepspeed,
    hdf5,
    hf,
    jsonfile,
    kerasbackup,
    numpy,
    orbax,
    pickles,
    safetensors,
    tfcheckpoint,
    torch,
    xgboost,
    zips,
)
from onbox.checkpoints.formats.base import (
    HEAD_BYTES,
    UNREADABLE,
    Format,
    FormatResult,
    Group,
    Layout,
    StepReading,
)

# in the order they are asked: a name (torch's suffixes) before a content sniff, magic numbers before suffixes
FILE_FORMATS: Sequence[Format] = (*torch.FORMATS, zips.FORMAT, safetensors.FORMAT, numpy.FORMAT, hdf5.FORMAT,
                                  xgboost.FORMAT, pickles.FORMAT, jsonfile.FORMAT)
# the first whose layout() answers names the directory
DIR_FORMATS: Sequence[Format] = (dcp.FORMAT, deepspeed.FORMAT, *hf.FORMATS, orbax.FORMAT, kerasbackup.FORMAT)
GROUP_FORMATS: Sequence[Format] = (tfcheckpoint.FORMAT,)
ALL_FORMATS: Sequence[Format] = (*FILE_FORMATS, *DIR_FORMATS, *GROUP_FORMATS)

TORCH_SUFFIXES = torch.TORCH_SUFFIXES
JSON_PARSE_ALWAYS = jsonfile.JSON_PARSE_ALWAYS
check_json = jsonfile.check_json
describe = torch.describe
# names that are work in progress by convention, whatever the format: HF's tmp-checkpoint-N, save-then-rename
# temps, dot files (onbox's own .onbox-aside among them)
IN_PROGRESS_RE = re.compile(r"(^tmp[-_.])|(\.(tmp|part|partial|incomplete|lock)$)|(^\.)", re.I)
UNKNOWN = Layout("unknown", None)

__all__ = [
    "JSON_PARSE_ALWAYS",
    "TORCH_SUFFIXES",
    "UNREADABLE",
    "FormatResult",
    "Group",
    "Layout",
    "StepReading",
    "check_file",
    "check_json",
    "describe",
    "dir_layout",
    "groups",
    "in_progress",
    "inspect",
    "named",
]


def in_progress(name: str) -> bool:
    """A name that is work in progress by convention or by a format's own rule: never a candidate."""
    return bool(IN_PROGRESS_RE.search(name)) or any(f.in_progress(name) for f in ALL_FORMATS)


def file_format(path: str, head: bytes) -> Optional[Format]:
    """The format that claims the file (by its name, then its first bytes), or None."""
    name = os.path.basename(path)
    return next((f for f in FILE_FORMATS if f.claims_file(name, head)), None)


def inspect(path: str, full: bool = False) -> Tuple[FormatResult, Optional[Format]]:
    """Check one file by its format (`full`: every byte the format can check); the format, None for a file no
    format claims (kind "other", no check: the manifest hash covers it)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a device, FIFO or socket (often behind a symlink): never read it
            return FormatResult("other", "%s: %s is %s%s" % (
                UNREADABLE[1], os.path.basename(path), untrusted.describe_mode(st.st_mode),
                " (through a symlink to %s)" % os.path.realpath(path) if os.path.islink(path) else "")), None
        with open(path, "rb", buffering=0) as f:
            head = f.read(HEAD_BYTES)
        fmt = file_format(path, head)
        if fmt is None:
            return FormatResult("other", None), None
        return fmt.check(path, st.st_size, full), fmt
    except OSError as e:
        return FormatResult("other", "%s: %s" % (UNREADABLE[0], e.strerror or e)), None


def check_file(path: str, full: bool = False) -> FormatResult:
    """Check one file; `full` also reads every byte (zip CRCs, the whole of a large JSON)."""
    return inspect(path, full)[0]


def sniff(path: str) -> str:
    """The name of the format that claims a file ("other" for none)."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(HEAD_BYTES)
    fmt = file_format(path, head)
    return fmt.name if fmt is not None else "other"


def dir_layout(path: str, files: List[str]) -> Layout:
    """What the checkpoint directory `path` is (files: its regular files, relative) and whether its own format
    says it is complete; UNKNOWN when no format claims it."""
    for f in DIR_FORMATS:
        layout = f.layout(path, files)
        if layout is not None:
            return layout
    return UNKNOWN


def groups(names: List[str]) -> List[Group]:
    """Top-level files of a checkpoint dir that make one checkpoint together (a TensorFlow save)."""
    return [g for f in GROUP_FORMATS for g in f.groups(names)]


def named(name: str) -> Optional[Format]:
    """The format of that name (a manifest's `format`, a candidate's), or None."""
    return next((f for f in ALL_FORMATS if f.name == name), None)
