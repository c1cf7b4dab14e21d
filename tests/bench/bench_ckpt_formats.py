"""What the format checks and the step read cost on a ~100 MB nanoGPT-style ckpt.pt (6 layers, n_embd 384, with
its AdamW state), beside the baseline of reading the step the usual way: torch.load of the whole file.

- step_of_file: the central directory and data.pkl only (bytes read, from /proc/self/io rchar);
- check_file(full=False): what detection and restore pay per file (headers and ends only);
- check_file(full=True): what `onbox verify` pays (every CRC);
the same for the legacy pickle format. Page cache warm (the file was just written). Needs torch.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

MiB = 1024 * 1024


def _rchar() -> int:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar"))
    except OSError:
        return -1


def _measure(fn, n: int):
    fn()
    r0, t0 = _rchar(), time.perf_counter()
    for _ in range(n):
        res = fn()
    return (time.perf_counter() - t0) / n, (_rchar() - r0) / n, res


def main() -> int:
    try:
        import torch
    except ImportError:
        print("torch is not importable: skipped")
        return 0
    from onbox.checkpoints import formats
    from onbox.checkpoints.formats import stepread
    from tests.torch_checkpoints import nanogpt_checkpoint, save

    base = tempfile.mkdtemp(prefix="onbox-bench-formats-", dir=os.environ.get("ONBOX_BENCH_DIR", "/var/tmp"))
    missed = 0
    try:
        torch.manual_seed(0)
        ckpt = nanogpt_checkpoint(iter_num=250, n_layer=6, n_embd=384, vocab=65, block=256)
        for label, legacy in (("zip", False), ("legacy", True)):
            p = save(ckpt, os.path.join(base, "ckpt-%s.pt" % label), legacy=legacy)
            size = os.path.getsize(p)
            print("%s: %.1f MiB" % (p, size / MiB))
            t_load, b_load, _ = _measure(lambda p=p: torch.load(p, weights_only=True)["iter_num"], 3)
            rows = [("torch.load (baseline)", t_load, b_load, "")]
            for name, fn, n in (("step_of_file", lambda p=p: stepread.step_of_file(p), 50),
                                ("check_file full=False", lambda p=p: formats.check_file(p, False), 50),
                                ("check_file full=True", lambda p=p: formats.check_file(p, True), 3)):
                t, b, res = _measure(fn, n)
                rows.append((name, t, b, res))
            for name, t, b, res in rows:
                print("  %-24s %9.3f ms  %12.0f bytes read  %s" % (name, t * 1000, b, res))
            step_t, step_b = rows[1][1], rows[1][2]
            ok = rows[1][3] == stepread.StepReading(250, "%s:iter_num" % os.path.basename(p)) and step_b < size / 100
            print("  step read: %.0fx faster than torch.load, %.2f%% of the file read   %s" % (
                t_load / step_t, 100.0 * step_b / size, "ok" if ok else "MISSED"))
            missed += not ok
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
