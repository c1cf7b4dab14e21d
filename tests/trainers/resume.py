"""Would the real trainer resume from this? The resume paths of the pinned frameworks, followed step by step
without importing transformers or lightning (torch only), raising nothing: each check returns a Resume with the
step the trainer would continue from, or the exception the real resume raises (type and message start), and for
Hugging Face what a resume silently goes without. The facts are in README.md beside this file; the integration
tests check these answers against the real trainers.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, List, Optional

import torch


class Resume:
    def __init__(self, ok: bool, step: Optional[int] = None, error: str = "", degraded: Optional[List[str]] = None
                 ) -> None:
        self.ok, self.step, self.error, self.degraded = ok, step, error, degraded or []

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return "Resume(ok=%r, step=%r, error=%r, degraded=%r)" % (self.ok, self.step, self.error, self.degraded)


def _fail(e: BaseException) -> Resume:
    return Resume(False, error="%s: %s" % (type(e).__name__, str(e)[:200]))


def safetensors_problem(path: str) -> Optional[str]:
    """What safetensors' load_file refuses: a short file, a header that does not parse, offsets that do not tile
    the data exactly. None when the file is whole."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "HeaderTooSmall"
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            return "InvalidHeaderLength"
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            return "InvalidHeaderDeserialization: %s" % e
    end = 0
    for name, info in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                             key=lambda kv: kv[1]["data_offsets"][0]):
        start, stop = info["data_offsets"]
        if start != end:
            return "InvalidOffset: %s" % name
        end = stop
    if 8 + n + end != size:
        return "MetadataIncompleteBuffer"
    return None


def _torch_load(path_or_file: Any) -> Any:
    return torch.load(path_or_file, map_location="cpu", weights_only=True)


def _load_rng_like_hf(path: str) -> Any:
    """The Trainer loads rng_state.pth with weights_only=True and numpy's array types allowlisted."""
    try:
        import numpy as np
    except ImportError:
        return _torch_load(path)
    core = np._core if hasattr(np, "_core") else np.core
    allow = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allow):
        return _torch_load(path)


# ---- Hugging Face Trainer ---------------------------------------------------------------------------------------

_HF_WEIGHTS = ("pytorch_model.bin", "model.safetensors", "pytorch_model.bin.index.json",
               "model.safetensors.index.json", "adapter_model.bin", "adapter_model.safetensors")
_CHECKPOINT_RE = re.compile(r"^checkpoint\-(\d+)$")


def hf_last_checkpoint(output_dir: str) -> Optional[str]:
    """resume_from_checkpoint=True: the checkpoint-N dir with the highest N, complete or not (no check at all)."""
    found = [d for d in os.listdir(output_dir)
             if _CHECKPOINT_RE.search(d) and os.path.isdir(os.path.join(output_dir, d))]
    if not found:
        return None
    return os.path.join(output_dir, max(found, key=lambda d: int(_CHECKPOINT_RE.search(d).group(1))))  # type: ignore[union-attr]


