"""A nanoGPT-style GPT trainer in one file (written by `onbox init nanogpt`), ready for a box you rent.

    python train.py [--config training_config.yaml] [--key=value ...]    # here, in the foreground
    ./train.sh [--key=value ...]                                         # under `onbox run`: detached, committed

The knobs keep nanoGPT's names (n_layer, n_head, n_embd, block_size, learning_rate, max_iters, warmup_iters,
lr_decay_iters, min_lr, eval_interval, eval_iters, gradient_accumulation_steps, out_dir, init_from). Data: the
token files nanoGPT's prepare scripts write (`data_dir`/train.bin and val.bin, uint16), or synthetic tokens when
`data_dir` is empty (a smoke test). What onbox adds:
- `out_dir`/ckpt.pt is written ATOMICALLY (temp name, fsync, rename, fsync the dir): nanoGPT rewrites it in place,
  so a kill mid-save destroys the only checkpoint. It holds the full state: model, optimizer, LR scheduler, the
  GradScaler, every RNG, iter_num, best_val_loss, the config;
- resume from $ONBOX_RESUME_FROM (onbox puts the newest verified copy back at `out_dir`/ckpt.pt), or from
  `out_dir`/ckpt.pt with --init_from=resume as in nanoGPT;
- SIGTERM/SIGUSR1: checkpoint at the next iteration boundary, exit 75;
- bf16/fp16/fp32 by hardware, gradient clipping, a cosine schedule with warm-up, JSON log lines.
"""
from __future__ import annotations

import math
import os
import sys

import onbox_trainkit as kit

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULTS = {
    # I/O
    "out_dir": "out",
    "init_from": "scratch",  # 'scratch' or 'resume' (from out_dir/ckpt.pt); $ONBOX_RESUME_FROM wins when set
    "eval_interval": 100,
    "log_interval": 10,
    "eval_iters": 4,
    "always_save_checkpoint": True,  # else only when the val loss improved
    # data
    "data_dir": "",  # a dir with train.bin/val.bin (uint16 token ids, nanoGPT's format); empty: synthetic
    "gradient_accumulation_steps": 1,
    "batch_size": 8,
    "block_size": 64,
    # model
    "vocab_size": 65,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "dropout": 0.0,
    "bias": False,
    # AdamW and the schedule
    "learning_rate": 0.001,
    "max_iters": 2000,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "warmup_iters": 50,
    "lr_decay_iters": 2000,  # the cosine ends here (nanoGPT: ~= max_iters)
    "min_lr": 0.0001,
    # system
    "precision": "auto",  # auto: bf16 where the GPU has it, fp16 + GradScaler on older GPUs, fp32 on CPU
    "seed": 1337,
    "threads": 0,
    "deterministic": False,
}


def build_model(torch, cfg):
    nn, F = torch.nn, torch.nn.functional

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(cfg["n_embd"], 3 * cfg["n_embd"], bias=cfg["bias"])
            self.proj = nn.Linear(cfg["n_embd"], cfg["n_embd"], bias=cfg["bias"])
            self.drop = nn.Dropout(cfg["dropout"])

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=2)
            shape = (b, t, cfg["n_head"], c // cfg["n_head"])
            q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=cfg["dropout"] if self.training else 0.0)
            return self.drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(cfg["n_embd"], bias=cfg["bias"])
            self.attn = SelfAttention()
            self.ln2 = nn.LayerNorm(cfg["n_embd"], bias=cfg["bias"])
            self.mlp = nn.Sequential(nn.Linear(cfg["n_embd"], 4 * cfg["n_embd"], bias=cfg["bias"]), nn.GELU(),
                                     nn.Linear(4 * cfg["n_embd"], cfg["n_embd"], bias=cfg["bias"]),
                                     nn.Dropout(cfg["dropout"]))

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
            self.pos = nn.Embedding(cfg["block_size"], cfg["n_embd"])
            self.drop = nn.Dropout(cfg["dropout"])
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["n_layer"]))
            self.ln_f = nn.LayerNorm(cfg["n_embd"], bias=cfg["bias"])
            self.head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)
            self.head.weight = self.tok.weight  # weight tying, as in GPT-2
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    # residual projections scaled down with depth (GPT-2)
                    std = 0.02 / math.sqrt(2 * cfg["n_layer"]) if name.endswith(("proj.weight", "mlp.2.weight")) \
                        else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

        def forward(self, idx, targets=None):
            t = idx.shape[1]
            x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            if targets is None:
                return logits, None
            return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    return GPT()


