"""A tiny pure-Python trainer for the curriculum tests (no torch): what a phase-aware trainer does.

Each step it prints one JSON line `{"step": N, "loss": ..., "eval_loss": E, "lr": ONBOX_PHASE_LR}` and checkpoints
(slurm_trainer.save: step_<N>.ckpt written atomically plus a `.done` marker); it resumes from $ONBOX_RESUME_FROM
and never stops by itself, so onbox has to end each phase at its target (the checkpoint signal: it saves the step
it is in and exits 0). At start it appends what it was given to $PHASE_RECORD, one JSON line: the phase, its
target and LR, the step it starts from and the checkpoint handed over. `--eval-loss E` is the eval loss it
reports (so a test chooses whether a phase's criterion holds).
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
    ap.add_argument("--eval-loss", type=float, required=True)
    ap.add_argument("--interval", type=float, default=0.03)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt_dir, exist_ok=True)
    resume = os.environ.get("ONBOX_RESUME_FROM", "")
    start = int(load(resume)["step"]) if resume else 0
    with open(os.environ["PHASE_RECORD"], "a") as f:
        f.write(json.dumps({"phase": os.environ.get("ONBOX_PHASE"), "index": os.environ.get("ONBOX_PHASE_INDEX"),
                            "target": os.environ.get("ONBOX_PHASE_TARGET_STEPS"),
                            "lr": os.environ.get("ONBOX_PHASE_LR"), "mix": os.environ.get("DATA_MIX"),
                            "start_step": os.environ.get("ONBOX_PHASE_START_STEP"), "resumed_at": start,
                            "resume_from": resume, "argv": sys.argv[1:]}) + "\n")
    lr = float(os.environ.get("ONBOX_PHASE_LR") or 0.001)
    step = start
    while True:
        t_end = time.monotonic() + a.interval
        while time.monotonic() < t_end and not stop:
            time.sleep(0.005)
        step += 1
        print(json.dumps({"step": step, "loss": round(4.0 / (1 + step), 4), "eval_loss": a.eval_loss, "lr": lr}),
              flush=True)
        save(ckpt_dir, step)
        if stop:
            print("checkpoint signal: saved step %d, exiting" % step, flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())
