"""charlm: a tiny character-level transformer trainer that follows onbox's contract. Use it as a template.

    python3 onbox.pyz run -- python -m onbox.examples.charlm --steps 300      (or: python charlm.py ...)

What it shows (the child's environment that `onbox run` sets up):
- checkpoints are FULL state (model, optimizer, LR scheduler, step, every RNG state) written atomically
  (tmp in the same dir -> flush -> fsync -> os.replace -> fsync dir) into $ONBOX_CKPT_DIR as step_<N>.pt;
- on start it resumes from $ONBOX_RESUME_FROM when set (a file, or a directory holding one);
- SIGTERM (or the appearance of $ONBOX_PREEMPT_FILE) means: finish the current step, checkpoint, exit 75;
- one JSON line per logged step (step, loss, lr, tokens_per_s) on stdout (flushed, U43) and appended to
  $ONBOX_METRICS_FILE;
- cosine LR with linear warm-up, gradient clipping, bf16/fp16 autocast where the hardware supports it, a seed.

Only torch is needed (the box's own torch: onbox never installs one, U28). Runs on CPU in seconds.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, Optional

EXIT_PREEMPTED = 75  # the same code onbox uses: "checkpointed, restart me"

CORPUS = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. The sun shone, having no alternative, on the "
    "nothing new. Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the "
    "watery part of the world. Happy families are all alike; every unhappy family is unhappy in its own way. "
)


class Stop:
    """Signal handlers only record; the loop acts at the next step boundary."""

    def __init__(self, preempt_file: str) -> None:
        self.preempt_file = preempt_file
        self.signum: Optional[int] = None

    def handler(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def requested(self) -> bool:
        return self.signum is not None or bool(self.preempt_file and os.path.exists(self.preempt_file))


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="charlm", description="Tiny char-level transformer; onbox example trainer.")
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block", type=int, default=64, help="context length in characters")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=3, help="local checkpoints kept (the newest are kept)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto")
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (demos, tests)")
    p.add_argument("--data", default=None, help="a text file to train on (default: a built-in corpus)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as set, U40)")
    return p.parse_args(argv)


def build_model(torch: Any, vocab: int, args: argparse.Namespace) -> Any:
    nn = torch.nn

    class CharLM(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, args.d_model)
            self.pos = nn.Embedding(args.block, args.d_model)
            layer = nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, vocab)

        def forward(self, idx: Any) -> Any:
            t = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
            return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))

    return CharLM()


def pick_precision(torch: Any, device: str, wanted: str) -> Optional[Any]:
    """The autocast dtype: bf16 where the hardware runs it natively, fp16 on older GPUs, else None (fp32)."""
    if wanted == "fp32":
        return None
    if device == "cuda":
        if wanted in ("auto", "bf16") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float16
    if wanted == "bf16":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if (wanted == "auto" and native) else None  # emulated bf16 on CPU is slower than fp32


def lr_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to the peak, then cosine decay to min-lr at the last step (a multiplier of --lr)."""
    if step < args.warmup:
        return (step + 1) / max(1, args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return (args.min_lr + (args.lr - args.min_lr) * cosine) / args.lr


def atomic_save(torch: Any, state: Dict[str, Any], path: str) -> None:
    """torch.save is not atomic: write a temp file, fsync, rename, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, ".%s.tmp-%d" % (os.path.basename(path), os.getpid()))
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_resume(path: str) -> Optional[str]:
    """ONBOX_RESUME_FROM may name a checkpoint file or a (committed) checkpoint directory holding one."""
    if not path:
        return None
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.pt")))
        return files[-1] if files else None
    return path if os.path.exists(path) else None


def prune(ckpt_dir: str, keep: int) -> None:
    files = sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt")))
    for old in files[:-keep] if keep > 0 else []:
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass


def emit(record: Dict[str, Any], metrics_file: str) -> None:
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if metrics_file:
        with open(metrics_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt_dir = os.environ.get("ONBOX_CKPT_DIR") or os.path.abspath("checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    metrics_file = os.environ.get("ONBOX_METRICS_FILE", "")
    stop = Stop(os.environ.get("ONBOX_PREEMPT_FILE", ""))
    signal.signal(signal.SIGTERM, stop.handler)
    signal.signal(signal.SIGINT, stop.handler)

    text = CORPUS * 8
    if args.data:
        with open(args.data, encoding="utf-8") as f:
            text = f.read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = build_model(torch, len(chars), args).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    amp_dtype = pick_precision(torch, device, args.precision)
    scaler = torch.amp.GradScaler(device, enabled=(amp_dtype == torch.float16))
    step = 0

    resume = find_resume(os.environ.get("ONBOX_RESUME_FROM", ""))
    if resume:
        state = torch.load(resume, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        step = int(state["step"])
        torch.set_rng_state(state["rng"]["torch"])
        gen.set_state(state["rng"]["data"])
        random.setstate(_as_random_state(state["rng"]["python"]))
        if device == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        emit({"event": "resumed", "from": resume, "step": step}, metrics_file)
    else:
        emit({"event": "start", "step": 0, "params": sum(p.numel() for p in model.parameters()),
              "precision": str(amp_dtype or "fp32"), "device": device}, metrics_file)

    def save(reason: str) -> str:
        path = os.path.join(ckpt_dir, "step_%06d.pt" % step)
        rng = {"torch": torch.get_rng_state(), "data": gen.get_state(), "python": list_state(random.getstate()),
               "cuda": torch.cuda.get_rng_state_all() if device == "cuda" else None}
        atomic_save(torch, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "step": step,
                            "rng": rng, "chars": "".join(chars), "args": vars(args)}, path)
        prune(ckpt_dir, args.keep)
        emit({"event": "checkpoint", "step": step, "path": path, "reason": reason}, metrics_file)
        return path

    model.train()
    t_last, tokens = time.monotonic(), 0
    while step < args.steps:
        if stop.requested():
            save("preempt")
            emit({"event": "preempted", "step": step}, metrics_file)
            return EXIT_PREEMPTED
        ix = torch.randint(len(data) - args.block - 1, (args.batch_size,), generator=gen)
        x = torch.stack([data[i:i + args.block] for i in ix]).to(device)
        y = torch.stack([data[i + 1:i + args.block + 1] for i in ix]).to(device)
        with torch.autocast(device_type=device, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, len(chars)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(opt)
        scaler.update()
        sched.step()
        step += 1
        tokens += x.numel()
        if args.step_delay:
            time.sleep(args.step_delay)
        if step % args.log_every == 0 or step == args.steps:
            now = time.monotonic()
            emit({"step": step, "loss": round(float(loss), 4), "lr": sched.get_last_lr()[0],
                  "tokens_per_s": round(tokens / max(now - t_last, 1e-9), 1)}, metrics_file)
            t_last, tokens = now, 0
        if step % args.ckpt_every == 0 and step < args.steps:
            save("periodic")
    save("final")
    emit({"event": "done", "step": step}, metrics_file)
    return 0


def list_state(state: Any) -> Any:
    """random.getstate() as nested lists (plain types load under torch.load(weights_only=True))."""
    return [list_state(s) if isinstance(s, tuple) else s for s in state]


def _as_random_state(state: Any) -> Any:
    return tuple(_as_random_state(s) if isinstance(s, list) else s for s in state)


if __name__ == "__main__":
    sys.exit(main())
