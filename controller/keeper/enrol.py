"""`onboxctl run ... --recover pool:P`: the checks made before anything is launched, and the records written once
the launch succeeded (a run that did not start is not watched).

Checked first (exit 2, nothing launched): the pool is known (a box of the inventory is in it) or `--provision` is
given, the provision command exists and is executable, the code dir exists, the run has durable storage (a
recovery elsewhere restores from it) and a command (a relaunch from the box's own records cannot be repeated on
a spare). Written after: launch.json (policy.py) and a fresh recovery.json in WATCHING on the boxes just used;
the counts, history and events of an earlier life of the run are kept, an unreadable recovery.json is moved aside
(`recovery.json.unreadable`), never deleted.

Checked once the run is launched (`spares_unfit`): whether a spare of its pool can take it now (`onbox audit` on
each, as the keeper would at a loss). With none fit and no --provision it is said then, on stderr and in
recovery.json: otherwise the first loss would end it failed_no_resource with nobody told until then.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

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
                  "provision_timeout", "code", "include_secret")


def check_recovery(recover: Optional[str], opts: Dict[str, Any], cmd: List[str], durable: Optional[str],
                   boxes: Dict[str, Any]) -> Optional[RecoveryPolicy]:
    """The policy `--recover` and its companions describe (None without --recover), or a UsageError."""
    if recover is None:
        given = [f for f in RECOVERY_FLAGS if opts.get(f) not in (None, ())]
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
    if opts.get("include_secret"):
        if code is None:
            raise UsageError("--include-secret goes with --code: it names a file of the code dir the keeper pushes",
                             hint="e.g. --code ./train --include-secret .env")
        from controller.launch.push import code_selection

        code_selection(code, list(opts["include_secret"]))  # a name that matches no secret-looking file: refused now
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
    from controller.launch.push import default_pyz

    now = time.time() if now is None else now
    hb = onbox_env.get("ONBOX_HEARTBEAT_INTERVAL")
    pyz = default_pyz()
    rec = LaunchRecord(
        run=run, boxes=list(boxes), command=list(cmd), policy=policy, nodes=nodes, onbox_args=list(onbox_args),
        onbox_env=dict(onbox_env), workdir=workdir, code=os.path.abspath(opts["code"]) if opts.get("code") else None,
        pyz=os.path.abspath(pyz) if os.path.isfile(pyz) else None, durable=opts.get("durable"),
        ckpt_dir=opts.get("ckpt_dir"), tracker=tracker, tunnel=tunnel, secrets=list(opts.get("secret") or ()),
        include_secrets=list(opts.get("include_secret") or ()),
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


def spares_unfit(store: RecordStore, rec: LaunchRecord, world: Any, now: Optional[float] = None) -> Optional[str]:
    """Whether any spare of the run's pool can take it now (`onbox audit` for its durable and checkpoint dirs, no
    live agent: World.spare_problem; nothing is written to a spare, one without onbox.pyz is named as unchecked):
    when none can and there is no --provision, a run lost later would end failed_no_resource at once. That is said now, one line (returned for
    stderr) and a `spares_unfit` event in recovery.json; None when a spare is fit, or the provision command is the
    plan anyway."""
    import concurrent.futures

    if rec.policy.provision:
        return None
    names = sorted(n for n, b in world.boxes().items() if b.pool == rec.policy.pool and n not in rec.boxes)
    need = len(rec.boxes)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, len(names)))) as pool:
        problems = list(pool.map(lambda n: world.spare_problem(n, rec, push=False), names))
    fit = [n for n, p in zip(names, problems) if not p]
    if len(fit) >= need:
        return None
    said = "; ".join("%s %s" % (n, p) for n, p in zip(names, problems) if p) or "the pool has no other box"
    text = ("no %s of pool %s can take run %s now (%s): at its first loss the keeper would find no box and end it "
            "failed_no_resource" % ("spare" if need == 1 else "%d spares" % need, rec.policy.pool, rec.run, said))
    keep = store.load_keep(rec.run)
    if keep is not None:
        keep.event(time.time() if now is None else now, "spares_unfit", text, boxes=list(keep.boxes), recovery=None)
        store.save_keep(keep, time.time() if now is None else now)
    return text


def enrol_checked(policy: RecoveryPolicy, run: str, boxes: List[str], cmd: List[str], nodes: bool,
                  onbox_args: List[str], onbox_env: Dict[str, str], workdir: Optional[str], opts: Dict[str, Any],
                  tracker: Optional[str], tunnel: bool, timeout: float, warn: Callable[[str], None]) -> LaunchRecord:
    """`onboxctl run --recover`'s records (enrol), then its spares checked (spares_unfit): a pool that cannot take
    the run is said now through `warn`, not at the run's first loss."""
    from controller.boxes.inventory import Inventory
    from controller.boxes.ssh import Ssh, settings_from_env
    from controller.keeper.world import World

    store = RecordStore()
    rec = enrol(store, policy, run, boxes, cmd, nodes, onbox_args, onbox_env, workdir, opts, tracker, tunnel, timeout)
    unfit = spares_unfit(store, rec, World(Ssh(settings_from_env()), Inventory()))
    if unfit is not None:
        warn("%s: fix a spare, add one (onboxctl box add NAME --host HOST --pool %s) or give --provision"
             % (unfit, policy.pool))
    return rec
