"""Cheap replayers of real trainers' saves: the same file names, in the same order, in the same formats, with the
same atomic or in-place writes as the frameworks pinned in the `trainers` extra (see README.md beside this file),
without importing transformers or lightning (torch only), so a fuzz can fork a child per save and kill it.

Each writer calls crashpoints.point() at every boundary a kill can land on (file created, half written, written,
renamed, deleted); see crashpoints.py for enumerating them. At size_scale=1 the tensors have exactly the names and
shapes of the matching script in this folder, so the real trainer resumes from a replayed checkpoint.

Known differences from the real bytes (none matters to a resume): training_args.bin holds a plain dict where the
Trainer pickles its TrainingArguments object; tensor values are zeros; log histories are synthetic.
"""
from __future__ import annotations

import ctypes
import io
import json
import os
import random
import secrets
import string
import struct
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from tests.trainers.crashpoints import point

TRANSFORMERS_VERSION = "5.17.0"
LIGHTNING_VERSION = "2.6.6"

# ---- low-level writes, each with its crash points -------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_bytes_to_fd(fd: int, data: bytes, label: str) -> None:
    point(label + ":created")
    half = len(data) // 2
    _write_all(fd, data[:half])
    point(label + ":half")
    _write_all(fd, data[half:])


def write_in_place(path: str, data: bytes, label: str, mode: int = 0o666) -> None:
    """open(O_TRUNC) on the final name, then the bytes: how torch.save(obj, path), json dumps and copies write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        _write_bytes_to_fd(fd, data, label)
    finally:
        os.close(fd)
    point(label + ":written")


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def json_text(obj: Any) -> bytes:
    """transformers' JSON files: indent=2, sorted keys, trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def safetensors_bytes(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The safetensors layout (F32 tensors): 8-byte little-endian header length, compact JSON header with
    __metadata__ first and tensors by name, padded with spaces to a multiple of 8, then the raw data in the same
    order."""
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset, blobs = 0, []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        assert t.dtype == torch.float32, "only F32 is replayed"
        raw = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())  # no numpy needed
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def write_safetensors_like_0_8(path: str, data: bytes, label: str) -> None:
    """safetensors 0.8 writes `.tmpXXXXXX` (0600, O_EXCL) in the target's directory and renames it over the
    target: the final name is either absent or complete; a kill leaves the hidden temp file behind."""
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, ".tmp" + "".join(secrets.choice(string.ascii_letters + string.digits)
                                                 for _ in range(6)))
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        _write_bytes_to_fd(fd, data, label + ".tmp")
    finally:
        os.close(fd)
    point(label + ".tmp:written")
    os.rename(tmp, path)
    point(label + ":renamed")


def _rmtree_like_shutil(path: str, label: str) -> None:
    """shutil.rmtree's order: the entries in directory order, then the directory."""
    with os.scandir(path) as it:
        names = [e.name for e in it]
    for name in names:
        os.unlink(os.path.join(path, name))
        point("%s/%s:deleted" % (label, name))
    os.rmdir(path)
    point(label + ":rmdir")


def _adam_state(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], step: int, amsgrad: bool = False
                ) -> dict:
    """optimizer.state_dict() as after `step` steps: the real group layout, Adam moments of the right shapes."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(p),
                       "exp_avg_sq": torch.zeros_like(p)} for i, p in enumerate(params)}
    return sd


# ---- Hugging Face Trainer (transformers 5.17) -------------------------------------------------------------------

HF_FILES_IN_ORDER = ("config.json", "generation_config.json", "model.safetensors", "training_args.bin",
                     "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")
HF_LAST_FILE = "trainer_state.json"
HF_N_EMBD, HF_N_LAYER, HF_VOCAB, HF_POSITIONS = 32, 2, 128, 16


def hf_config(size_scale: int = 1) -> Tuple[dict, dict]:
    """config.json and generation_config.json of tests/trainers/hf_trainer.py's tiny GPT-2."""
    vocab = HF_VOCAB * size_scale
    config = {
        "activation_function": "gelu_new", "add_cross_attention": False, "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1, "bos_token_id": HF_VOCAB - 1, "dtype": "float32", "embd_pdrop": 0.1,
        "eos_token_id": HF_VOCAB - 1, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2",
        "n_embd": HF_N_EMBD, "n_head": 2, "n_inner": None, "n_layer": HF_N_LAYER, "n_positions": HF_POSITIONS,
        "pad_token_id": None, "reorder_and_upcast_attn": False, "resid_pdrop": 0.1,
        "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "tie_word_embeddings": True, "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": False, "vocab_size": vocab,
    }
    generation = {"_from_model_config": True, "bos_token_id": HF_VOCAB - 1, "eos_token_id": HF_VOCAB - 1,
                  "output_attentions": False, "output_hidden_states": False,
                  "transformers_version": TRANSFORMERS_VERSION, "use_cache": True}
    return config, generation


