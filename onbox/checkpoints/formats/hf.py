"""Hugging Face directories. A quiet directory is not a complete one: a Trainer killed between `save_model()` and
the optimizer save leaves `checkpoint-N/` with the weights and no `trainer_state.json`, quiet forever, and
resuming from it fails with FileNotFoundError. So these are complete only when their last-written file is there.

  hf-trainer  transformers.Trainer's checkpoint-N/: trainer_state.json is written last (after the weights, the
              optimizer, the scheduler and the RNG state); complete when it parses and the model weights are
              present. Step: trainer_state.json global_step.
  hf-model    save_pretrained(): config.json and the weights; a sharded save writes its *.index.json after the
              shards, and every shard it names must be present.
"""
from __future__ import annotations

import json
import os
import re
from typing import List, Optional

from onbox.checkpoints.formats.base import Format, Layout, StepReading, read_json_object

HF_STATE = "trainer_state.json"
HF_ARGS = "training_args.bin"
HF_NAME_RE = re.compile(r"^checkpoint-\d+$")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin",
                "tf_model.h5", "flax_model.msgpack")
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json
SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$")
TRAINER_STATE_LIMIT = 64 * 1024 * 1024  # its log_history grows with the run; megabytes, not gigabytes


def weights_problem(root: str, files: List[str]) -> Optional[str]:
    """None when the model weights of an HF save are all there; else what is missing."""
    top = {f for f in files if "/" not in f}
    indexes = sorted(f for f in top if f.endswith(INDEX_SUFFIX) and f[:-len(INDEX_SUFFIX)].endswith(
        (".safetensors", ".bin")))
    for index in indexes:
        doc = read_json_object(os.path.join(root, index))
        if doc is None or not isinstance(doc.get("weight_map"), dict):
            return "%s is unreadable (still being written?)" % index
        missing = sorted({str(v) for v in doc["weight_map"].values()} - set(files))
        if missing:
            return "%s names shard(s) that are missing: %s" % (index, ", ".join(missing[:3]))
    if indexes or top.intersection(WEIGHT_FILES):
        return None
    if any(SHARD_RE.search(f) for f in top):
        return "weight shards without their index file (the index is written after the shards)"
    # other weight layouts a Trainer writes: FSDP (pytorch_model_fsdp_*), DeepSpeed (global_step*/)
    if any(f.startswith(("pytorch_model_fsdp", "global_step")) for f in files):
        return None
    return "no model weights (model.safetensors, pytorch_model.bin or a sharded index)"


def _is_trainer_dir(name: str, top: set) -> bool:
    if HF_STATE in top or HF_ARGS in top:
        return True
    return bool(HF_NAME_RE.fullmatch(name)) and bool(top & {"config.json", "optimizer.pt", "scheduler.pt",
                                                       "rng_state.pth", *WEIGHT_FILES})


class HfTrainerFormat(Format):
    name = "hf-trainer"

    def layout(self, path: str, files: List[str]) -> Optional[Layout]:
        top = {f for f in files if "/" not in f}
        if not _is_trainer_dir(os.path.basename(path), top):
            return None
        state = read_json_object(os.path.join(path, HF_STATE)) if HF_STATE in top else None
        if state is None:
            why = "no %s yet" % HF_STATE if HF_STATE not in top else "%s is not complete JSON" % HF_STATE
            return Layout(self.name, "%s (the Trainer writes it last: without it the save was interrupted and "
                                     "resuming fails)" % why)
        weights = weights_problem(path, files)
        if weights:
            return Layout(self.name, weights)
        return Layout(self.name, None, "%s present (written last)" % HF_STATE)

    def step_of_dir(self, path: str, files: List[str]) -> Optional[StepReading]:
        return trainer_state_step(os.path.join(path, HF_STATE))


class HfModelFormat(Format):
    name = "hf-model"

    def layout(self, path: str, files: List[str]) -> Optional[Layout]:
        top = {f for f in files if "/" not in f}
        if "config.json" not in top or not (top.intersection(WEIGHT_FILES) or any(
                f.endswith(INDEX_SUFFIX) or SHARD_RE.search(f) for f in top)):
            return None
        weights = weights_problem(path, files)
        if weights:
            return Layout(self.name, weights)
        if read_json_object(os.path.join(path, "config.json")) is None:
            return Layout(self.name, "config.json is not complete JSON")
        return Layout(self.name, None, "config.json and every weight file present")


def trainer_state_step(path: str) -> Optional[StepReading]:
    """trainer_state.json's global_step; None when absent, torn or unreadable (not a guess)."""
    try:
        if os.path.getsize(path) > TRAINER_STATE_LIMIT:
            return None
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # torn (HF writes it last, not atomically): the dir is not complete anyway
    value = doc.get("global_step") if isinstance(doc, dict) else None
    if type(value) is int and value >= 0:
        return StepReading(value, "%s:global_step" % HF_STATE)
    return None


FORMATS = (HfTrainerFormat(), HfModelFormat())
