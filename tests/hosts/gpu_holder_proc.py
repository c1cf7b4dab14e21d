"""A process that holds (stand-in) NVIDIA device files open, like a CUDA trainer, and forks workers that inherit
them, like DataLoader workers forked after CUDA init. Run by tests/hosts/gpu_holders.py; stdlib only.

usage: gpu_holder_proc.py WORKERS IGNORE_TERM UID PATH...
  WORKERS      workers to fork (they inherit the open files)
  IGNORE_TERM  how many of the workers ignore SIGTERM (only SIGKILL ends them)
  UID          drop to this uid after opening the files (-1: stay)
Prints one line {"pid": <pid as /proc here sees it>, "workers": [...]} once everything holds, closes stdout.
"""
import json
import os
import signal
import sys
import time


def main() -> None:
    workers, ignore_term, uid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    fds = [os.open(p, os.O_RDONLY) for p in sys.argv[4:]]
    if uid >= 0:
        os.setgid(uid)
        os.setuid(uid)
    kids = []
    for i in range(workers):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(1)
            if i < ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            # /proc/self names the pid as the (host) procfs sees it, also inside a new PID namespace
            os.write(w, os.readlink("/proc/self").encode())
            os._exit(_sleep_forever(fds))
        os.close(w)
        kids.append(int(os.read(r, 32)))
        os.close(r)
    sys.stdout.write(json.dumps({"pid": int(os.readlink("/proc/self")), "workers": kids}) + "\n")
    sys.stdout.flush()
    os.close(1)
    _sleep_forever(fds)


def _sleep_forever(fds: list) -> int:
    while fds:
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    main()