def hf_parameters(size_scale: int = 1) -> List[Tuple[str, Tuple[int, ...]]]:
    """GPT2LMHeadModel.named_parameters() of the tiny model (lm_head is tied to wte and not listed)."""
    e = HF_N_EMBD
    out: List[Tuple[str, Tuple[int, ...]]] = [("transformer.wte.weight", (HF_VOCAB * size_scale, e)),
                                              ("transformer.wpe.weight", (HF_POSITIONS, e))]
    for i in range(HF_N_LAYER):
        p = "transformer.h.%d." % i
        out += [(p + "ln_1.weight", (e,)), (p + "ln_1.bias", (e,)), (p + "attn.c_attn.weight", (e, 3 * e)),
                (p + "attn.c_attn.bias", (3 * e,)), (p + "attn.c_proj.weight", (e, e)), (p + "attn.c_proj.bias", (e,)),
                (p + "ln_2.weight", (e,)), (p + "ln_2.bias", (e,)), (p + "mlp.c_fc.weight", (e, 4 * e)),
                (p + "mlp.c_fc.bias", (4 * e,)), (p + "mlp.c_proj.weight", (4 * e, e)), (p + "mlp.c_proj.bias", (e,))]
    return [*out, ("transformer.ln_f.weight", (e,)), ("transformer.ln_f.bias", (e,))]


def hf_trainer_state(step: int, max_steps: int, save_steps: int, train_batch_size: int = 4) -> dict:
    history = [{"epoch": s / 16, "grad_norm": 1.0, "learning_rate": 1e-3 * (1 - (s - 1) / max_steps),
                "loss": 4.5, "step": s} for s in range(1, step + 1)]
    return {
        "best_global_step": None, "best_metric": None, "best_model_checkpoint": None, "epoch": step / 16,
        "eval_steps": 500, "global_step": step, "is_hyper_param_search": False, "is_local_process_zero": True,
        "is_world_process_zero": True, "log_history": history, "logging_steps": 1, "max_steps": max_steps,
        "num_input_tokens_seen": 0, "num_train_epochs": max(1, -(-max_steps // 16)), "save_steps": save_steps,
        "stateful_callbacks": {"TrainerControl": {"args": {
            "should_epoch_stop": False, "should_evaluate": False, "should_log": False, "should_save": True,
            "should_training_stop": step >= max_steps}, "attributes": {}}},
        "total_flos": 9781248.0 * step, "train_batch_size": train_batch_size, "trial_name": None,
        "trial_params": None,
    }


def _hf_states(step: int, max_steps: int, size_scale: int) -> Tuple[Dict[str, torch.Tensor], dict, dict]:
    named = [(n, torch.zeros(shape)) for n, shape in hf_parameters(size_scale)]
    decay = [t for n, t in named if t.dim() >= 2]
    no_decay = [t for n, t in named if t.dim() < 2]
    lr0 = 1e-3
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr0, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 1.0])
    lr = lr0 * max(0.0, 1 - step / max_steps)
    opt_sd = _adam_state(opt, decay + no_decay, step)
    for group in opt_sd["param_groups"]:
        group["lr"] = lr
    sched_sd = sched.state_dict()
    sched_sd.update(last_epoch=step, _step_count=step + 1, _last_lr=[lr, lr], _is_initial=False)
    return dict(named), opt_sd, sched_sd


