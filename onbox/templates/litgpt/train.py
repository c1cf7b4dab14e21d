"""LitGPT-style pretraining with plain torch (written by `onbox init litgpt`), ready for a box you rent.

    python train.py [--config training_config.yaml] [--key=value ...] [--resume=PATH|auto]
    ./train.sh [--key=value ...]                     # under `onbox run`: detached, committed, resumed

It follows `litgpt pretrain`'s conventions without needing litgpt: the knobs keep LitGPT's names
(`model_config.n_layer`, `train.micro_batch_size`, `train.lr_warmup_steps`, `train.save_interval`,
`eval.interval`, `optimizer.lr` ... as flat dotted keys, the way LitGPT's command line spells them), the model
keeps LitGPT's module names (transformer.wte, transformer.h.N.attn.qkv, lm_head), checkpoints go where LitGPT
puts them (`out_dir`/step-00000100/lit_model.pth with model_config.yaml beside it), the schedule is LitGPT's
(linear warm-up, cosine to `train.min_lr`), and `--resume` takes a checkpoint or `auto` as LitGPT's does.
What onbox adds: each step-N dir appears whole (written under a hidden name, fsynced, renamed) with the full
state (model, optimizer, scheduler, GradScaler, RNG, iter_num, step_count); $ONBOX_RESUME_FROM; SIGTERM/SIGUSR1
-> checkpoint at the next optimizer step -> exit 75; bf16/fp16/fp32 by hardware; JSON log lines.
(litgpt itself is not used: its releases pin huggingface_hub below what current transformers needs, so one
environment rarely holds both; with litgpt installed, `litgpt pretrain ... --resume auto` runs under onbox too.)
"""
from __future__ import annotations

import glob
import math
import os
import sys

import onbox_trainkit as kit

HERE = os.path.dirname(os.path.abspath(__file__))
MARKER = "COMPLETE"  # inside a finished step dir: onbox's "complete" marker, so it commits without waiting

DEFAULTS = {
    "model_name": "tiny-gpt",
    "model_config.block_size": 64,
    "model_config.vocab_size": 128,
    "model_config.n_layer": 2,
    "model_config.n_head": 2,
    "model_config.n_embd": 64,
    "model_config.rotary_percentage": 1.0,
    "model_config.parallel_residual": True,
    "model_config.norm_class_name": "LayerNorm",
    "model_config.bias": True,
    "out_dir": "out/pretrain",
    "precision": "auto",
    "seed": 42,
    "resume": None,
    "data.train_bin": "",
    "data.val_bin": "",
    "train.global_batch_size": 16,
    "train.micro_batch_size": 8,
    "train.max_steps": 2000,
    "train.lr_warmup_steps": 50,
    "train.save_interval": 100,
    "train.log_interval": 10,
    "train.max_norm": 1.0,
    "train.min_lr": 0.00004,
    "eval.interval": 100,
    "eval.max_iters": 4,
    "optimizer.lr": 0.0004,
    "optimizer.weight_decay": 0.1,
    "optimizer.betas": [0.9, 0.95],
    "keep_local": 3,
    "threads": 0,
}
PRECISIONS = {"auto": "auto", "bf16-mixed": "bf16", "bf16-true": "bf16", "bf16": "bf16", "16-mixed": "fp16",
              "16-true": "fp16", "fp16": "fp16", "32-true": "fp32", "fp32": "fp32"}


def model_config(cfg):
    return {k.split(".", 1)[1]: v for k, v in cfg.items() if k.startswith("model_config.")}


