"""What a checkpoint directory is, and when its own format says it is complete.

A quiet directory is not a complete one: a Hugging Face Trainer killed between `save_model()` and the optimizer
save leaves `checkpoint-N/` with the weights and no `trainer_state.json`, quiet forever, and resuming from it fails
with FileNotFoundError. So a directory of a known format is complete only when that format's last-written file is
there and valid; quiescence completes only directories of no known format (and the manifest says which rule
applied).

  hf-trainer  transformers.Trainer's checkpoint-N/: trainer_state.json is written last (after the weights, the
              optimizer, the scheduler and the RNG state); complete when it parses and model weights are present
  hf-model    save_pretrained(): config.json and the weights; a sharded save writes its *.index.json after the
              shards, and every shard it names must be present
  dcp         torch.distributed.checkpoint (also Lightning's FSDP dirs): `.metadata` is written last
  deepspeed   a DeepSpeed save: the `latest` file naming the tag is written after every rank saved
  unknown     anything else: complete once quiet for the settle interval
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, NamedTuple, Optional

HF_STATE = "trainer_state.json"
HF_ARGS = "training_args.bin"
HF_NAME_RE = re.compile(r"^checkpoint-\d+$")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin",
                "tf_model.h5", "flax_model.msgpack")
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json
SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.(safetensors|bin)$")
DCP_MARKER = ".metadata"
DEEPSPEED_LATEST = "latest"
DEEPSPEED_STEP_RE = re.compile(r"^global_step(\d+)$")


class Layout(NamedTuple):
    format: str  # "hf-trainer" | "hf-model" | "dcp" | "deepspeed" | "unknown"
    problem: Optional[str]  # None: complete by the format's own rule (or unknown: the caller decides)
    done_by: str = ""  # what completes it, for the manifest and listings ("trainer_state.json present")


def read_json_object(path: str) -> Optional[Dict[str, Any]]:
    """A small JSON file's object, or None when absent, partial (still being written) or not an object."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(16 * 1024 * 1024).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _weights_problem(root: str, files: List[str]) -> Optional[str]:
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


def _is_hf_trainer(name: str, top: set) -> bool:
    if HF_STATE in top or HF_ARGS in top:
        return True
    return bool(HF_NAME_RE.fullmatch(name)) and bool(top & {"config.json", "optimizer.pt", "scheduler.pt",
                                                       "rng_state.pth", *WEIGHT_FILES})


def dir_layout(path: str, files: List[str]) -> Layout:
    """The format of the checkpoint directory `path` (files: its regular files, relative) and its completeness."""
    name = os.path.basename(path)
    top = {f for f in files if "/" not in f}
    if DCP_MARKER in top or any(f.endswith(".distcp") for f in top):
        if DCP_MARKER in top:
            return Layout("dcp", None, "%s present (written last)" % DCP_MARKER)
        return Layout("dcp", "no %s yet (torch.distributed.checkpoint writes it last)" % DCP_MARKER)
    if DEEPSPEED_LATEST in top:
        with open(os.path.join(path, DEEPSPEED_LATEST), "rb") as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
        if tag and any(f.startswith(tag + "/") for f in files):
            return Layout("deepspeed", None, "`latest` names %s (written after every rank saved)" % tag)
        return Layout("deepspeed", "`latest` names %r, which holds no files" % tag)
    ds = DEEPSPEED_STEP_RE.fullmatch(name)
    if ds and any(f.startswith("mp_rank_") or f.startswith("zero_pp_rank_") for f in top):
        return _deepspeed_tag(path, int(ds.group(1)))
    if _is_hf_trainer(name, top):
        state = read_json_object(os.path.join(path, HF_STATE)) if HF_STATE in top else None
        if state is None:
            why = "no %s yet" % HF_STATE if HF_STATE not in top else "%s is not complete JSON" % HF_STATE
            return Layout("hf-trainer", "%s (the Trainer writes it last: without it the save was interrupted "
                                        "and resuming fails)" % why)
        weights = _weights_problem(path, files)
        if weights:
            return Layout("hf-trainer", weights)
        return Layout("hf-trainer", None, "%s present (written last)" % HF_STATE)
    if "config.json" in top and (top.intersection(WEIGHT_FILES) or any(
            f.endswith(INDEX_SUFFIX) or SHARD_RE.search(f) for f in top)):
        weights = _weights_problem(path, files)
        if weights:
            return Layout("hf-model", weights)
        if read_json_object(os.path.join(path, "config.json")) is None:
            return Layout("hf-model", "config.json is not complete JSON")
        return Layout("hf-model", None, "config.json and every weight file present")
    return Layout("unknown", None)


def _deepspeed_tag(path: str, step: int) -> Layout:
    """A DeepSpeed tag dir (global_stepN/) beside its `latest` file: complete once `latest` names it or a later
    tag (DeepSpeed writes `latest` after every rank's files of the tag)."""
    try:
        with open(os.path.join(os.path.dirname(path), DEEPSPEED_LATEST), "rb") as f:
            latest = f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return Layout("deepspeed", "no `latest` file beside it yet (DeepSpeed writes it after the save)")
    m = DEEPSPEED_STEP_RE.fullmatch(latest)
    if m and int(m.group(1)) >= step:
        return Layout("deepspeed", None, "`latest` names %s" % latest)
    return Layout("deepspeed", "`latest` names %r, not this tag yet" % latest)
