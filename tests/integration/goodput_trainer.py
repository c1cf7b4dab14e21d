"""A pure-Python stand-in trainer for the goodput scenarios (tests/integration/test_goodput_scenarios.py): one JSON
metrics line per step, a checkpoint every --save-every steps (keep_trainer.py's legacy-format `step_<N>.ckpt`,
atomically, with a `.done` marker), resumed from $ONBOX_RESUME_FROM. Every step it completes is appended to --trace
({"step", "time", "pid"}) and every start ({"start", "resume", "pid"}): the ground truth of what was trained, and
trained twice, that a ledger must add up to.

--crash-after K: exit 1 after K steps of each start, for the first --crashes starts (a crash loop: every later
start trains to the end). --ignore-term: SIGTERM is ignored (a trainer that never checkpoints on the notice: only
SIGKILL ends it, and the steps since its newest checkpoint are lost). Otherwise SIGTERM saves the step it is in and
exits 0.
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


def _trace(path: str, doc: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(doc) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--crash-after", type=int, default=0)
    ap.add_argument("--crashes", type=int, default=0)
    ap.add_argument("--ignore-term", action="store_true")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN if a.ignore_term else (lambda s, f: stop.append(s)))
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt_dir, exist_ok=True)
    resume = os.environ.get("ONBOX_RESUME_FROM", "")
    start = int(load(resume)["step"]) if resume else 0
    starts = 0
    if os.path.exists(a.trace):
        with open(a.trace) as f:
            starts = sum(1 for line in f if '"start"' in line)
    _trace(a.trace, {"start": start, "resume": resume or None, "pid": os.getpid(), "time": time.time()})
    crash_at = start + a.crash_after if a.crash_after and starts < a.crashes else None
    for step in range(start + 1, a.steps + 1):
        t_end = time.monotonic() + a.interval
        while time.monotonic() < t_end and not stop:
            time.sleep(min(0.01, a.interval))
        print(json.dumps({"step": step, "loss": round(1.0 / step, 6)}), flush=True)
        _trace(a.trace, {"step": step, "time": time.time(), "pid": os.getpid()})
        if stop or step % a.save_every == 0 or step == a.steps:
            save(ckpt_dir, step)
        if stop:
            return 0
        if crash_at is not None and step >= crash_at:
            print("goodput_trainer: crashing at step %d" % step, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
