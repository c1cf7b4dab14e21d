"""A plain-Python trainer for the container tests (no torch: it runs once per attempt). It saves a directory
checkpoint `ckpt-<step>/` (state.json and a DONE marker, renamed into place) every other step and when SIGTERM
asks it to stop; it resumes from ONBOX_RESUME_FROM. `--ignore-term`: a trainer that never reacts to TERM (only
KILL ends it). `--hold DIR`: it opens DIR/nvidia0, DIR/nvidiactl and DIR/nvidia-uvm (stand-in device files) and
keeps them open, as a CUDA process holds the GPU. At start it prints its pid, the step it starts from, the names of
its environment and the sha256 of HF_TOKEN (never the value)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time


def save(ckpt_dir: str, step: int) -> None:
    tmp = os.path.join(ckpt_dir, "tmp-ckpt-%05d" % step)
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"step": step}, f)
    open(os.path.join(tmp, "DONE"), "w").close()
    os.rename(tmp, os.path.join(ckpt_dir, "ckpt-%05d" % step))


def main() -> int:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 20
    stop = {"flag": False}
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    held = []
    if "--hold" in sys.argv:
        where = sys.argv[sys.argv.index("--hold") + 1]
        held = [os.open(os.path.join(where, name), os.O_RDONLY) for name in ("nvidia0", "nvidiactl", "nvidia-uvm")]
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    start = 0
    if os.environ.get("ONBOX_RESUME_FROM"):
        with open(os.path.join(os.environ["ONBOX_RESUME_FROM"], "state.json")) as f:
            start = json.load(f)["step"] + 1
    token = os.environ.get("HF_TOKEN")
    print(json.dumps({"event": "start", "pid": os.getpid(), "start": start, "env": sorted(os.environ),
                      "hf_token_sha256": hashlib.sha256(token.encode()).hexdigest() if token else None,
                      "held": len(held)}), flush=True)
    for step in range(start, steps):
        print(json.dumps({"step": step, "loss": round(1.0 / (1 + step), 4)}), flush=True)
        if stop["flag"] or step % 2 == 0 or step == steps - 1:
            save(ckpt_dir, step)
        if stop["flag"]:
            print(json.dumps({"event": "stopped", "step": step}), flush=True)
            return 0
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
