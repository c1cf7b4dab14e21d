"""The one module that knows every subsystem: it builds the hooks a run's supervisor drives and checks, before a
run starts, what those hooks would refuse.

The supervisor (onbox.supervisor) defines the seams and never imports a subsystem; each subsystem
(onbox.checkpoints, onbox.heartbeat, onbox.gpu, onbox.slurm) depends on the seams, never the reverse. The commands
that start a supervisor (`onbox run`, `onbox adopt`, `onbox stop`) pass `make_hooks` in.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from onbox.config import RunConfig
from onbox.supervisor.hooks import Hooks, RunContext


def preflight(cfg: RunConfig, environ: Optional[Dict[str, str]] = None) -> None:
    """Raise the UsageError (exit 2) / UnfitError (exit 3) that constructing or first using the hooks would meet:
    `onbox run` calls this in the foreground, before anything is created or detached, because an error inside
    the detached agent only reaches a log nobody reads. Creates nothing. Keep it in step with make_hooks."""
    from onbox import fsutil, paths
    from onbox.checkpoints.durable.targets import overlap_problem
    from onbox.checkpoints.durable.targets import preflight as durable_preflight
    from onbox.errors import UnfitError, UsageError
    from onbox.heartbeat.sinks import preflight as heartbeat_preflight

    if cfg.ckpt_dir:
        problem = fsutil.dir_problem(cfg.ckpt_dir)
        if problem:
            raise UnfitError("cannot use the checkpoint dir %s: %s" % (cfg.ckpt_dir, problem),
                             hint="give --ckpt-dir a writable directory on a fast local disk")
    if cfg.durable:
        durable_preflight(cfg.durable)
        if cfg.name:
            problem = overlap_problem(cfg.durable, cfg.name,
                                      paths.ckpt_dir(cfg.ckpt_dir, paths.run_dir(cfg.name)))
            if problem:
                raise UsageError(problem, hint="give --durable a directory outside --ckpt-dir (and vice versa)")
    heartbeat_preflight(cfg, environ)
    if cfg.mlflow:
        from onbox.heartbeat.mlflow import preflight as mlflow_preflight

        mlflow_preflight(cfg, environ)
    if cfg.node_group and cfg.node_group != "-":  # `-` (stdin) is read and checked by `onbox run` itself
        from onbox.multinode.role import load_group

        node_preflight(load_group(cfg.node_group))


def node_preflight(group: Any) -> None:
    """A node of an SSH group: its notice port must be free, or the peers could never tell it to stop (exit 3
    before anything starts)."""
    import socket

    from onbox.errors import UnfitError

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind(("", group.me.port))
        except OSError as e:
            raise UnfitError("node %d cannot listen for its peers on UDP port %d: %s"
                             % (group.rank, group.me.port, e.strerror or e),
                             hint="is an agent of this run still alive (`onbox status`)? else relaunch the group "
                                  "(`onboxctl run ... --nodes`): it picks free ports")


def commits(cfg: RunConfig, environ: Optional[Dict[str, str]] = None) -> bool:
    """This agent commits its run's checkpoints: a run with --durable, on node 0 of a group (SSH or Slurm) or
    alone. Only such an agent takes the run's lease."""
    from onbox.slurm.job import SlurmJob

    if not cfg.durable:
        return False
    if cfg.node_group:
        from onbox.multinode.role import load_group

        return bool(load_group(cfg.node_group).role.primary)
    job = SlurmJob.from_env(os.environ if environ is None else environ)
    return job is None or job.is_primary


def take_lease(cfg: RunConfig, run: str, take_over: bool, clock: Any = None) -> Any:
    """The run's lease on its durable storage (onbox/checkpoints/leases/fencing.py), taken once per agent launch before
    the supervisor starts; None for an agent that does not commit. Refusals: LeaseRefused (exit 2: another agent
    holds the run, its lease cannot be read, another launch won the epoch), UnfitError (exit 3: the durable
    storage cannot be reached, after a few tries)."""
    from onbox.checkpoints import NotARealDir, SyncFailed
    from onbox.checkpoints.commit import CheckpointCommitter
    from onbox.checkpoints.durable.targets import make_target
    from onbox.checkpoints.leases.fencing import RunLease, default_check_every
    from onbox.clock import SystemClock
    from onbox.errors import UnfitError
    from onbox.slurm.job import SlurmJob

    if not commits(cfg):
        return None
    assert cfg.durable
    job = SlurmJob.from_env(os.environ)
    clock = clock or SystemClock()
    target = make_target(cfg.durable, run)
    reader = CheckpointCommitter(target, run, clock, lambda *a, **k: None)
    ttl = cfg.effective_lease_ttl()
    for attempt in range(3):
        try:
            return RunLease.take(target, run, ttl, take_over, clock, reader.committed,
                                 default_check_every(ttl, cfg.sync_interval),
                                 slurm_job=job.job_id if job is not None else None)
        except (SyncFailed, OSError) as e:
            if attempt == 2 or isinstance(e, NotARealDir):  # a planted link or file: no retry mends it
                raise UnfitError("cannot take run %s's lease on %s: %s" % (run, target.url, e),
                                 hint="the durable storage must be reachable when a run starts (every write checks "
                                      "the lease); check the mount or the remote, then launch again")
            clock.sleep(1.0 + 2.0 * attempt)
    return None


