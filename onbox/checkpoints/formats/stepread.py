"""The training step a checkpoint records about itself, read without torch and without running its code.

Where formats record it: Hugging Face `checkpoint-N/trainer_state.json` global_step; Lightning's `.ckpt` (a torch
zip) `global_step` in its top-level dict; nanoGPT's `ckpt.pt` `iter_num`; plain torch.save loops `step` and the
like. A name (`ckpt.pt`) or the progress the trainer printed only guess it: nanoGPT rewrites one ckpt.pt, and its
log runs ahead of the save.

Cost: a torch zip's central directory and its data.pkl (the object graph; tensors are separate members and are
never read); a legacy pickle's leading pickles. Both bounded by torchpickle.PICKLE_LIMIT.
"""
from __future__ import annotations

import json
import os
import zipfile
from typing import Any, List, NamedTuple, Optional

from onbox.checkpoints import formats
from onbox.checkpoints.formats import torchpickle

# top-level keys, most specific first: Lightning and HF-style `global_step`, DeepSpeed's `global_steps`
# (mp_rank_*_model_states.pt), nanoGPT's `iter_num`, then what hand-written loops use
STEP_KEYS = ("global_step", "global_steps", "iter_num", "step", "iteration", "iter")
TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_LIMIT = 64 * 1024 * 1024  # its log_history grows with the run; megabytes, not gigabytes
DIR_MAX_FILES = 64  # torch files read in one dir (a DeepSpeed dir holds one model-states file and N shards)
DIR_MAX_DEPTH = 2  # Lightning's DeepSpeed checkpoint dir keeps its files one level down (checkpoint/)


class StepReading(NamedTuple):
    step: int
    source: str  # "<file>:<key>", e.g. "ckpt.pt:iter_num", "trainer_state.json:global_step"


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


def step_of_file(path: str) -> Optional[StepReading]:
    """The step a torch checkpoint file (zip or legacy pickle) records at its top level, or None."""
    return _step_of_file(path, os.path.basename(path))


def _step_of_file(path: str, label: str) -> Optional[StepReading]:
    try:
        kind = formats.sniff(path)
        if kind == "zip":
            with zipfile.ZipFile(path) as zf:
                layout = torchpickle.zip_layout(zf)
                if layout.problem is not None:
                    return None
                obj, _ = torchpickle.read_zip_object(zf, layout)
        elif kind == "torch-legacy":
            obj = torchpickle.read_legacy(path).obj
        else:
            return None
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, torchpickle.Unreadable,
            torchpickle.TooLarge):
        return None  # unreadable, torn or too big to read cheaply: the caller falls back to other evidence
    found = step_in(obj)
    return StepReading(found.step, "%s:%s" % (label, found.source)) if found else None


def step_of_dir(path: str) -> Optional[StepReading]:
    """The step a checkpoint dir records: HF trainer_state.json global_step; else the step its torch files
    record, when they agree; None otherwise (also when trainer_state.json is there but unreadable)."""
    state = os.path.join(path, TRAINER_STATE)
    if os.path.isfile(state):
        return _trainer_state_step(state)
    readings = [r for r in (_step_of_file(os.path.join(path, rel), rel) for rel in _torch_files(path)) if r]
    if not readings or len({r.step for r in readings}) != 1:
        return None  # none, or files that disagree: no honest single answer
    return readings[0]


def _trainer_state_step(path: str) -> Optional[StepReading]:
    try:
        if os.path.getsize(path) > TRAINER_STATE_LIMIT:
            return None
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # torn (HF writes it last, not atomically): the dir is not complete anyway
    value = doc.get("global_step") if isinstance(doc, dict) else None
    if type(value) is int and value >= 0:
        return StepReading(value, "%s:global_step" % TRAINER_STATE)
    return None


def _torch_files(top: str) -> List[str]:
    """Torch-named files under `top` (relative paths, sorted, at most DIR_MAX_FILES, DIR_MAX_DEPTH deep)."""
    out: List[str] = []
    for dirpath, dirnames, filenames in os.walk(top):
        depth = os.path.relpath(dirpath, top).count(os.sep) + (dirpath != top)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < DIR_MAX_DEPTH - 1 else []
        for fn in sorted(filenames):
            if fn.endswith(formats.TORCH_SUFFIXES) and not fn.startswith("."):
                out.append(os.path.relpath(os.path.join(dirpath, fn), top))
                if len(out) >= DIR_MAX_FILES:
                    return out
    return out