def make_get_batch(torch, cfg, device, gen):
    """get_batch(split) -> (x, y): nanoGPT's memmapped token files, or synthetic tokens without a data_dir."""
    bs, block = cfg["batch_size"], cfg["block_size"]
    if not cfg["data_dir"]:
        def synthetic_batch(split, g=None):
            # a learnable stream for a smoke test: random starts, then each token follows from the one before
            cols = [torch.randint(cfg["vocab_size"], (bs,), generator=g or gen)]
            for _ in range(block):
                cols.append((5 * cols[-1] + 3) % cfg["vocab_size"])
            x = torch.stack(cols, dim=1)
            return x[:, :-1].to(device), x[:, 1:].to(device)
        return synthetic_batch
    import numpy as np

    def file_batch(split, g=None):
        # a fresh memmap per batch, as nanoGPT does: a long-lived one grows resident memory
        data = np.memmap(os.path.join(cfg["data_dir"], "%s.bin" % split), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block - 1, (bs,), generator=g or gen)
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix.tolist()])
        return x.to(device), y.to(device)
    return file_batch


def main() -> int:
    cfg = kit.config_or_exit(DEFAULTS, os.path.join(HERE, "training_config.yaml"))
    import torch

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])  # U40: onbox already caps threads to the container's CPU quota
    kit.seed_everything(torch, cfg["seed"], cfg["deterministic"])
    device = kit.pick_device(torch)
    precision = kit.pick_precision(torch, device, cfg["precision"])
    out_dir = kit.checkpoint_dir(cfg["out_dir"])
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    stop = kit.StopFlag().install()

    gen = torch.Generator().manual_seed(cfg["seed"])
    get_batch = make_get_batch(torch, cfg, device, gen)
    model = build_model(torch, cfg).to(device)
    opt = torch.optim.AdamW(kit.split_params(model), lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"],
                            betas=(cfg["beta1"], cfg["beta2"]))
    sched = kit.cosine_scheduler(torch, opt, cfg["learning_rate"], cfg["warmup_iters"], cfg["lr_decay_iters"],
                                 cfg["min_lr"])
    scaler = kit.grad_scaler(torch, device, precision)
    iter_num, best_val_loss = 0, 1e9

    resume = kit.resume_path(ckpt_path if cfg["init_from"] == "resume" else None)
    if resume:
        ckpt = kit.load_training_state(torch, resume, device, model, opt, sched, scaler, {"data": gen})
        iter_num, best_val_loss = int(ckpt["iter_num"]), float(ckpt["best_val_loss"])
        kit.log(event="resumed", step=iter_num, path=resume)
    kit.log(event="start", step=iter_num, device=device, precision=precision, config=cfg,
            params=sum(p.numel() for p in model.parameters()))
    saved = [iter_num if resume else -1]

    def save(reason: str) -> None:
        if saved[0] == iter_num:
            return
        kit.atomic_torch_save(torch, dict(
            kit.training_state(torch, model, opt, sched, scaler, {"data": gen}), iter_num=iter_num,
            best_val_loss=best_val_loss, model_args={k: cfg[k] for k in (
                "n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")}, config=cfg),
            ckpt_path)
        saved[0] = iter_num
        kit.log(event="checkpoint", step=iter_num, path=ckpt_path, reason=reason)

    def estimate_loss():
        model.eval()
        out = {}
        with torch.no_grad(), kit.autocast(torch, device, precision):
            for split in ("train", "val"):
                g = torch.Generator().manual_seed(cfg["seed"] + (1 if split == "train" else 2))
                out[split] = sum(float(model(*get_batch(split, g))[1]) for _ in range(cfg["eval_iters"])) \
                    / cfg["eval_iters"]
        model.train()
        return out

    meter = kit.Throughput()
    accum = cfg["gradient_accumulation_steps"]
    model.train()
    while iter_num < cfg["max_iters"]:
        if stop.requested():  # the signal handler only set a flag: act here, between iterations
            save("signal %s" % stop.reason())
            kit.log(event="stopped", step=iter_num, reason=stop.reason())
            return kit.EXIT_PREEMPTED
        lr = sched.get_last_lr()[0]
        for _ in range(accum):
            x, y = get_batch("train")
            with kit.autocast(torch, device, precision):
                _logits, loss = model(x, y)
            scaler.scale(loss / accum).backward()
            meter.add(x.numel())
        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        iter_num += 1
        if iter_num % cfg["log_interval"] == 0:
            kit.log(step=iter_num, loss=loss.item(), lr=lr, tokens_per_s=meter.rate())
        if iter_num % cfg["eval_interval"] == 0:
            losses = estimate_loss()
            kit.log(step=iter_num, train_loss_est=losses["train"], eval_loss=losses["val"])
            if losses["val"] < best_val_loss or cfg["always_save_checkpoint"]:
                best_val_loss = min(best_val_loss, losses["val"])
                save("eval")
    save("final")
    kit.log(event="done", step=iter_num)
    return 0


if __name__ == "__main__":
    sys.exit(kit.finish(main()))
