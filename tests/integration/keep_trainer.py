"""A pure-Python stand-in trainer for the keeper tests (no torch): one JSON metrics line per step, a checkpoint every
--save-every steps (atomically: tmp name, fsync, rename, then a `.done` marker) as `step_<N>.ckpt` holding {"step": N}
in torch's legacy format (pickles only: onbox's format checks accept it), resumed from $ONBOX_RESUME_FROM. On
SIGTERM (the agent's checkpoint signal) it saves the step it is in and exits 0; with --ignore-term it ignores it
(a trainer that never checkpoints on the signal: only SIGKILL ends it).

Every start is appended to --trace (a file every box shares) as one JSON line: the box ($ONBOX_BOX), the step it
starts from and the checkpoint it resumed, so a test sees where and from what the run went on. With
--trace-first-step, the first step each start trains is appended there too, once it is done ({"box", "first_step",
"time"}): the time a recovery ends, for the keeper's benchmark (tests/bench/bench_keeper.py).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slurm_trainer import load, save  # the same legacy-format checkpoint

stop = []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--trace-first-step", action="store_true")
    ap.add_argument("--ignore-term", action="store_true")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if a.ignore_term else (lambda s, f: stop.append(s)))
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt_dir, exist_ok=True)
    resume = os.environ.get("ONBOX_RESUME_FROM", "")
    start = int(load(resume)["step"]) if resume else 0
    with open(a.trace, "a") as f:
        f.write(json.dumps({"box": os.environ.get("ONBOX_BOX"), "start": start, "resume": resume or None,
                            "pid": os.getpid(), "time": time.time()}) + "\n")
    for step in range(start + 1, a.steps + 1):
        t_end = time.monotonic() + a.interval
        while time.monotonic() < t_end and not stop:
            time.sleep(min(0.02, a.interval))
        print(json.dumps({"step": step, "loss": round(1.0 / step, 6)}), flush=True)
        if a.trace_first_step and step == start + 1:
            with open(a.trace, "a") as f:
                f.write(json.dumps({"box": os.environ.get("ONBOX_BOX"), "first_step": step, "time": time.time()})
                        + "\n")
        if stop or step % a.save_every == 0 or step == a.steps:
            save(ckpt_dir, step)
        if stop:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
