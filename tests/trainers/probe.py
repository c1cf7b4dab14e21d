"""Measurements behind README.md (not a test; minutes of CPU). Run from the repository root:

  python -m tests.trainers.probe resume-matrix [--only hf,nanogpt,lightning,plain]
      damage each file of a real checkpoint (missing / 0 bytes / first half) and run the REAL resume on it;
      prints the outcome next to what tests/trainers/resume.py predicts.
  python -m tests.trainers.probe kill-during-save [--trials N] [--signal TERM|KILL] [--mb MiB]
      start nanoGPT (tests/trainers/nanogpt.py) with a ballast, send the signal at a uniformly random moment of
      its second `torch.save` (timed from its own "saving checkpoint to" line), and classify what ckpt.pt holds.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Optional, Tuple

from tests.trainers import resume

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable


def _run(argv: List[str], timeout: float = 120, env: Optional[dict] = None) -> Tuple[int, str]:
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.run([PY, *argv], capture_output=True, text=True, timeout=timeout, env=full_env)
    return p.returncode, p.stdout + p.stderr


def _outcome(rc: int, out: str) -> str:
    if rc == 0:
        starts = [line for line in out.splitlines() if "train begins at global_step" in line
                  or line.startswith("resumed from") or line.startswith("step ")]
        return "ok (%s)" % (starts[0].strip() if starts else "?")
    errors = [line for line in out.splitlines() if line and not line.startswith(" ") and "Error" in line]
    return "rc=%d %s" % (rc, (errors[-1] if errors else out.strip().splitlines()[-1])[:110])


def _damage(path: str, how: str) -> None:
    if how == "missing":
        os.remove(path)
    else:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(0 if how == "empty" else size // 2)


def _matrix(name: str, make: Callable[[str], None], target: Callable[[str], str], files: List[str],
            resume_argv: Callable[[str], List[str]], predict: Callable[[str], resume.Resume]) -> None:
    base = tempfile.mkdtemp(prefix="probe-%s-" % name)
    make(base)
    print("\n## %s" % name)
    for fname in files:
        for how in ("missing", "empty", "half"):
            work = base + "-w"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(base, work, symlinks=True)
            _damage(os.path.join(target(work), fname), how)
            predicted = predict(target(work))
            rc, out = _run(resume_argv(work))
            print("| %s | %s | %s | %s |" % (fname, how, _outcome(rc, out),
                                            "ok" if predicted.ok else predicted.error[:60]))
            shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)


def resume_matrix(only: List[str]) -> None:
    t = os.path.join
    if "hf" in only:
        from tests.trainers.patterns import HF_FILES_IN_ORDER

        _matrix("hf", lambda d: _run([t(HERE, "hf_trainer.py"), "--output_dir", d, "--max_steps", "10",
                                      "--save_steps", "5"]),
                lambda d: t(d, "checkpoint-10"), list(HF_FILES_IN_ORDER),
                lambda d: [t(HERE, "hf_trainer.py"), "--output_dir", d, "--max_steps", "15", "--save_steps", "5",
                           "--resume_from_checkpoint", t(d, "checkpoint-10")],
                resume.check_hf)
    if "nanogpt" in only:
        _matrix("nanogpt", lambda d: _run([t(HERE, "nanogpt.py"), "--out_dir=" + d, "--max_iters=10"]),
                lambda d: d, ["ckpt.pt"],
                lambda d: [t(HERE, "nanogpt.py"), "--out_dir=" + d, "--max_iters=15", "--init_from=resume"],
                resume.check_nanogpt)
    if "lightning" in only:
        _matrix("lightning", lambda d: _run([t(HERE, "lightning_trainer.py"), "--ckpt_dir", d, "--max_steps", "10",
                                             "--every", "5"]),
                lambda d: d, ["last.ckpt"],
                lambda d: [t(HERE, "lightning_trainer.py"), "--ckpt_dir", d, "--max_steps", "15", "--every", "5",
                           "--ckpt_path", "last"],
                lambda d: resume.check_lightning(t(d, "last.ckpt")) if os.path.exists(t(d, "last.ckpt"))
                else resume.Resume(True, 0, degraded=["no last.ckpt: starts from scratch"]))
    if "plain" in only:
        _matrix("plain", lambda d: _run([t(HERE, "plain_loop.py"), "--ckpt_dir", d, "--steps", "10", "--every", "5"]),
                lambda d: d, ["step_00010.pt"],
                lambda d: [t(HERE, "plain_loop.py"), "--ckpt_dir", d, "--steps", "15", "--every", "5", "--resume",
                           t(d, "step_00010.pt")],
                lambda d: resume.check_plain(t(d, "step_00010.pt")))


def _classify(out_dir: str) -> str:
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.exists(path):
        return "missing"
    size = os.path.getsize(path)
    r = resume.check_nanogpt(out_dir)
    if r.ok:
        return "complete iter_num=%d" % r.step
    return "empty (0 B)" if size == 0 else "torn (%d B): %s" % (size, r.error.split(":")[0])


def kill_during_save(trials: int, sig: str, mb: float) -> None:
    signum = getattr(signal, "SIG" + sig)
    counts: dict = {}
    for i in range(trials):
        out_dir = tempfile.mkdtemp(prefix="probe-kill-")
        env = dict(os.environ, PYTHONUNBUFFERED="1", ONBOX_TEST_SAVE_MB=str(mb))
        proc = subprocess.Popen([PY, os.path.join(HERE, "nanogpt.py"), "--out_dir=" + out_dir, "--max_iters=10"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        saves, t_save, save_s = 0, 0.0, 0.0
        lines = iter(proc.stdout.readline, "")
        for line in lines:  # the first save, timed from its line to the next line
            if line.startswith("saving checkpoint"):
                t_save = time.monotonic()
                saves += 1
            elif saves == 1 and t_save:
                save_s = time.monotonic() - t_save
                break
        for line in lines:
            if line.startswith("saving checkpoint"):
                time.sleep(random.uniform(0, save_s))
                proc.send_signal(signum)
                break
        proc.stdout.close()
        rc = proc.wait(timeout=60)
        verdict = _classify(out_dir)
        counts[verdict.split(" (")[0].split(":")[0]] = counts.get(verdict.split(" (")[0].split(":")[0], 0) + 1
        print("trial %2d: save took %.3f s, rc=%d, ckpt.pt: %s" % (i + 1, save_s, rc, verdict), flush=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    print("summary (%d trials, SIG%s, ballast %s MiB): %s" % (trials, sig, mb, counts))


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("resume-matrix")
    m.add_argument("--only", default="hf,nanogpt,lightning,plain")
    k = sub.add_parser("kill-during-save")
    k.add_argument("--trials", type=int, default=20)
    k.add_argument("--signal", default="TERM", choices=["TERM", "KILL", "INT"])
    k.add_argument("--mb", type=float, default=64)
    a = p.parse_args(argv)
    if a.cmd == "resume-matrix":
        resume_matrix(a.only.split(","))
    else:
        kill_during_save(a.trials, a.signal, a.mb)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