def build_model(torch, mc):
    nn, F = torch.nn, torch.nn.functional
    head_size = mc["n_embd"] // mc["n_head"]
    rope_dims = int(mc["rotary_percentage"] * head_size) // 2 * 2

    def norm():
        if mc["norm_class_name"] == "RMSNorm":
            return nn.RMSNorm(mc["n_embd"], eps=1e-5)
        return nn.LayerNorm(mc["n_embd"], eps=1e-5)

    def rope(x, cos, sin):
        if rope_dims == 0:
            return x
        r, rest = x[..., :rope_dims], x[..., rope_dims:]
        half = rope_dims // 2
        rotated = torch.cat((-r[..., half:], r[..., :half]), dim=-1)
        return torch.cat((r * cos + rotated * sin, rest), dim=-1)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(mc["n_embd"], 3 * mc["n_embd"], bias=mc["bias"])
            self.proj = nn.Linear(mc["n_embd"], mc["n_embd"], bias=mc["bias"])

        def forward(self, x, cos, sin):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, mc["n_head"], head_size).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class GptNeoxMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(mc["n_embd"], 4 * mc["n_embd"], bias=mc["bias"])
            self.proj = nn.Linear(4 * mc["n_embd"], mc["n_embd"], bias=mc["bias"])

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_1, self.attn = norm(), CausalSelfAttention()
            self.norm_2, self.mlp = norm(), GptNeoxMLP()

        def forward(self, x, cos, sin):
            h = self.attn(self.norm_1(x), cos, sin)
            if mc["parallel_residual"]:  # GPT-NeoX/Pythia: attention and MLP read the same input
                return x + h + self.mlp(self.norm_2(x))
            x = x + h
            return x + self.mlp(self.norm_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(mc["n_embd"], mc["vocab_size"], bias=False)
            self.transformer = nn.ModuleDict({"wte": nn.Embedding(mc["vocab_size"], mc["n_embd"]),
                                              "h": nn.ModuleList(Block() for _ in range(mc["n_layer"])),
                                              "ln_f": norm()})
            inv = 1.0 / (10000 ** (torch.arange(0, max(rope_dims, 2), 2).float() / max(rope_dims, 2)))
            angles = torch.outer(torch.arange(mc["block_size"]).float(), inv)
            self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=math.sqrt(2.0 / 5 / mc["n_embd"]))  # LitGPT's small init

        def forward(self, idx):
            t = idx.shape[1]
            cos, sin = self.cos[:t, :rope_dims], self.sin[:t, :rope_dims]
            x = self.transformer.wte(idx)
            for block in self.transformer.h:
                x = block(x, cos, sin)
            return self.lm_head(self.transformer.ln_f(x))

    return GPT()


def make_get_batch(torch, cfg, mc, device, gen):
    """(x, y) of micro_batch_size sequences: from a uint16 token file (`data.train_bin`, `data.val_bin`), or
    synthetic token streams (each token follows from the one before: a smoke test)."""
    bs, t, vocab = cfg["train.micro_batch_size"], mc["block_size"], mc["vocab_size"]

    def get_batch(split, g=None):
        path = cfg["data.train_bin"] if split == "train" else cfg["data.val_bin"]
        if path:
            import numpy as np

            data = np.memmap(path, dtype=np.uint16, mode="r")
            ix = torch.randint(len(data) - t - 1, (bs,), generator=g or gen).tolist()
            x = torch.stack([torch.from_numpy(data[i:i + t + 1].astype(np.int64)) for i in ix])
        else:
            cols = [torch.randint(vocab, (bs,), generator=g or gen)]
            for _ in range(t):
                cols.append((5 * cols[-1] + 3) % vocab)
            x = torch.stack(cols, dim=1)
        return x[:, :-1].to(device), x[:, 1:].to(device)

    return get_batch


def find_resume(cfg, out_dir):
    """LitGPT's --resume: a checkpoint file or step dir, or auto/true (the newest step-* here). onbox's
    $ONBOX_RESUME_FROM (a step dir it restored and verified) wins."""
    wanted = cfg["resume"]
    if wanted in (True, "auto", "true", "True"):
        steps = sorted(glob.glob(os.path.join(out_dir, "step-*", "lit_model.pth")))
        if not steps and wanted != "auto":
            raise SystemExit("resume: no step-*/lit_model.pth in %s" % out_dir)
        wanted = steps[-1] if steps else None
    path = kit.resume_path(wanted if isinstance(wanted, str) else None)
    if path and os.path.isdir(path):
        path = os.path.join(path, "lit_model.pth")
    return path


