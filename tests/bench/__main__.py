"""`make bench`: runs every tests/bench/bench_*.py module's main(), each printing its figures beside a baseline
measured in the same run. `python -m tests.bench NAME ...` runs only the named ones (e.g. `zipapp`)."""
from __future__ import annotations

import importlib
import os
import sys
import time


def main(argv: list) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    names = sorted(f[len("bench_"):-3] for f in os.listdir(here) if f.startswith("bench_") and f.endswith(".py"))
    wanted = argv or names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print("unknown benchmark(s): %s; known: %s" % (", ".join(unknown), ", ".join(names)), file=sys.stderr)
        return 2
    failed = []
    for name in wanted:
        print("\n=== bench %s" % name, flush=True)
        t0 = time.monotonic()
        mod = importlib.import_module("tests.bench.bench_%s" % name)
        rc = mod.main()
        print("=== bench %s done in %.1f s%s" % (name, time.monotonic() - t0, "" if not rc else " (missed a target)"))
        if rc:
            failed.append(name)
    if failed:
        print("\nbenchmarks that missed a target: %s" % ", ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
