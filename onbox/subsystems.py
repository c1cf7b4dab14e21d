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
    from onbox.checkpoints.targets import overlap_problem
    from onbox.checkpoints.targets import preflight as durable_preflight
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
                                      cfg.ckpt_dir or os.path.join(paths.run_dir(cfg.name), paths.CHECKPOINTS_DIR))
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


def make_hooks(ctx: RunContext) -> Hooks:
    """The real subsystems for a run: checkpoint commits, heartbeats, the GPU reaper, the node group's peers."""
    from onbox.checkpoints.hook import CheckpointCommitHook
    from onbox.gpu.reaper import ReaperHook
    from onbox.heartbeat.hook import HeartbeatHook
    from onbox.slurm.job import checkpoint_hook_for_node

    if ctx.config.node_group:
        return _group_hooks(ctx, HeartbeatHook(ctx), ReaperHook(ctx))
    # Multi-node Slurm: only node 0 commits; the other nodes restore but never commit (onbox/slurm/job.py).
    checkpoints = checkpoint_hook_for_node(CheckpointCommitHook(ctx), os.environ if ctx.environ is None
                                           else ctx.environ, ctx.emit)
    return Hooks(checkpoints=checkpoints, telemetry=HeartbeatHook(ctx), reaper=ReaperHook(ctx))


def _group_hooks(ctx: RunContext, telemetry: object, reaper: object) -> Hooks:
    """A node of an SSH group (onbox/multinode/hooks.py): node 0 commits and says what every node resumes from;
    the others fetch exactly that, read-only; every agent hears of the others' notices."""
    from onbox.checkpoints.hook import CheckpointCommitHook
    from onbox.multinode import hooks as mn
    from onbox.multinode.role import load_group
    from onbox.supervisor.rundir import RunDir

    cfg = ctx.config
    assert cfg.node_group
    group = load_group(cfg.node_group)
    point = mn.ResumePoint()
    nodes = mn.GroupNotices(group, RunDir(ctx.run_dir).stop_request, ctx.emit, point)
    checkpoints: object
    if group.role.primary:
        checkpoints = mn.GroupPrimary(CheckpointCommitHook(ctx), point, ctx.clock, cfg.final_sync_timeout)
    else:
        restore = mn.GroupRestore(group, cfg.durable, ctx.ckpt_dir, ctx.emit, lambda: nodes.channel,
                                  wait_s=cfg.final_sync_timeout + mn.ASK_TIMEOUT_EXTRA, abort=nodes.stopping.is_set)
        checkpoints = mn.PrimaryOnlyCommits(None, group.rank, ctx.emit, restore=restore, source="ssh")
    return Hooks(checkpoints=checkpoints, telemetry=telemetry, reaper=reaper, nodes=nodes)  # type: ignore[arg-type]
