"""A stand-in for the agent, started by a generated sbatch script (`--agent "python3 THIS"`), that checks the
script's side of the contract without the supervisor: it is exec'd (its parent is slurmstepd, not bash), it gets
the run options and CMD verbatim, the Slurm signal reaches it, and onbox.slurm.job.requeue() brings the job back with
SLURM_RESTART_COUNT=1. Each event is a JSON line in $PROBE_LOG."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.environ.get("PROBE_REPO", "."))

from onbox.slurm.job import SlurmJob, requeue

LOG = os.environ["PROBE_LOG"]
got = []


def record(event, **fields):
    with open(LOG, "a") as f:
        f.write(json.dumps(dict(event=event, pid=os.getpid(), time=time.time(), **fields)) + "\n")
        f.flush()


def main():
    job = SlurmJob.from_env(os.environ)
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
    with open("/proc/%d/comm" % os.getppid()) as f:
        parent = f.read().strip()
    record("start", argv=sys.argv[1:], parent=parent, slurm=job.to_dict() if job else None,
           restart_env=os.environ.get("SLURM_RESTART_COUNT"), master=os.environ.get("MASTER_ADDR"),
           onbox_env={k: v for k, v in os.environ.items() if k.startswith("ONBOX_")})
    mode = os.environ.get("PROBE_MODE", "requeue")  # requeue | exit-at-start | exit-on-signal
    if mode == "exit-at-start" or (job is not None and job.restart_count >= 1):
        return 0  # came back (or asked to stop at once): done
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    if not got:
        record("timeout")
        return 1
    record("signal", signum=got[0])
    if job is not None and mode == "requeue":
        requeue(job.job_id, timeout=30)
        record("requeued")
        return 75
    return 0


if __name__ == "__main__":
    sys.exit(main())
