"""The training step a checkpoint records about itself, read without any framework and without running its code,
through the format registry: each format says where its step is (base.Format.step_of_file / step_of_dir).

Where formats record it: Hugging Face `checkpoint-N/trainer_state.json` global_step; Lightning's `.ckpt` (a torch
zip) `global_step` in its top-level dict; nanoGPT's `ckpt.pt` `iter_num`; plain torch.save loops and JSON state
files `step` and the like; Orbax's step dir name; Keras BackupAndRestore's training_metadata.json. A name
(`ckpt.pt`) or the progress the trainer printed only guess it: nanoGPT rewrites one ckpt.pt, and its log runs ahead
of the save.

Cost: a torch zip's central directory and its data.pkl (the object graph; tensors are separate members and are
never read); a legacy pickle's leading pickles. Both bounded by torchpickle.PICKLE_LIMIT.
"""
from __future__ import annotations

import os
from typing import List, Optional

from onbox.checkpoints import formats
from onbox.checkpoints.formats import hf, torchpickle
from onbox.checkpoints.formats.base import StepReading, step_in

__all__ = ["StepReading", "step_in", "step_of_dir", "step_of_file"]
DIR_MAX_FILES = 64  # torch files read in one dir (a DeepSpeed dir holds one model-states file and N shards)
DIR_MAX_DEPTH = 2  # Lightning's DeepSpeed checkpoint dir keeps its files one level down (checkpoint/)


def step_of_file(path: str) -> Optional[StepReading]:
    """The step a checkpoint file records (its format's rule), or None."""
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(64)
    except OSError:
        return None
    fmt = formats.file_format(path, head)
    return fmt.step_of_file(path) if fmt is not None else None


def step_of_dir(path: str, files: Optional[List[str]] = None) -> Optional[StepReading]:
    """The step a checkpoint dir records: its format's rule (HF trainer_state.json global_step, Orbax's step, Keras'
    epochs done); else the step its torch files record, when they agree; None otherwise (also when
    trainer_state.json is there but unreadable)."""
    state = os.path.join(path, hf.HF_STATE)
    if os.path.isfile(state):
        return hf.trainer_state_step(state)
    if files is not None:
        layout = formats.dir_layout(path, files) if files else formats.UNKNOWN
        fmt = formats.named(layout.format)
        if fmt is not None:
            found = fmt.step_of_dir(path, files)
            if found is not None:
                return found
    readings = [r for r in (torchpickle.step_of_torch_file(os.path.join(path, rel), rel)
                            for rel in _torch_files(path)) if r]
    if not readings or len({r.step for r in readings}) != 1:
        return None  # none, or files that disagree: no honest single answer
    return readings[0]


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
