"""What a run's durable storage says of it, read only: its newest committed checkpoint (name, step) and its lease
(who holds it, live or released, how it ended, whether it would refuse a launch on this box). `onbox match`
reports it for every run a launch of the same command would continue, so that `onboxctl run` can say `resuming
<run> from step <S>` and tell a finished run, or one still held elsewhere, from one to resume.

Nothing here writes, takes a lock or emits an event: a refused manifest is left out (the agent that restores the
run says it), a lease that cannot be read is said as `problem`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from onbox import untrusted
from onbox.checkpoints import SyncFailed


def durable_facts(durable: str, run: str, default_ttl: float, now: Optional[float] = None,
                  alive: Optional[Callable[[int, Optional[int]], bool]] = None, box: Optional[str] = None,
                  slurm_job: Optional[str] = None) -> Dict[str, Any]:
    """{durable, exists, checkpoints, checkpoint, step, lease, problem} of run `run` on the target `durable`:
    `exists` whether the target holds anything of the run (a committed checkpoint or a lease); `checkpoint` and
    `step` the newest committed checkpoint (by step, as retention orders them; None without one); `lease` the
    lease that holds the run ({epoch, holder, host, renewed_at, released_at, ended, live, blocks}; None without
    one); `problem` what could not be read (the target, the lease)."""
    from onbox.checkpoints.commit import CheckpointCommitter
    from onbox.checkpoints.durable import retention
    from onbox.checkpoints.durable.targets import make_target
    from onbox.checkpoints.leases import BadLease, blocks, box_id, holder_of_run, is_live
    from onbox.checkpoints.leases.fencing import LeaseStore
    from onbox.clock import SystemClock
    from onbox.proc import is_alive

    now = time.time() if now is None else now
    out: Dict[str, Any] = {"durable": durable, "exists": False, "checkpoints": 0, "checkpoint": None, "step": None,
                           "lease": None, "problem": None}
    try:
        target = make_target(durable, run)
        entries = CheckpointCommitter(target, run, SystemClock(), emit=lambda *a, **k: None).committed()
        store = LeaseStore(target, run)
        files = store.files()
    except (SyncFailed, OSError, untrusted.UntrustedInput) as e:
        out["problem"] = "cannot read %s/%s: %s" % (durable.rstrip("/"), run, getattr(e, "message", None) or e)
        return out
    out["exists"] = bool(entries or files)
    out["checkpoints"] = len(entries)
    if entries:
        newest = max(entries, key=retention.entry_order)
        out["checkpoint"] = newest.get("name")
        out["step"] = newest.get("step") if isinstance(newest.get("step"), int) else None
    held = holder_of_run(files)
    if held is None:
        return out
    try:
        doc = store.read(held)
    except (BadLease, SyncFailed, OSError) as e:
        out["problem"] = "the lease that holds run %s cannot be read: %s" % (run, getattr(e, "message", None) or e)
        out["lease"] = {"epoch": held.epoch, "holder": held.holder, "live": None, "blocks": None}
        return out
    live = is_live(doc, now, default_ttl)
    out["lease"] = {"epoch": held.epoch, "holder": held.holder, "host": doc.get("host"),
                    "renewed_at": doc.get("renewed_at"), "released_at": doc.get("released_at"),
                    "ended": doc.get("ended"), "live": live,
                    "blocks": blocks(doc, held.holder, box or box_id(), alive or is_alive, slurm_job, now,
                                     default_ttl)}
    return out
