"""A plain-Python trainer (the README's journey): its state is a JSON document saved every --save-every steps as
$ONBOX_CKPT_DIR/state_<step>.json, written under a temp name and renamed into place; it resumes from
$ONBOX_RESUME_FROM when onbox gives one."""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import seam


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.02)
    ap.add_argument("--name", default="state_%06d.json", help="the saves' name, %%d the step (the journey: .txt)")
    a = ap.parse_args()
    ckpt = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt, exist_ok=True)
    state = {"step": 0, "w": [0.0] * 64}
    resume = os.environ.get("ONBOX_RESUME_FROM")
    if resume:
        with open(resume) as f:
            state = json.load(f)
        seam.resumed(state["step"], resume)
    while state["step"] < a.steps:
        state["step"] += 1
        state["w"] = [w + 0.01 for w in state["w"]]
        seam.progress(state["step"], math.exp(-state["step"] / 50.0))
        if state["step"] % a.save_every == 0:
            final = os.path.join(ckpt, a.name % state["step"])
            data = json.dumps(state)
            with open(final + ".tmp", "w") as f:
                if seam.reached("own-save"):
                    f.write(data[:len(data) // 2])
                    f.flush()
                    seam.die("own-save")
                f.write(data)
            os.replace(final + ".tmp", final)
        time.sleep(a.sleep)


if __name__ == "__main__":
    main()
