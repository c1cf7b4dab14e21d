"""A stand-in agent process for heartbeat tests: a real process loop driving HeartbeatHook as the supervisor
does (on_output per line, its record parsed once by the run's progress feed and handed to on_progress, tick every
few ms, progress.json from the feed twice a second, close at the end), pushing to a real tracker.

    python -m tests.hosts.heartbeat_agent --run-dir D --tracker URL --token-file F --interval 0.05 --stop-file S

Runs until the stop file exists, then closes the hook (final beat + flush) and writes --result: the steps the
"job" made, the longest tick (a blocked tick would mean the network disturbs the job), the beats taken.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from onbox.clock import SystemClock
from onbox.config import RunConfig
from onbox.fsutil import atomic_write_json
from onbox.heartbeat.collect import BoxReaders
from onbox.heartbeat.hook import HeartbeatHook
from onbox.heartbeat.sinks import Backoff
from onbox.supervisor.hooks import RunContext
from tests.fakes.supervisor import loop_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--name", default="hbtest")
    ap.add_argument("--tracker", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--tick", type=float, default=0.005)
    ap.add_argument("--request-timeout", type=float, default=1.0)
    ap.add_argument("--backoff-cap", type=float, default=0.5)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    args = ap.parse_args(argv)

    os.makedirs(args.run_dir, exist_ok=True)
    cfg = RunConfig(name=args.name, tracker=args.tracker, tracker_token_file=args.token_file,
                    heartbeat_interval=args.interval)
    clock = SystemClock()
    ctx = RunContext(name=args.name, run_dir=args.run_dir, ckpt_dir=os.path.join(args.run_dir, "ckpt"),
                     config=cfg, clock=clock, emit=lambda *a, **k: None, attempt=lambda: 0)
    readers = BoxReaders(gpu=lambda: {"available": False, "reason": "test agent", "gpus": []},
                         host=lambda: {"available": False, "reason": "test agent"})
    hook = HeartbeatHook(ctx, readers=readers, request_timeout=args.request_timeout, close_timeout=60.0,
                         backoff=Backoff(base=0.02, cap=args.backoff_cap))
    state = {"run": args.name, "state": "running", "attempt": 0, "child_pid": os.getpid(), "restarts": 0,
             "attempts": [], "last_exit": None}
    step, max_tick, progress_due = 0, 0.0, 0.0
    end = time.monotonic() + args.max_seconds
    while not os.path.exists(args.stop_file) and time.monotonic() < end:
        step += 1
        t0 = time.monotonic()
        loop_step(hook, "iter %d: loss %.4f, time 5.00ms, mfu 1.00%%" % (step, 3.0 / (1 + step * 1e-3)))
        hook.tick(state)
        max_tick = max(max_tick, time.monotonic() - t0)
        if time.monotonic() >= progress_due:  # the loop's record of the feed: how far the job got
            atomic_write_json(os.path.join(args.run_dir, "progress.json"), hook.feed.snapshot())
            progress_due = time.monotonic() + 0.5
        time.sleep(args.tick)
    state["state"] = "done"
    hook.close(state)
    with open(os.path.join(args.run_dir, "heartbeats", "seq.json")) as f:
        seq = json.load(f)
    atomic_write_json(args.result, {"steps": step, "max_tick_s": max_tick, "first_seq": seq["first_seq"],
                                    "next_seq": seq["next_seq"],
                                    "backlog": sum(s.spool.backlog() for s in hook.senders)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
