"""A minimal stand-in for nanoGPT's train.py with the same checkpoint contract, CPU only, seconds per run.

What is the same as nanoGPT (train.py at karpathy/nanoGPT master):
  * configurator-style overrides `--key=value` (literal_eval'd, type must match the default, "Overriding: k = v");
  * `out_dir` (default 'out'), `init_from='scratch'|'resume'`, `max_iters`, `eval_interval`, `eval_iters`,
    `log_interval`, `always_save_checkpoint` (default True);
  * every eval_interval iterations: `step N: train loss X, val loss Y`, then when the val loss improved or
    always_save_checkpoint, and iter_num > 0: `saving checkpoint to {out_dir}` and
    torch.save({'model','optimizer','model_args','iter_num','best_val_loss','config'}, out_dir/ckpt.pt),
    written IN PLACE (no temp file, no rename);
  * resume reads exactly out_dir/ckpt.pt with torch.load(map_location=device) and nothing else: a missing, empty
    or torn file fails with torch's own exception and a traceback (nanoGPT has no error handling there), exit 1;
    training continues at the checkpoint's iter_num, so the first thing a resumed run does is evaluate and
    rewrite ckpt.pt in place at that same iter_num;
  * the loop ends once iter_num > max_iters, so the last save holds iter_num == max_iters (when divisible);
  * `iter N: loss X, time Yms, mfu Z%` every log_interval (mfu -100.00% for the first 5 iterations of a process);
  * no signal handling at all: SIGTERM and SIGINT take their default action.
What differs: a 2-layer toy GPT (torch.nn only), random token data (vocab 65, like shakespeare_char) instead of
memmapped .bin files, no DDP/compile/autocast/GradScaler, and the test seams of harness.py.

Die-at points (ONBOX_TEST_DIE_AT, see harness.py):
  before-save  after printing "saving checkpoint to", before torch.save touches ckpt.pt (old file intact)
  truncated    inside torch.save, right after ckpt.pt was opened (O_TRUNC) and before any byte: a 0-byte ckpt.pt
  during-save  inside torch.save after ONBOX_TEST_DIE_RECORDS tensor records: a torn zip without central directory
  after-save   right after torch.save returned (a complete ckpt.pt)
"""
from __future__ import annotations

import math
import os
import sys
import time
from ast import literal_eval

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

harness.offline()
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

DIE_POINTS = ("before-save", "truncated", "during-save", "after-save")

# ---- defaults (same names as nanoGPT; sizes for a CPU test) --------------------------------------------------
out_dir = "out"
eval_interval = 5
log_interval = 1
eval_iters = 2
eval_only = False
always_save_checkpoint = True
init_from = "scratch"
dataset = "random"
gradient_accumulation_steps = 1
batch_size = 4
block_size = 16
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
bias = False
learning_rate = 1e-3
max_iters = 20
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 5
lr_decay_iters = 100
min_lr = 1e-4
device = "cpu"
dtype = "float32"
compile = False
seed = 1337


def _configure(argv: list) -> dict:
    """nanoGPT's configurator contract: only --key=value, the key must exist, the type must match."""
    g = globals()
    keys = [k for k, v in g.items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))
            and k not in ("DIE_POINTS",)]
    for arg in argv:
        if arg in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        if "=" not in arg or not arg.startswith("--"):
            raise ValueError(f"expected --key=value, got {arg!r} (config files are not supported here)")
        key, val = arg[2:].split("=", 1)
        if key not in keys:
            raise ValueError(f"Unknown config key: {key}")
        try:
            value = literal_eval(val)
        except (SyntaxError, ValueError):
            value = val
        assert type(value) == type(g[key]), f"{key}: {type(value).__name__} given, {type(g[key]).__name__} expected"  # noqa: E721
        print(f"Overriding: {key} = {value}")
        g[key] = value
    return {k: g[k] for k in keys}


