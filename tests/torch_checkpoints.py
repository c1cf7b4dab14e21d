"""Real torch.save checkpoints in the shapes trainers write them (torch imported lazily: callers importorskip it).

- nanoGPT's ckpt.pt: {model, optimizer (AdamW, stepped), model_args, iter_num, best_val_loss, config}, with the
  parameter names and shapes of its GPT (tied lm_head/wte);
- Lightning's .ckpt: the top-level dict its Trainer writes (global_step, epoch, state_dict, loops, callbacks,
  optimizer_states, lr_schedulers, pytorch-lightning_version), saved through a buffer as Lightning does, so the
  zip's top dir is "archive/";
- a plain loop's dict, and any of them in the legacy (pre-1.6) pickle format.
"""
from __future__ import annotations

import collections
import io
import os
from typing import Any, Dict


def nanogpt_checkpoint(iter_num: int = 60, n_layer: int = 2, n_embd: int = 32, vocab: int = 65,
                       block: int = 64) -> Dict[str, Any]:
    import torch

    sd: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
    sd["transformer.wte.weight"] = torch.randn(vocab, n_embd)
    sd["transformer.wpe.weight"] = torch.randn(block, n_embd)
    for i in range(n_layer):
        p = "transformer.h.%d." % i
        sd[p + "ln_1.weight"] = torch.ones(n_embd)
        sd[p + "attn.c_attn.weight"] = torch.randn(3 * n_embd, n_embd)
        sd[p + "attn.c_proj.weight"] = torch.randn(n_embd, n_embd)
        sd[p + "ln_2.weight"] = torch.ones(n_embd)
        sd[p + "mlp.c_fc.weight"] = torch.randn(4 * n_embd, n_embd)
        sd[p + "mlp.c_proj.weight"] = torch.randn(n_embd, 4 * n_embd)
    sd["transformer.ln_f.weight"] = torch.ones(n_embd)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # weight tying: one storage, two names
    params = [torch.nn.Parameter(v) for k, v in sd.items() if k != "lm_head.weight"]
    opt = torch.optim.AdamW(params, lr=6e-4)
    sum((p * p).sum() for p in params).backward()
    opt.step()
    return {"model": sd, "optimizer": opt.state_dict(),
            "model_args": dict(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block, bias=False,
                               vocab_size=vocab, dropout=0.0),
            "iter_num": iter_num, "best_val_loss": torch.tensor(1.4697),
            "config": {"out_dir": "out", "eval_interval": 20, "learning_rate": 6e-4, "max_iters": 5000,
                       "dataset": "shakespeare_char", "init_from": "scratch"}}


def lightning_checkpoint(global_step: int = 5, epoch: int = 0) -> Dict[str, Any]:
    import torch

    lin = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    progress = {"total": {"ready": global_step, "completed": global_step}, "current": {"ready": 0, "completed": 0}}
    return {"epoch": epoch, "global_step": global_step, "pytorch-lightning_version": "2.6.6",
            "state_dict": collections.OrderedDict(("l." + k, v) for k, v in lin.state_dict().items()),
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": progress,
                                   "epoch_loop.batch_progress": progress}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "last_model_path": ""}},
            "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()]}


def save(obj: Any, path: str, legacy: bool = False, via_buffer: bool = False) -> str:
    """torch.save `obj` to `path`: the zip format (its top dir named after the file, or "archive/" with
    `via_buffer`, as Lightning's fsspec writes do), or the legacy pickle format."""
    import torch

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if via_buffer:
        buf = io.BytesIO()
        torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
        with open(path, "wb") as f:
            f.write(buf.getvalue())
    else:
        torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return path
