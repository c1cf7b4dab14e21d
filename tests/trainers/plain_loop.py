"""A plain torch training loop that checkpoints the way many hand-written ones do, CPU only, seconds per run.

  python tests/trainers/plain_loop.py --ckpt_dir D --steps N --every K [--resume PATH]

Every K steps: torch.save({'step': s, 'model': model.state_dict(), 'optimizer': optimizer.state_dict()},
D/step_%05d.pt % s), straight to the final name (no temp file, no rename); nothing is ever deleted. `step` counts
completed optimizer steps, so a resumed run continues with step s+1. `--resume PATH` loads exactly PATH (torch's
own exception and exit 1 when it is missing, empty or torn). Log lines: `step N loss X`.

Die-at points (ONBOX_TEST_DIE_AT, see harness.py):
  before-save  nothing of this save on disk
  truncated    inside torch.save, right after step_%05d.pt was created, before any byte: a 0-byte file
  during-save  inside torch.save after ONBOX_TEST_DIE_RECORDS tensor records: a torn zip
  after-save   right after torch.save returned
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

harness.offline()
import torch  # noqa: E402
from torch import nn  # noqa: E402

DIE_POINTS = ("before-save", "truncated", "during-save", "after-save")


def main(argv: list) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--resume", default=None)
    args = p.parse_args(argv)
    die_at = harness.DieAt(DIE_POINTS)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    harness.install_trace(args.ckpt_dir)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    ballast = harness.ballast_numel()
    if ballast:
        model.register_buffer("ballast", torch.zeros(ballast))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start = ckpt["step"]
        print("resumed from %s at step %d" % (args.resume, start))
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True)
    for step in range(start + 1, args.steps + 1):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print("step %d loss %.4f" % (step, loss.item()), flush=True)
        if step % args.every == 0:
            path = os.path.join(args.ckpt_dir, "step_%05d.pt" % step)
            state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
            die_at.reached("before-save")
            for point, records in (("truncated", None), ("during-save", die_at.records)):
                if die_at.arrive(point):
                    with harness.dying_torch_save(point, records):
                        torch.save(state, path)
            torch.save(state, path)
            die_at.reached("after-save")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
