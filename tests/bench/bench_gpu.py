"""Holder scan over ~2,000 processes vs psmisc's `fuser` on the same device file, same run.

Spawns ~2,000 sleeping processes through a few forkers (each forks children that pause; the first few of them
hold a stand-in `nvidia0` open), times `HolderScan(...).scan()` (the full scan: fd links, then stat/status/
cmdline of each holder) and `fuser <file>` (what U11's fix runs), checks both found the same holders, and stops
exactly the processes it started, by PID. Target: the scan is faster than fuser.
"""
from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List, Tuple

PROCESSES = 2000
FORKERS = 4
HOLDERS = 16
ROUNDS = 7

# A forker: opens the device, forks HOLDERS children that keep it, closes it, forks the rest; reports every
# child pid on stdout, then reaps its children as they are killed (no zombie outlives the benchmark).
FORKER = r"""
import os, signal, sys
n, holders, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
fd = os.open(path, os.O_RDONLY)
kids = []
for i in range(n):
    if i == holders:
        os.close(fd)
    pid = os.fork()
    if pid == 0:
        while True:
            signal.pause()
    kids.append(pid)
sys.stdout.write(" ".join(map(str, kids)) + "\n")
sys.stdout.flush()
for _ in kids:
    os.wait()
"""


def spawn(path: str) -> Tuple[List[subprocess.Popen], List[int]]:
    forkers, kids = [], []
    per = PROCESSES // FORKERS
    for i in range(FORKERS):
        p = subprocess.Popen([sys.executable, "-c", FORKER, str(per), str(HOLDERS if i == 0 else 0), path],
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        forkers.append(p)
    for p in forkers:
        line = p.stdout.readline()  # type: ignore[union-attr]
        kids.extend(int(x) for x in line.split())
    return forkers, kids


def stop(forkers: List[subprocess.Popen], kids: List[int]) -> None:
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in forkers:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def timed(fn, rounds: int = ROUNDS) -> Tuple[float, object]:
    times, out = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    from onbox.gpu.holders import HolderScan

    fuser = shutil.which("fuser")
    if fuser is None:
        print("fuser not found: run `make sysdeps` (psmisc)")
        return 1
    tmp = tempfile.mkdtemp(prefix="bench-gpu-")
    path = os.path.join(tmp, "nvidia0")
    open(path, "wb").close()
    t0 = time.monotonic()
    forkers, kids = spawn(path)
    try:
        print("spawned %d sleeping processes (%d holding %s) in %.1f s" % (
            len(kids), HOLDERS, path, time.monotonic() - t0))
        scan = HolderScan(path)
        t_scan, result = timed(scan.scan)
        t_raw, _ = timed(lambda: scan._raw(scan_files(path)))

        def run_fuser() -> str:
            return subprocess.run([fuser, path], capture_output=True, text=True, timeout=60).stdout

        t_fuser, fuser_out = timed(run_fuser)
        ours = {h.pid for h in result.holders}  # type: ignore[attr-defined]
        theirs = {int(x) for x in str(fuser_out).split()}
        same = ours == theirs and len(ours) == HOLDERS
        print("processes scanned:         %d (unreadable %d)" % (result.scanned, len(result.unreadable)))  # type: ignore[attr-defined]
        print("holder scan (full):        %7.1f ms   median of %d" % (t_scan * 1000, ROUNDS))
        print("holder scan (fd links):    %7.1f ms" % (t_raw * 1000))
        print("baseline fuser %s: %7.1f ms   (same run, same file)" % (os.path.basename(path), t_fuser * 1000))
        print("holders found: scan %d, fuser %d, identical: %s" % (len(ours), len(theirs), same))
        print("target: scan faster than fuser -> %.2fx %s" % (
            t_fuser / t_scan, "MET" if t_scan < t_fuser else "MISSED"))
        return 0 if (t_scan < t_fuser and same) else 1
    finally:
        stop(forkers, kids)
        shutil.rmtree(tmp, ignore_errors=True)


def scan_files(path: str):
    from onbox.gpu.holders import device_files

    return device_files(path)


if __name__ == "__main__":
    sys.exit(main())