def _rng_state() -> dict:
    state: Dict[str, Any] = {"python": random.getstate()}
    try:
        import numpy as np
    except ImportError:  # the trainers extra brings numpy; without it the key is left out
        pass
    else:
        state["numpy"] = np.random.get_state()
    state["cpu"] = torch.random.get_rng_state()
    return state


def write_hf_checkpoint(out_dir: str, step: int, size_scale: int = 1, max_steps: int = 1000, save_steps: int = 5,
                        save_total_limit: Optional[int] = None) -> str:
    """One Trainer._save_checkpoint: out_dir/checkpoint-<step>/ with the 8 files in the Trainer's order (model
    files, training_args.bin, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json LAST), then the
    rotation of old checkpoints beyond save_total_limit. Returns the checkpoint dir."""
    name = "checkpoint-%d" % step
    ckpt = os.path.join(out_dir, name)
    os.makedirs(ckpt, exist_ok=True)
    point(name + ":mkdir")
    config, generation = hf_config(size_scale)
    tensors, opt_sd, sched_sd = _hf_states(step, max_steps, size_scale)
    write_in_place(os.path.join(ckpt, "config.json"), json_text(config), name + "/config.json")
    write_in_place(os.path.join(ckpt, "generation_config.json"), json_text(generation),
                   name + "/generation_config.json")
    write_safetensors_like_0_8(os.path.join(ckpt, "model.safetensors"),
                               safetensors_bytes(tensors, {"format": "pt"}), name + "/model.safetensors")
    args = {"output_dir": out_dir, "max_steps": max_steps, "save_steps": save_steps,
            "save_total_limit": save_total_limit, "replayed_by": "tests.trainers.patterns"}
    for fname, obj in (("training_args.bin", args), ("optimizer.pt", opt_sd), ("scheduler.pt", sched_sd),
                       ("rng_state.pth", _rng_state())):
        write_in_place(os.path.join(ckpt, fname), torch_bytes(obj), "%s/%s" % (name, fname))
    write_in_place(os.path.join(ckpt, HF_LAST_FILE), json_text(hf_trainer_state(step, max_steps, save_steps)),
                   "%s/%s" % (name, HF_LAST_FILE))
    if save_total_limit:
        rotate_hf_checkpoints(out_dir, save_total_limit)
    return ckpt


def rotate_hf_checkpoints(out_dir: str, save_total_limit: int) -> None:
    """The Trainer's rotation: keep the newest save_total_limit checkpoint-N dirs, delete the oldest first. The
    Trainer orders by mtime but falls back to the step number when the mtimes span under a second; this orders
    by step number (the same order for any trainer that saves in step order)."""
    found = []
    for entry in os.listdir(out_dir):
        if entry.startswith("checkpoint-") and entry[11:].isdigit() and os.path.isdir(os.path.join(out_dir, entry)):
            found.append((int(entry[11:]), entry))
    found.sort()
    for _, entry in found[:max(0, len(found) - save_total_limit)]:
        _rmtree_like_shutil(os.path.join(out_dir, entry), entry)


# ---- nanoGPT (train.py contract; tests/trainers/nanogpt.py's model) ----------------------------------------------

NANOGPT_FILE = "ckpt.pt"