def make_hooks(ctx: RunContext, lease: Any = None) -> Hooks:
    """The real subsystems for a run: checkpoint commits, heartbeats, the GPU reaper, the node group's peers.
    `lease`: the run's lease the agent took (take_lease); its renewals start here."""
    from onbox.gpu.reaper import ReaperHook
    from onbox.heartbeat.hook import HeartbeatHook
    from onbox.slurm.job import checkpoint_hook_for_node

    if ctx.config.node_group:
        return _group_hooks(ctx, HeartbeatHook(ctx), ReaperHook(ctx), lease)
    # Multi-node Slurm: only node 0 commits; the other nodes restore but never commit (onbox/slurm/job.py).
    inner = _commit_hook(ctx, lease)
    checkpoints = checkpoint_hook_for_node(inner, os.environ if ctx.environ is None else ctx.environ, ctx.emit)
    return Hooks(checkpoints=checkpoints, telemetry=HeartbeatHook(ctx), reaper=ReaperHook(ctx),
                 logs=_log_sync(inner, ctx) if checkpoints is inner else None)


def _log_sync(hook: Any, ctx: RunContext) -> Any:
    """Hooks.logs: the run's logs (a hang's stacks file among them) to durable storage now, after the commit in
    flight (bounded by final_sync_timeout); None without durable storage."""
    if getattr(hook, "target", None) is None:
        return None

    def sync() -> None:
        hook.join_worker(ctx.clock.monotonic() + ctx.config.final_sync_timeout)
        hook.sync_logs()
    return sync


def _commit_hook(ctx: RunContext, lease: Any) -> Any:
    """The checkpoint hook that commits; the lease's events, status and renewal thread start with it."""
    from onbox.checkpoints.hook import CheckpointCommitHook

    hook = CheckpointCommitHook(ctx, lease=lease)
    if lease is not None:
        lease.attach(ctx.emit, hook.lease_changed)
        lease.start()
    return hook


def _group_hooks(ctx: RunContext, telemetry: object, reaper: object, lease: Any) -> Hooks:
    """A node of an SSH group (onbox/multinode/hooks.py): node 0 commits and says what every node resumes from;
    the others fetch exactly that, read-only; every agent hears of the others' notices."""
    from onbox.multinode import hooks as mn
    from onbox.multinode.role import load_group
    from onbox.supervisor.rundir import RunDir

    cfg = ctx.config
    assert cfg.node_group
    group = load_group(cfg.node_group)
    point = mn.ResumePoint()
    nodes = mn.GroupNotices(group, RunDir(ctx.run_dir).stop_request, ctx.emit, point)
    checkpoints: object
    logs = None
    if group.role.primary:
        inner = _commit_hook(ctx, lease)
        checkpoints, logs = mn.GroupPrimary(inner, point, ctx.clock, cfg.final_sync_timeout), _log_sync(inner, ctx)
    else:
        restore = mn.GroupRestore(group, cfg.durable, ctx.ckpt_dir, ctx.emit, lambda: nodes.channel,
                                  wait_s=cfg.final_sync_timeout + mn.ASK_TIMEOUT_EXTRA, abort=nodes.stopping.is_set)
        checkpoints = mn.PrimaryOnlyCommits(None, group.rank, ctx.emit, restore=restore, source="ssh")
    return Hooks(checkpoints=checkpoints, telemetry=telemetry, reaper=reaper, nodes=nodes,  # type: ignore[arg-type]
                 logs=logs)


def launch_commit_estimate(cfg: RunConfig, run_dir: str) -> float:
    """Seconds the final commit would take, as a launch can know it (onbox/launch/deadline.py): the newest local
    checkpoint and the throughput an earlier agent of the run measured (its checkpoint_status.json), else none
    and the assumed throughput; 0 without durable storage (nothing is committed)."""
    from onbox import fsutil, paths
    from onbox.checkpoints.hook.scheduler import commit_seconds, final_settle
    from onbox.checkpoints.hook.status import DEFAULT_THROUGHPUT

    if not cfg.durable:
        return 0.0
    try:
        doc = fsutil.read_json(os.path.join(run_dir, paths.CHECKPOINT_STATUS_FILE))
    except (OSError, ValueError):
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    latest: Dict[str, Any] = doc["latest_local"] if isinstance(doc.get("latest_local"), dict) else {}
    size = latest.get("bytes")
    size = float(size) if isinstance(size, (int, float)) else 0.0
    measured = doc.get("throughput_bytes_per_s")
    rate = float(measured) if isinstance(measured, (int, float)) and measured > 0 else float(DEFAULT_THROUGHPUT)
    return commit_seconds(size, rate, final_settle(cfg.settle_seconds))