# ---- model --------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = nn.MultiheadAttention(n_embd, n_head, bias=bias, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=bias), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, bias: bool, vocab_size: int,
                 dropout: float) -> None:
        super().__init__()
        self.n_layer, self.n_head, self.n_embd, self.block_size = n_layer, n_head, n_embd, block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        ballast = harness.ballast_numel()
        if ballast:
            self.register_buffer("ballast", torch.zeros(ballast))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        pos = torch.arange(idx.size(1))
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def configure_optimizers(self, wd: float, lr: float, betas: tuple) -> torch.optim.Optimizer:
        # nanoGPT's two groups: weight decay on >=2-D tensors only.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float) -> float:
        n, q = self.num_params(), self.n_embd // self.n_head
        flops_per_iter = (6 * n + 12 * self.n_layer * self.n_head * q * self.block_size) * self.block_size \
            * fwdbwd_per_iter
        return flops_per_iter / dt / 312e12  # against an A100's bf16 peak, as nanoGPT


def main(argv: list) -> int:
    config = _configure(argv)
    die_at = harness.DieAt(DIE_POINTS)
    os.makedirs(out_dir, exist_ok=True)
    harness.install_trace(out_dir)
    torch.manual_seed(seed)
    vocab = 65
    data = {"train": torch.randint(vocab, (4096,), generator=torch.Generator().manual_seed(0)),
            "val": torch.randint(vocab, (1024,), generator=torch.Generator().manual_seed(1))}
    print(f"tokens per iteration will be: {gradient_accumulation_steps * batch_size * block_size:,}")
    print(f"found vocab_size = {vocab} (inside random data)")

    def get_batch(split: str):
        d = data[split]
        ix = torch.randint(len(d) - block_size, (batch_size,))
        return (torch.stack([d[i:i + block_size] for i in ix]), torch.stack([d[i + 1:i + 1 + block_size] for i in ix]))

    iter_num, best_val_loss = 0, 1e9
    model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                      vocab_size=None, dropout=dropout)
    checkpoint = None
    if init_from == "scratch":
        print("Initializing a new model from scratch")
        model_args["vocab_size"] = vocab
        model = GPT(**model_args)
    elif init_from == "resume":
        print(f"Resuming training from {out_dir}")
        ckpt_path = os.path.join(out_dir, "ckpt.pt")
        checkpoint = torch.load(ckpt_path, map_location=device)
        for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"):
            model_args[k] = checkpoint["model_args"][k]
        model = GPT(**model_args)
        state_dict = checkpoint["model"]
        for k in list(state_dict):
            if k.startswith("_orig_mod."):
                state_dict[k[len("_orig_mod."):]] = state_dict.pop(k)
        model.load_state_dict(state_dict)
        iter_num = checkpoint["iter_num"]
        best_val_loss = checkpoint["best_val_loss"]
    else:
        raise ValueError(f"init_from={init_from!r}: only 'scratch' and 'resume' here (no downloads)")
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
    if init_from == "resume":
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None

    @torch.no_grad()
    def estimate_loss() -> dict:
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                x, y = get_batch(split)
                losses[k] = model(x, y)[1].item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it: int) -> float:
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    x, y = get_batch("train")
    t0 = time.time()
    local_iter_num, running_mfu = 0, -1.0
    while True:
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss or always_save_checkpoint:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    checkpoint = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "model_args": model_args,
                        "iter_num": iter_num,
                        "best_val_loss": best_val_loss,
                        "config": config,
                    }
                    print(f"saving checkpoint to {out_dir}")
                    die_at.reached("before-save")
                    _save(checkpoint, os.path.join(out_dir, "ckpt.pt"), die_at)
                    die_at.reached("after-save")
        if iter_num == 0 and eval_only:
            break
        for _ in range(gradient_accumulation_steps):
            _, loss = model(x, y)
            loss = loss / gradient_accumulation_steps
            x, y = get_batch("train")
            loss.backward()
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % log_interval == 0:
            lossf = loss.item() * gradient_accumulation_steps
            if local_iter_num >= 5:
                mfu = model.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.2f}%")
        iter_num += 1
        local_iter_num += 1
        if iter_num > max_iters:
            break
    return 0


def _save(checkpoint: dict, path: str, die_at: harness.DieAt) -> None:
    """nanoGPT's `torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))`; the die-at points inside it wrap
    the real writer (harness.dying_torch_save)."""
    for point, records in (("truncated", None), ("during-save", die_at.records)):
        if die_at.arrive(point):
            with harness.dying_torch_save(point, records):
                torch.save(checkpoint, path)
            return
    torch.save(checkpoint, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
