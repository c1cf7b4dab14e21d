"""Benchmark of onbox.pyz (issue 2): size, cold and warm `--version`, `audit --json`, each beside its target and
the bare baseline `python -c 'import click'` measured in the same run with the same interpreter."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS_COLD = 5
RUNS_WARM = 15
RUNS_AUDIT = 5
TIMEOUT = 60


def timed(argv: List[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=TIMEOUT)
    return time.perf_counter() - t0


def main() -> int:
    python = sys.executable  # the same interpreter for the pyz and the baseline
    work = tempfile.mkdtemp(prefix="onbox-bench-")
    try:
        subprocess.run([python, os.path.join(REPO, "build", "zipapp.py"), "--out", work, "--arch", "x86_64",
                        "--cache", os.path.join(REPO, "build", "out")], check=True, timeout=600,
                       stdout=subprocess.DEVNULL)
        pyz = os.path.join(work, "onbox.pyz")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "ONBOX_HOME": os.path.join(work, "oh")}
        size = os.path.getsize(pyz)

        cold = []
        for i in range(RUNS_COLD):
            cold.append(timed([python, pyz, "--version"], dict(env, SHIV_ROOT=os.path.join(work, "cold%d" % i))))
        warm_env = dict(env, SHIV_ROOT=os.path.join(work, "warm"))
        timed([python, pyz, "--version"], warm_env)  # extract + write the bytecode caches once
        baseline, warm = [], []
        for _ in range(RUNS_WARM):  # interleaved, so both see the same machine load
            baseline.append(timed([python, "-c", "import click"], env))
            warm.append(timed([python, pyz, "--version"], warm_env))
        audit = [timed([python, pyz, "audit", "--json", "--min-free-gb", "0"], warm_env) for _ in range(RUNS_AUDIT)]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = statistics.median(baseline)
    rows = [
        ("pyz size", "%.2f MB" % (size / 2**20), "-", "<= 5 MB", size <= 5 * 2**20),
        ("--version cold (fresh SHIV_ROOT), median of %d" % RUNS_COLD, "%.0f ms" % (1000 * statistics.median(cold)),
         "%.0f ms" % (1000 * base), "<= 1000 ms", statistics.median(cold) <= 1.0),
        ("--version warm, median of %d" % RUNS_WARM, "%.0f ms (%.2fx)" % (1000 * statistics.median(warm),
                                                                        statistics.median(warm) / base),
         "%.0f ms" % (1000 * base), "<= 1.5x baseline", statistics.median(warm) <= 1.5 * base),
        ("audit --json, median of %d" % RUNS_AUDIT, "%.0f ms" % (1000 * statistics.median(audit)),
         "%.0f ms" % (1000 * base), "<= 2000 ms", statistics.median(audit) <= 2.0),
    ]
    print("python: %s (%s); load average %s" % (python, sys.version.split()[0], os.getloadavg()[0]))
    print("minimums (least disturbed by other load): cold %.0f ms, warm %.0f ms, baseline %.0f ms"
          % (1000 * min(cold), 1000 * min(warm), 1000 * min(baseline)))
    print("baseline: `python -c 'import click'`, median of %d interleaved runs" % RUNS_WARM)
    print("%-44s %-18s %-10s %-18s %s" % ("figure", "measured", "baseline", "target", ""))
    for name, measured, baseline_s, target, ok in rows:
        print("%-44s %-18s %-10s %-18s %s" % (name, measured, baseline_s, target, "ok" if ok else "MISSED"))
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
