"""A real trainer for the hang tests (CPU torch). Under torchrun (gloo) every step all-reduces a tensor across the
ranks, so one rank SIGSTOPped leaves the others blocked in `all_reduce`, as an NCCL hang does on GPUs; alone it
trains by itself. Rank 0 prints one JSON line a step ({"step", "loss", "attempt", "start", "t"}), saves
`step_<N>.pt` every --save-every steps (torch.save to a temp name, renamed; --save-seconds spreads the write over
that long, chunk by chunk, as a big checkpoint does) and resumes from ONBOX_RESUME_FROM on every rank. Options:

  --workers N      each step takes its batch from a DataLoader with N worker processes (a stopped worker hangs it)
  --eval-every K   every K steps print `eval` and stay silent for --eval-seconds (no step, no output), then print
                   the eval loss
  --faulthandler   opt in to onbox's stack dumps: SIGUSR2 dumps every thread into $ONBOX_STACKS_DIR/<pid>.txt
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time

import torch


class Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10 ** 9

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i % 7))


def save(path: str, state: dict, seconds: float) -> None:
    tmp = path + ".tmp"
    torch.save(state, tmp)
    if seconds > 0:  # the same bytes again, written slowly: a big checkpoint on a slow disk
        with open(tmp, "rb") as f:
            data = f.read()
        chunks = max(1, int(seconds / 0.1))
        with open(tmp, "wb") as f:
            for k in range(chunks):
                f.write(data[k * len(data) // chunks:(k + 1) * len(data) // chunks])
                f.flush()
                time.sleep(seconds / chunks)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--sleep", type=float, default=0.2)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--save-seconds", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--eval-seconds", type=float, default=0.0)
    ap.add_argument("--faulthandler", action="store_true")
    a = ap.parse_args()
    if a.faulthandler and os.environ.get("ONBOX_STACKS_DIR"):
        dump = open(os.path.join(os.environ["ONBOX_STACKS_DIR"], "%d.txt" % os.getpid()), "w")  # noqa: SIM115 (open for good)
        faulthandler.register(signal.SIGUSR2, file=dump, all_threads=True)
    dist = None
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist else 0
    start = 0
    resume = os.environ.get("ONBOX_RESUME_FROM")
    if resume:
        start = int(torch.load(resume, weights_only=True)["step"]) + 1
    attempt = int(os.environ.get("ONBOX_RESTART_COUNT") or 0)
    print(json.dumps({"event": "start", "rank": rank, "start": start, "attempt": attempt, "pid": os.getpid(),
                      "resume": resume or None}), flush=True)
    batches = iter(torch.utils.data.DataLoader(Batches(), batch_size=2, num_workers=a.workers,
                                               persistent_workers=a.workers > 0)) if a.workers else None
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    w = torch.zeros(4)
    for step in range(start, a.steps):
        grad = next(batches).sum(0) if batches is not None else torch.ones(4)
        if dist:
            dist.all_reduce(grad)
        w += grad
        if rank == 0:
            print(json.dumps({"step": step, "loss": round(1.0 / (1.0 + float(w.sum())), 6), "attempt": attempt,
                              "start": start, "t": time.time()}), flush=True)
            if step % a.save_every == 0:
                save(os.path.join(ckpt_dir, "step_%05d.pt" % step), {"step": step, "w": w.clone()}, a.save_seconds)
        if a.eval_every and step % a.eval_every == a.eval_every - 1:
            if rank == 0:
                print("eval", flush=True)
            time.sleep(a.eval_seconds)
            if rank == 0:
                print(json.dumps({"eval_loss": 0.5, "t": time.time()}), flush=True)
        time.sleep(a.sleep)
    if dist:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
