"""`onboxctl run ... --recover pool:P`: the checks made before anything is launched, and the records written once
the launch succeeded (a run that did not start is not watched).

Checked first (exit 2, nothing launched): the pool is known (a box of the inventory is in it) or `--provision` is
given, the provision command exists and is executable, the code dir exists, the run has durable storage (a
recovery elsewhere restores from it) and a command (a relaunch from the box's own records cannot be repeated on
a spare). Written after: launch.json (policy.py) and a fresh recovery.json in WATCHING on the boxes just used;
the counts, history and events of an earlier life of the run are kept, an unreadable recovery.json is moved aside
(`recovery.json.unreadable`), never deleted.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

from controller.keeper.policy import (
    DEFAULT_HEARTBEAT_INTERVAL,
    LaunchRecord,
    RecoveryPolicy,
    parse_provision,
    parse_recover,
)
from controller.keeper.records import KeepState, RecordProblem, RecordStore, RunKeep
from onbox.errors import UsageError

RECOVERY_FLAGS = ("provision", "lost_after", "max_recoveries", "max_at_risk", "backoff", "recover_tries",
                  "provision_timeout", "code")


def check_recovery(recover: Optional[str], opts: Dict[str, Any], cmd: List[str], durable: Optional[str],
                   boxes: Dict[str, Any]) -> Optional[RecoveryPolicy]:
    """The policy `--recover` and its companions describe (None without --recover), or a UsageError."""
    if recover is None:
        given = [f for f in RECOVERY_FLAGS if opts.get(f) is not None]
        if given:
            raise UsageError("--%s goes with --recover pool:NAME" % given[0].replace("_", "-"),
                             hint="e.g. onboxctl run gpu1 --durable /workspace/durable --recover pool:a100 -- python "
                                  "train.py")
        return None
    pool = parse_recover(recover)
    provision = None
    if opts.get("provision") is not None:
        from controller.keeper.provision import check_provision_command

        provision = check_provision_command(parse_provision(opts["provision"]))
    if provision is None and not any(getattr(b, "pool", None) == pool for b in boxes.values()):
        known = sorted({b.pool for b in boxes.values() if getattr(b, "pool", None)})
        raise UsageError("unknown pool %r: no box in the inventory is in it, and no --provision command can bring "
                         "one up" % pool,
                         hint="add a spare: onboxctl box add NAME --host HOST --pool %s%s" % (
                             pool, " (pools: %s)" % ", ".join(known) if known else ""))
    if not durable:
        raise UsageError("--recover needs --durable",
                         hint="a run recovered on another box resumes from its newest durable checkpoint: "
                              "--durable r2:ckpt, or a mount every box of the pool shares")
    if not cmd:
        raise UsageError("--recover needs the command (after `--`)",
                         hint="the keeper relaunches exactly that command on the same or another box")
    code = opts.get("code")
    if code is not None and not os.path.isdir(code):
        raise UsageError("--code %s is not a directory" % code,
                         hint="the local code dir the keeper pushes to a replacement box (as `onboxctl push --code`)")
    return RecoveryPolicy(
        pool=pool, provision=provision, lost_after=opts.get("lost_after"),
        max_recoveries=opts["max_recoveries"] if opts.get("max_recoveries") is not None else 10,
        max_at_risk=opts.get("max_at_risk"),
        backoff=opts["backoff"] if opts.get("backoff") is not None else 30.0,
        tries=opts["recover_tries"] if opts.get("recover_tries") is not None else 3,
        provision_timeout=opts["provision_timeout"] if opts.get("provision_timeout") is not None else 600.0)


def enrol(store: RecordStore, policy: RecoveryPolicy, run: str, boxes: List[str], cmd: List[str], nodes: bool,
          onbox_args: List[str], onbox_env: Dict[str, str], workdir: Optional[str], opts: Dict[str, Any],
          tracker: Optional[str], tunnel: bool, timeout: float, now: Optional[float] = None) -> LaunchRecord:
    """Write the run's launch record and a fresh recovery record (WATCHING on `boxes`)."""
    from controller.push import default_pyz

    now = time.time() if now is None else now
    hb = onbox_env.get("ONBOX_HEARTBEAT_INTERVAL")
    pyz = default_pyz()
    rec = LaunchRecord(
        run=run, boxes=list(boxes), command=list(cmd), policy=policy, nodes=nodes, onbox_args=list(onbox_args),
        onbox_env=dict(onbox_env), workdir=workdir, code=os.path.abspath(opts["code"]) if opts.get("code") else None,
        pyz=os.path.abspath(pyz) if os.path.isfile(pyz) else None, durable=opts.get("durable"),
        ckpt_dir=opts.get("ckpt_dir"), tracker=tracker, tunnel=tunnel, secrets=list(opts.get("secret") or ()),
        heartbeat_interval=float(hb) if hb else DEFAULT_HEARTBEAT_INTERVAL, timeout=timeout, created=round(now, 3))
    store.save_launch(rec)
    try:
        old = store.load_keep(run)
    except RecordProblem:
        path = store.keep_path(run)
        os.replace(path, path + ".unreadable")
        old = None
    keep = RunKeep(run=run, state=KeepState.WATCHING, boxes=list(boxes))
    if old is not None:
        old.close_current()
        keep.recoveries, keep.history, keep.events = old.recoveries, old.history, old.events
        keep.event_seq, keep.published = old.event_seq, old.published
    keep.event(now, "launched", "launched by `onboxctl run` on %s; kept by `onboxctl keep` (pool %s)" % (
        ", ".join(boxes), policy.pool), boxes=list(boxes), recovery=None)
    store.save_keep(keep, now)
    return rec
