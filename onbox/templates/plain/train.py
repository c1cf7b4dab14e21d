"""A minimal PyTorch training loop that survives preemption (written by `onbox init plain`).

    python train.py [--config training_config.yaml] [--key=value ...]    # here, in the foreground
    ./train.sh [--key=value ...]                                         # under `onbox run`: detached, committed

Replace build_model(), get_batch() and the loss with your own; the rest stays: cosine LR with warm-up, gradient
clipping, bf16/fp16/fp32 by hardware, seeds, one JSON log line per report, full-state atomic checkpoints
(model, optimizer, scheduler, scaler, RNG, step) into $ONBOX_CKPT_DIR, resume from $ONBOX_RESUME_FROM, and
SIGTERM/SIGUSR1 -> checkpoint at the next step boundary -> exit 75.
The knobs are in training_config.yaml (DEFAULTS below lists them; a key not listed there is refused).
"""
from __future__ import annotations

import os
import sys

import onbox_trainkit as kit

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULTS = {
    "seed": 1337,
    "max_steps": 2000,
    "batch_size": 32,
    "seq_len": 32,
    "vocab_size": 64,
    "d_model": 64,
    "lr": 0.003,
    "min_lr": 0.0003,
    "warmup_steps": 50,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "precision": "auto",
    "log_interval": 10,
    "eval_interval": 100,
    "eval_batches": 4,
    "save_interval": 100,
    "keep_local": 3,
    "out_dir": "checkpoints",
    "threads": 0,
    "deterministic": False,
}


def build_model(torch, cfg):
    """Your model here. The toy: embed each token, one hidden layer, predict a token."""
    nn = torch.nn
    return nn.Sequential(nn.Embedding(cfg["vocab_size"], cfg["d_model"]), nn.Linear(cfg["d_model"], cfg["d_model"]),
                         nn.GELU(), nn.Linear(cfg["d_model"], cfg["vocab_size"]))


def get_batch(torch, cfg, gen, device):
    """Your data here. The toy task: for each random token t, predict (3t + 1) mod vocab_size."""
    x = torch.randint(cfg["vocab_size"], (cfg["batch_size"], cfg["seq_len"]), generator=gen)
    y = (3 * x + 1) % cfg["vocab_size"]
    return x.to(device), y.to(device)


def main() -> int:
    cfg = kit.config_or_exit(DEFAULTS, os.path.join(HERE, "training_config.yaml"))
    import torch
    import torch.nn.functional as F

    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])  # U40: onbox already caps threads to the container's CPU quota
    kit.seed_everything(torch, cfg["seed"], cfg["deterministic"])
    device = kit.pick_device(torch)
    precision = kit.pick_precision(torch, device, cfg["precision"])
    ckpt_dir = kit.checkpoint_dir(cfg["out_dir"])
    stop = kit.StopFlag().install()

    model = build_model(torch, cfg).to(device)
    opt = torch.optim.AdamW(kit.split_params(model), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = kit.cosine_scheduler(torch, opt, cfg["lr"], cfg["warmup_steps"], cfg["max_steps"], cfg["min_lr"])
    scaler = kit.grad_scaler(torch, device, precision)
    data_gen = torch.Generator().manual_seed(cfg["seed"])
    step = 0

    resume = kit.resume_path()
    if resume:
        state = kit.load_training_state(torch, resume, device, model, opt, sched, scaler, {"data": data_gen})
        step = int(state["step"])
        kit.log(event="resumed", step=step, path=resume)
    kit.log(event="start", step=step, device=device, precision=precision, config=cfg,
            params=sum(p.numel() for p in model.parameters()))
    saved = [step if resume else -1]

    def save(reason: str) -> None:
        if saved[0] == step:
            return
        path = os.path.join(ckpt_dir, "step_%08d.pt" % step)
        kit.atomic_torch_save(torch, dict(kit.training_state(torch, model, opt, sched, scaler, {"data": data_gen}),
                                          step=step, config=cfg), path)
        saved[0] = step
        kit.prune(os.path.join(ckpt_dir, "step_*.pt"), cfg["keep_local"])
        kit.log(event="checkpoint", step=step, path=path, reason=reason)

    def evaluate() -> float:
        model.eval()
        gen = torch.Generator().manual_seed(cfg["seed"] + 1)  # the same held-out batches every time
        total = 0.0
        with torch.no_grad(), kit.autocast(torch, device, precision):
            for _ in range(cfg["eval_batches"]):
                x, y = get_batch(torch, cfg, gen, device)
                total += float(F.cross_entropy(model(x).float().view(-1, cfg["vocab_size"]), y.view(-1)))
        model.train()
        return total / cfg["eval_batches"]

    meter = kit.Throughput()
    model.train()
    while step < cfg["max_steps"]:
        if stop.requested():  # the signal handler only set a flag: act here, between steps
            save("signal %s" % stop.reason())
            kit.log(event="stopped", step=step, reason=stop.reason())
            return kit.EXIT_PREEMPTED
        x, y = get_batch(torch, cfg, data_gen, device)
        with kit.autocast(torch, device, precision):
            loss = F.cross_entropy(model(x).float().view(-1, cfg["vocab_size"]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        scaler.step(opt)
        scaler.update()
        lr = sched.get_last_lr()[0]  # the rate this step used
        sched.step()
        step += 1
        meter.add(x.numel())
        if step % cfg["log_interval"] == 0:
            kit.log(step=step, loss=loss.item(), lr=lr, tokens_per_s=meter.rate())
        if step % cfg["eval_interval"] == 0:
            kit.log(step=step, eval_loss=evaluate())
        if step % cfg["save_interval"] == 0:
            save("periodic")
    save("final")
    kit.log(event="done", step=step)
    return 0


if __name__ == "__main__":
    sys.exit(kit.finish(main()))