def main() -> int:
    cfg = kit.config_or_exit(DEFAULTS, os.path.join(HERE, "training_config.yaml"))
    import torch
    import torch.nn.functional as F

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])  # U40: onbox already caps threads to the container's CPU quota
    kit.seed_everything(torch, cfg["seed"])
    device = kit.pick_device(torch)
    if cfg["precision"] not in PRECISIONS:
        raise kit.bad_config("precision must be one of %s, not %r" % (", ".join(PRECISIONS), cfg["precision"]))
    precision = kit.pick_precision(torch, device, PRECISIONS[cfg["precision"]])
    out_dir = kit.checkpoint_dir(cfg["out_dir"])
    stop = kit.StopFlag().install()
    mc = model_config(cfg)
    accum = max(1, cfg["train.global_batch_size"] // cfg["train.micro_batch_size"])

    gen = torch.Generator().manual_seed(cfg["seed"])
    get_batch = make_get_batch(torch, cfg, mc, device, gen)
    model = build_model(torch, mc).to(device)
    opt = torch.optim.AdamW(kit.split_params(model), lr=cfg["optimizer.lr"], weight_decay=cfg["optimizer.weight_decay"],
                            betas=tuple(cfg["optimizer.betas"]))
    sched = kit.cosine_scheduler(torch, opt, cfg["optimizer.lr"], cfg["train.lr_warmup_steps"],
                                 cfg["train.max_steps"], cfg["train.min_lr"])
    scaler = kit.grad_scaler(torch, device, precision)
    state = {"iter_num": 0, "step_count": 0}

    resume = find_resume(cfg, out_dir)
    if resume:
        ckpt = kit.load_training_state(torch, resume, device, model, opt, sched, scaler, {"data": gen})
        state = {"iter_num": int(ckpt["iter_num"]), "step_count": int(ckpt["step_count"])}
        kit.log(event="resumed", step=state["step_count"], iter=state["iter_num"], path=resume)
    kit.log(event="start", step=state["step_count"], device=device, precision=precision, config=cfg,
            params=sum(p.numel() for p in model.parameters()))
    saved = [state["step_count"] if resume else -1]

    def save(reason: str) -> None:
        step = state["step_count"]
        if saved[0] == step:
            return
        name = "step-%08d" % step
        staging = os.path.join(out_dir, ".%s.partial" % name)  # a dot name: nobody resumes from it
        final = os.path.join(out_dir, name)
        if os.path.isdir(staging):
            import shutil

            shutil.rmtree(staging)
        os.makedirs(staging)
        torch.save(dict(kit.training_state(torch, model, opt, sched, scaler, {"data": gen}),
                        iter_num=state["iter_num"], step_count=step,
                        global_step=step),  # the optimizer step, where onbox reads a checkpoint's step
                   os.path.join(staging, "lit_model.pth"))
        kit.write_flat_yaml(os.path.join(staging, "model_config.yaml"), mc)
        kit.write_flat_yaml(os.path.join(staging, "hyperparameters.yaml"), cfg)
        open(os.path.join(staging, MARKER), "w").close()
        kit.publish_dir(staging, final)
        saved[0] = step
        kit.prune(os.path.join(out_dir, "step-*"), cfg["keep_local"])
        kit.log(event="checkpoint", step=step, path=final, reason=reason)

    def validate():
        model.eval()
        g = torch.Generator().manual_seed(cfg["seed"] + 1)
        total = 0.0
        with torch.no_grad(), kit.autocast(torch, device, precision):
            for _ in range(cfg["eval.max_iters"]):
                x, y = get_batch("val", g)
                total += float(F.cross_entropy(model(x).float().reshape(-1, mc["vocab_size"]), y.reshape(-1)))
        model.train()
        return total / cfg["eval.max_iters"]

    meter = kit.Throughput()
    model.train()
    while state["step_count"] < cfg["train.max_steps"]:
        if stop.requested():  # the signal handler only set a flag: act here, between optimizer steps
            save("signal %s" % stop.reason())
            kit.log(event="stopped", step=state["step_count"], reason=stop.reason())
            return kit.EXIT_PREEMPTED
        lr = sched.get_last_lr()[0]
        for _ in range(accum):
            x, y = get_batch("train")
            with kit.autocast(torch, device, precision):
                loss = F.cross_entropy(model(x).float().reshape(-1, mc["vocab_size"]), y.reshape(-1))
            scaler.scale(loss / accum).backward()
            state["iter_num"] += 1
            meter.add(x.numel())
        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["train.max_norm"])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        state["step_count"] += 1
        step = state["step_count"]
        if step % cfg["train.log_interval"] == 0:
            kit.log(step=step, iter=state["iter_num"], loss=loss.item(), lr=lr, tokens_per_s=meter.rate())
        if step % cfg["eval.interval"] == 0:
            kit.log(step=step, eval_loss=validate())
        if step % cfg["train.save_interval"] == 0:
            save("periodic")
    save("final")
    kit.log(event="done", step=state["step_count"])
    return 0


if __name__ == "__main__":
    sys.exit(kit.finish(main()))
