"""A numpy trainer saving np.savez(ckpt_<step>.npz, ...) every --save-every steps, in place (np.savez writes the
zip at its final name); it resumes from $ONBOX_RESUME_FROM (np.load)."""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import seam


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.02)
    a = ap.parse_args()
    seam.install()
    ckpt = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt, exist_ok=True)
    rng = np.random.default_rng(0)
    w, step = rng.normal(size=(256, 256)), 0
    resume = os.environ.get("ONBOX_RESUME_FROM")
    if resume:
        with np.load(resume) as d:
            w, step = d["w"], int(d["step"])
        seam.resumed(step, resume)
    while step < a.steps:
        step += 1
        w = w * 0.999
        seam.progress(step, float(np.abs(w).mean()))
        if step % a.save_every == 0:
            np.savez(os.path.join(ckpt, "ckpt_%06d.npz" % step), w=w, step=np.array(step))
        time.sleep(a.sleep)


if __name__ == "__main__":
    main()