def write_nanogpt_ckpt(out_dir: str, iter_num: int, size_scale: int = 1, best_val_loss: float = 4.17) -> str:
    """nanoGPT's save: torch.save({'model','optimizer','model_args','iter_num','best_val_loss','config'},
    out_dir/ckpt.pt) IN PLACE (the old file is truncated first, no temp, no rename)."""
    n_layer, n_embd, block, vocab = 2, 32, 16, 65 * size_scale
    model: Dict[str, torch.Tensor] = {"wte.weight": torch.zeros(vocab, n_embd), "wpe.weight": torch.zeros(block, n_embd)}
    for i in range(n_layer):
        p = "h.%d." % i
        model.update({p + "ln_1.weight": torch.ones(n_embd), p + "attn.in_proj_weight": torch.zeros(3 * n_embd, n_embd),
                      p + "attn.out_proj.weight": torch.zeros(n_embd, n_embd), p + "ln_2.weight": torch.ones(n_embd),
                      p + "mlp.0.weight": torch.zeros(4 * n_embd, n_embd),
                      p + "mlp.2.weight": torch.zeros(n_embd, 4 * n_embd)})
    model["ln_f.weight"] = torch.ones(n_embd)
    model["lm_head.weight"] = model["wte.weight"]  # tied: one storage in the file, as nanoGPT's
    params = [t for k, t in model.items() if k != "lm_head.weight"]
    decay, no_decay = [t for t in params if t.dim() >= 2], [t for t in params if t.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95))
    model_args = dict(n_layer=n_layer, n_head=2, n_embd=n_embd, block_size=block, bias=False, vocab_size=vocab,
                      dropout=0.0)
    config = {"out_dir": out_dir, "eval_interval": 5, "log_interval": 1, "eval_iters": 2, "eval_only": False,
              "always_save_checkpoint": True, "init_from": "scratch", "max_iters": iter_num,
              "learning_rate": 1e-3, "batch_size": 4, "block_size": block, "n_layer": n_layer, "n_head": 2,
              "n_embd": n_embd, "dropout": 0.0, "bias": False, "device": "cpu", "dtype": "float32"}
    checkpoint = {"model": model, "optimizer": _adam_state(opt, decay + no_decay, iter_num),
                  "model_args": model_args, "iter_num": iter_num, "best_val_loss": torch.tensor(best_val_loss),
                  "config": config}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, NANOGPT_FILE)
    write_in_place(path, torch_bytes(checkpoint), NANOGPT_FILE)
    return path


# ---- Lightning (2.6.6, ModelCheckpoint(every_n_train_steps=K, save_last=True)) ----------------------------------

LIGHTNING_BATCHES_PER_EPOCH = 16  # tests/trainers/lightning_trainer.py: 64 samples, batch 4


def _progress(total: int, current: int, keys: Sequence[str]) -> dict:
    return {"total": {k: total for k in keys}, "current": {k: current for k in keys}}


def lightning_checkpoint(global_step: int, dirpath: str, filename: str, every: int = 5, size_scale: int = 1,
                         batches_per_epoch: int = LIGHTNING_BATCHES_PER_EPOCH) -> dict:
    """The dict Lightning 2.6.6 saves mid-epoch for tests/trainers/lightning_trainer.py's module (AdamW, StepLR
    stepped per epoch, one ModelCheckpoint), with the loop counters of a save at optimizer step global_step."""
    epoch, within = divmod(global_step, batches_per_epoch)
    last_batch = within == 0 and global_step > 0
    if last_batch:
        epoch, within = epoch - 1, batches_per_epoch
    vocab = 64 * size_scale
    state = {"emb.weight": torch.zeros(vocab, 32), "head.weight": torch.zeros(64, 32), "head.bias": torch.zeros(64)}
    params = list(state.values())
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    sched_sd = sched.state_dict()
    sched_sd.update(last_epoch=epoch, _step_count=epoch + 1, _last_lr=[1e-3 * 0.1 ** (epoch // 10)],
                    _is_initial=False)
    batch = _progress(global_step, within, ("ready", "completed", "started", "processed"))
    batch["total"]["completed"] -= 1
    batch["current"]["completed"] -= 1
    batch["is_last_batch"] = last_batch
    zeros4 = _progress(0, 0, ("ready", "completed", "started", "processed"))
    epoch_progress = _progress(epoch + 1, epoch + 1, ("ready", "completed", "started", "processed"))
    for part in ("total", "current"):
        epoch_progress[part].update(completed=epoch, processed=epoch)
    fit_loop = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": global_step - 1},
        "epoch_loop.batch_progress": batch,
        "epoch_loop.scheduler_progress": _progress(0, 0, ("ready", "completed")),
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {
            "step": _progress(global_step, within, ("ready", "completed")),
            "zero_grad": _progress(global_step, within, ("ready", "completed", "started"))}},
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": _progress(0, 0, ("ready", "completed")),
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": dict(zeros4, is_last_batch=False),
        "epoch_progress": epoch_progress,
    }
    loops = {"fit_loop": fit_loop,
             "validate_loop": {"state_dict": {}, "batch_progress": dict(zeros4, is_last_batch=False)},
             "test_loop": {"state_dict": {}, "batch_progress": dict(zeros4, is_last_batch=False)},
             "predict_loop": {"state_dict": {}, "batch_progress": zeros4}}
    key = ("ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': %d, 'every_n_epochs': 0, "
           "'train_time_interval': None}" % every)
    callback = {"monitor": None, "best_model_score": None, "best_model_path": os.path.join(dirpath, filename),
                "current_score": None, "dirpath": dirpath, "best_k_models": {}, "kth_best_model_path": "",
                "kth_value": torch.tensor(float("inf")), "last_model_path": os.path.join(dirpath, "last.ckpt")}
    return {"epoch": epoch, "global_step": global_step, "pytorch-lightning_version": LIGHTNING_VERSION,
            "state_dict": state, "loops": loops, "callbacks": {key: callback},
            "optimizer_states": [_adam_state(opt, params, global_step)], "lr_schedulers": [sched_sd]}


