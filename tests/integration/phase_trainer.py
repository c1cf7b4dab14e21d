"""A tiny pure-Python trainer for the curriculum and queue tests (no torch): what a phase-aware trainer does.

Each step it prints one JSON line `{"step": N, "loss": ..., "eval_loss": E, "lr": ONBOX_PHASE_LR}` and checkpoints
(slurm_trainer.save: step_<N>.ckpt written atomically plus a `.done` marker); it resumes from $ONBOX_RESUME_FROM.
Without --steps it never stops by itself, so onbox has to end each phase at its target (the checkpoint signal: it
saves the step it is in and exits 0). At start it appends what it was given to $PHASE_RECORD (when set), one JSON
line: the phase, its target and LR, the step it starts from and the checkpoint handed over. `--eval-loss E` is the
eval loss it reports (so a test chooses whether a phase's criterion holds); `--steps N` ends it at step N;
`--hold PATH --hold-at K` makes it wait at step K while PATH exists (a test decides when it may go on).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from tests.integration.slurm_trainer import load, save

stop: list = []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eval-loss", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--hold", default="")
    ap.add_argument("--hold-at", type=int, default=0)
    ap.add_argument("--interval", type=float, default=0.02)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt_dir, exist_ok=True)
    resume = os.environ.get("ONBOX_RESUME_FROM", "")
    start = int(load(resume)["step"]) if resume else 0
    print("resumed from step %d" % start if resume else "fresh start", flush=True)
    with open(os.environ.get("PHASE_RECORD") or os.devnull, "a") as f:
        f.write(json.dumps({"phase": os.environ.get("ONBOX_PHASE"), "index": os.environ.get("ONBOX_PHASE_INDEX"),
                            "target": os.environ.get("ONBOX_PHASE_TARGET_STEPS"),
                            "lr": os.environ.get("ONBOX_PHASE_LR"), "mix": os.environ.get("DATA_MIX"),
                            "start_step": os.environ.get("ONBOX_PHASE_START_STEP"), "resumed_at": start,
                            "resume_from": resume, "argv": sys.argv[1:]}) + "\n")
    lr = float(os.environ.get("ONBOX_PHASE_LR") or 0.001)
    step = start
    while not a.steps or step < a.steps:
        t_end = time.monotonic() + a.interval
        while (time.monotonic() < t_end or (a.hold and step == a.hold_at and os.path.exists(a.hold))) and not stop:
            time.sleep(0.005)
        step += 1
        print(json.dumps({"step": step, "loss": round(4.0 / (1 + step), 4), "eval_loss": a.eval_loss, "lr": lr}),
              flush=True)
        save(ckpt_dir, step)
        if stop:
            print("checkpoint signal: saved step %d, exiting" % step, flush=True)
            return 0
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
