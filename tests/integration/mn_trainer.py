"""A real torchrun trainer for the multi-node tests (CPU, gloo): every step all-reduces the ranks' gradients and
a stop flag, so on SIGTERM every rank stops at the same step; rank 0 saves a full-state checkpoint (atomically:
temp file + rename) every --save-every steps and at the stop. It resumes from ONBOX_RESUME_FROM on every rank and
prints, per step, one JSON line with its rank, the step, the loss and the step it started from; at the start each
rank also prints the smallest and largest start step of all ranks (they must agree)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--sleep", type=float, default=0.1)
    # the ranks of the other nodes print no step (as trainers that log from rank 0 only): their agents' cadence can
    # never judge them, only node 0's word can
    ap.add_argument("--steps-on-node0-only", action="store_true")
    args = ap.parse_args()
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(4)
    start = 0
    resume = os.environ.get("ONBOX_RESUME_FROM")
    if resume:
        state = torch.load(resume, weights_only=True)
        w, start = state["w"], int(state["step"]) + 1
    lo, hi = torch.tensor([float(start)]), torch.tensor([float(start)])
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    print(json.dumps({"event": "start", "rank": rank, "world": world, "start": start, "min_start": int(lo.item()),
                      "max_start": int(hi.item()), "node": os.environ.get("NODE_RANK")}), flush=True)
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    for step in range(start, args.steps):
        grad = torch.full((4,), float(rank + 1))
        packet = torch.cat([grad, torch.tensor([1.0 if stop["flag"] else 0.0])])
        dist.all_reduce(packet)
        w += packet[:4] / world
        stopping = packet[4].item() > 0
        if not args.steps_on_node0_only or os.environ.get("NODE_RANK", "0") == "0":
            print(json.dumps({"rank": rank, "step": step, "loss": round(1.0 / (1.0 + float(w.sum())), 6),
                              "start": start}), flush=True)
        if rank == 0 and (stopping or step % args.save_every == 0 or step == args.steps - 1):
            path = os.path.join(ckpt_dir, "step_%05d.pt" % step)
            torch.save({"step": step, "w": w.clone()}, path + ".tmp")
            os.replace(path + ".tmp", path)
        if stopping:
            print(json.dumps({"event": "stopped", "rank": rank, "step": step}), flush=True)
            break
        time.sleep(args.sleep)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