def lightning_filename(global_step: int, batches_per_epoch: int = LIGHTNING_BATCHES_PER_EPOCH) -> str:
    epoch = (global_step - 1) // batches_per_epoch if global_step else 0
    return "epoch=%d-step=%d.ckpt" % (epoch, global_step)


def write_lightning_ckpt(path: str, checkpoint: dict, tmpdir: Optional[str] = None) -> str:
    """Lightning's _atomic_save through fsspec's local transaction: torch.save into memory, the bytes into a
    tempfile.mkstemp() file in the TEMP dir (not beside the target), then shutil.move over the target: a rename
    when both are on one filesystem, else a copy onto the target (truncated first) and an unlink of the temp."""
    label = os.path.basename(path)
    data = torch_bytes(checkpoint)
    point(label + ":dumped")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=tmpdir)
    os.close(fd)
    write_in_place(tmp, data, label + ".tmp")
    try:
        os.rename(tmp, path)
        point(label + ":renamed")
    except OSError as e:
        if e.errno != 18:  # EXDEV: shutil.move falls back to copy2 + unlink
            raise
        write_in_place(path, data, label + ":copy")
        os.unlink(tmp)
        point(label + ".tmp:unlinked")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return path


def write_lightning_save(dirpath: str, global_step: int, every: int = 5, size_scale: int = 1,
                         tmpdir: Optional[str] = None) -> Tuple[str, str]:
    """One ModelCheckpoint save with save_last=True: epoch=E-step=S.ckpt, then last.ckpt (a second full write)."""
    dirpath = os.path.abspath(dirpath)
    name = lightning_filename(global_step)
    ckpt = lightning_checkpoint(global_step, dirpath, name, every, size_scale)
    first = write_lightning_ckpt(os.path.join(dirpath, name), ckpt, tmpdir)
    last = write_lightning_ckpt(os.path.join(dirpath, "last.ckpt"), ckpt, tmpdir)
    return first, last


# ---- a plain torch loop (tests/trainers/plain_loop.py) ----------------------------------------------------------

def write_plain(path: str, step: int, size_scale: int = 1) -> str:
    """torch.save({'step', 'model', 'optimizer'}, path) straight to the final name."""
    model = {"0.weight": torch.zeros(64 * size_scale, 16), "0.bias": torch.zeros(64 * size_scale),
             "2.weight": torch.zeros(1, 64 * size_scale), "2.bias": torch.zeros(1)}
    params = list(model.values())
    opt = torch.optim.Adam(params, lr=1e-2)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_in_place(path, torch_bytes({"step": step, "model": model, "optimizer": _adam_state(opt, params, step)}),
                   os.path.basename(path))
    return path