def check_hf(ckpt: str) -> Resume:
    """Trainer.train(resume_from_checkpoint=ckpt), in its order: weights (one weights file must exist; config.json
    is read only when present), then trainer_state.json (required), then optimizer.pt + scheduler.pt (loaded only
    when BOTH exist, else silently skipped), scaler.pt and rng_state.pth (each only when present)."""
    j = os.path.join
    try:
        if not any(os.path.isfile(j(ckpt, w)) for w in _HF_WEIGHTS):
            raise ValueError("Can't find a valid checkpoint at %s" % ckpt)
        if os.path.isfile(j(ckpt, "config.json")):
            with open(j(ckpt, "config.json"), encoding="utf-8") as f:
                json.loads(f.read())
        if os.path.isfile(j(ckpt, "model.safetensors")):
            problem = safetensors_problem(j(ckpt, "model.safetensors"))
            if problem:
                raise ValueError("SafetensorError: Error while deserializing header: %s" % problem)
        elif os.path.isfile(j(ckpt, "pytorch_model.bin")):
            _torch_load(j(ckpt, "pytorch_model.bin"))
        with open(j(ckpt, "trainer_state.json"), encoding="utf-8") as f:
            step = int(json.loads(f.read())["global_step"])
        degraded = []
        has_opt = os.path.isfile(j(ckpt, "optimizer.pt")) or os.path.isfile(j(ckpt, "optimizer.bin"))
        if has_opt and os.path.isfile(j(ckpt, "scheduler.pt")):
            _torch_load(j(ckpt, "optimizer.pt"))
            _torch_load(j(ckpt, "scheduler.pt"))
        else:
            degraded.append("optimizer/scheduler not restored (optimizer.pt or scheduler.pt missing)")
        if os.path.isfile(j(ckpt, "scaler.pt")):
            _torch_load(j(ckpt, "scaler.pt"))
        if os.path.isfile(j(ckpt, "rng_state.pth")):
            _load_rng_like_hf(j(ckpt, "rng_state.pth"))
        else:
            degraded.append("RNG state not restored (rng_state.pth missing)")
    except Exception as e:  # the answer is which exception the real resume meets
        return _fail(e)
    return Resume(True, step, degraded=degraded)


def is_resumable_hf(ckpt: str) -> bool:
    return check_hf(ckpt).ok


def hf_complete(ckpt: str) -> bool:
    """Everything a finished Trainer save leaves, each file whole: resumable AND nothing silently missing."""
    r = check_hf(ckpt)
    return r.ok and not r.degraded


# ---- nanoGPT ----------------------------------------------------------------------------------------------------

def load_like_nanogpt(out_dir: str) -> dict:
    """train.py with init_from='resume': torch.load(out_dir/ckpt.pt, map_location=device) (weights_only is
    torch's default, True since torch 2.6), then the keys it reads. Raises what train.py meets."""
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu")
    for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"):
        checkpoint["model_args"][k]
    checkpoint["model"], checkpoint["optimizer"], checkpoint["best_val_loss"]
    return checkpoint


def check_nanogpt(out_dir: str) -> Resume:
    try:
        return Resume(True, int(load_like_nanogpt(out_dir)["iter_num"]))
    except Exception as e:
        return _fail(e)


# ---- Lightning --------------------------------------------------------------------------------------------------

def lightning_last(dirpath: str) -> Optional[str]:
    """fit(ckpt_path="last"): the newest (by mtime) last*.ckpt in the ModelCheckpoint dir, whole or torn."""
    # ModelCheckpoint._find_last_checkpoints: re.match(r"^last(-(\d+))?", stem), unanchored, so any stem that
    # starts with "last" counts (last-v1 included).
    pattern = re.compile(r"^last(-(\d+))?")
    found = [os.path.join(dirpath, n) for n in os.listdir(dirpath)
             if n.endswith(".ckpt") and pattern.match(n[:-5])]
    return max(found, key=os.path.getmtime) if found else None


def check_lightning(path: str) -> Resume:
    """fit(ckpt_path=path): torch.load through an fsspec file object (weights_only=True by default), then the
    model, optimizer and scheduler states; missing optimizer_states/lr_schedulers raise KeyError."""
    try:
        with open(path, "rb") as f:
            ckpt = _torch_load(f)
        ckpt["state_dict"]
        for key in ("optimizer_states", "lr_schedulers"):
            if key not in ckpt:
                raise KeyError("Trying to restore %s but checkpoint contains only the model." % key)
        return Resume(True, int(ckpt["global_step"]))
    except Exception as e:
        return _fail(e)


# ---- plain torch loop -------------------------------------------------------------------------------------------

def check_plain(path: str) -> Resume:
    try:
        ckpt = torch.load(path, map_location="cpu")
        ckpt["model"], ckpt["optimizer"]
        return Resume(True, int(ckpt["step"]))
    except Exception as e:
        return _fail(e)
