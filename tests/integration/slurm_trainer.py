"""A tiny pure-Python stand-in trainer for the Slurm tests (no torch).

Prints `step N` each step and writes a checkpoint after every step, atomically (tmp name, fsync, rename, then a
`.done` marker): $ONBOX_CKPT_DIR/step_<N>.ckpt holding {"step": N} in torch's legacy format (pickles only, no
tensors: torch.load reads it, and onbox's format checks accept it). Resumes from $ONBOX_RESUME_FROM. On SIGTERM
(the agent's checkpoint signal) it finishes the step it is in, checkpoints it, says so and exits 0.
Options: --steps N, --interval S, --crash-at K (exit 1 at step K: a failure of its own),
--workers W (DataLoader-style workers: each a grandchild reparented to init that ignores SIGTERM; their PIDs go to
$TRAINER_WORKER_PIDS).
"""
from __future__ import annotations

import argparse
import os
import pickle
import signal
import subprocess
import sys
import time

stop = []


# what torch.save(..., _use_new_zipfile_serialization=False) writes before the object: magic number, protocol
# version, sys_info; after it, the (here empty) list of storage keys
LEGACY_HEADER = (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": sys.byteorder == "little",
                                               "type_sizes": {"short": 2, "int": 4, "long": 4}})


def load(path: str) -> dict:
    with open(path, "rb") as f:
        for _ in LEGACY_HEADER:
            pickle.load(f)
        return pickle.load(f)


def save(ckpt_dir: str, step: int) -> None:
    final = os.path.join(ckpt_dir, "step_%06d.ckpt" % step)
    tmp = final + ".tmp"
    with open(tmp, "wb") as f:
        for obj in (*LEGACY_HEADER, {"step": step, "time": time.time()}, []):
            pickle.dump(obj, f, protocol=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    open(final + ".done", "w").close()
    for name in sorted(os.listdir(ckpt_dir)):  # keep the newest two, like a trainer's own retention
        if name.startswith("step_") and name.endswith(".ckpt") and name < "step_%06d.ckpt" % (step - 1):
            for p in (name, name + ".done"):
                try:
                    os.unlink(os.path.join(ckpt_dir, p))
                except FileNotFoundError:
                    pass


WORKER = r"""
import os, signal, sys, time
if os.fork() == 0:          # the grandchild: reparented to init when its parent exits (escapes linuxproc)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(sys.argv[1], "a") as f:
        f.write("%d\n" % os.getpid())
    while True:
        time.sleep(1)
os._exit(0)
"""


def spawn_workers(n: int) -> None:
    pids_file = os.environ.get("TRAINER_WORKER_PIDS", os.path.join(os.environ.get("ONBOX_CKPT_DIR", "."), "w"))
    for _ in range(n):
        subprocess.run([sys.executable, "-c", WORKER, pids_file], check=True, timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(_read_pids(pids_file)) < n:
        time.sleep(0.02)
    print("workers started: %s" % _read_pids(pids_file), flush=True)


def _read_pids(path: str) -> list:
    try:
        with open(path) as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--crash-at", type=int, default=0)
    ap.add_argument("--workers", type=int, default=0)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    ckpt_dir = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt_dir, exist_ok=True)
    start = 0
    resume = os.environ.get("ONBOX_RESUME_FROM", "")
    if resume:
        start = int(load(resume)["step"])
        print("resumed from step %d (%s)" % (start, resume), flush=True)
    else:
        print("fresh start", flush=True)
    print("trainer pid %d, SLURM_RESTART_COUNT=%s" % (os.getpid(), os.environ.get("SLURM_RESTART_COUNT", "<absent>")),
          flush=True)
    if a.workers:
        spawn_workers(a.workers)
    for step in range(start + 1, a.steps + 1):
        t_end = time.monotonic() + a.interval
        while time.monotonic() < t_end and not stop:
            time.sleep(min(0.02, a.interval))
        if a.crash_at and step == a.crash_at:
            print("RuntimeError: the trainer's own bug at step %d" % step, flush=True)
            return 1
        print("step %d" % step, flush=True)
        save(ckpt_dir, step)
        if stop:
            print("checkpoint signal: saved step %d, exiting" % step, flush=True)
            return 0
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
