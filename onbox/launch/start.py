"""start(plan): the run directory, its lock and its re-launch record, then the Supervisor, in this process
(--foreground) or in a detached agent that reports back once the child runs (detach.daemonize). A run whose child
is still alive is re-adopted, never launched twice; a refused start leaves nothing behind."""
from __future__ import annotations

import functools
import os
import shutil
import sys
from typing import Any, Callable, Dict, Optional

from onbox import fsutil, paths, vocab
from onbox.config import RunConfig
from onbox.errors import OnboxError, UnfitError, UsageError
from onbox.launch.plan import LaunchPlan
from onbox.proc import ProcessSeam
from onbox.supervisor import detach, records
from onbox.supervisor.rundir import RunDir


def start(plan: LaunchPlan, foreground: bool, on_ready: Callable[[Dict[str, Any]], None]) -> int:
    """Start the planned run, or re-adopt its live child. `on_ready(info)` is called in this process once the agent
    knows: {ok, run, run_dir, pid, agent_pid, state, adopted, error} (or {ok: False, error, hint, exit}). Returns
    the exit code: in the foreground the run's own, detached 0 once the child runs, else the agent's refusal's."""
    cfg, rd, adopt_only = plan.cfg, plan.rd, plan.adopt_only
    runs_created = not os.path.isdir(os.path.dirname(rd.path))
    created = not os.path.isdir(rd.path)
    lock_existed = os.path.exists(rd.lock_path)

    def undo() -> None:  # a refused start leaves nothing behind
        if created:
            shutil.rmtree(rd.path, ignore_errors=True)
        elif not lock_existed and os.path.exists(rd.lock_path):
            os.unlink(rd.lock_path)
        if runs_created:
            try:
                os.rmdir(os.path.dirname(rd.path))
            except OSError:
                pass

    # A full (or read-only) ONBOX_HOME refuses a new run up front; a live child is adopted all the same: a
    # supervised child on a full disk (the agent holds its records in memory) beats an unsupervised one.
    space = fsutil.space_problem(paths.onbox_home())
    if space and detach.live_child(rd, ProcessSeam()) is None:
        raise records.home_problem_error(paths.onbox_home(), space, rd.name)
    try:
        if not os.path.isdir(os.path.dirname(rd.path)):
            fsutil.make_private_dir(os.path.dirname(rd.path))
        os.makedirs(rd.path, mode=fsutil.PRIVATE_DIR, exist_ok=True)
        lock = detach.lock_or_explain(rd)
    except UsageError:
        raise
    except OSError as e:
        undo()
        raise records.home_fault_error(paths.onbox_home(), e, rd.name) or UsageError(
            "cannot create the run directory %s: %s" % (rd.path, e.strerror or e),
            hint="set ONBOX_HOME to a writable directory")
    child = detach.live_child(rd, ProcessSeam())
    if adopt_only and child is None:
        lock.release()
        if not lock_existed:  # a refusal leaves nothing behind
            os.unlink(rd.lock_path)
        raise UsageError("run %s has no live child to adopt" % rd.name,
                         hint="start it again with `onbox run --name %s -- CMD`" % rd.name)
    rd.make_private()  # 0700 and 0600, also for a run an older agent left 0755/0644
    if child is not None and not adopt_only:
        cfg = _recorded(rd, cfg)  # the live child runs the recorded configuration, not this command line
    if child is None:
        try:
            rd.write_config(cfg.to_dict())  # the exact re-launch record
            if os.path.exists(rd.stop_request):  # a stop meant for an earlier agent must not end this launch
                os.unlink(rd.stop_request)
        except OSError as e:  # the disk filled since the check above
            refusal = records.home_fault_error(paths.onbox_home(), e, rd.name)
            if refusal is None:
                raise
            lock.release()
            undo()
            raise refusal
    lock.write_owner(os.getpid())

    def agent(ready: Callable[[Dict[str, Any]], None]) -> int:
        from onbox import subsystems
        from onbox.supervisor.loop import RunState, Supervisor, exit_code_for

        lock.write_owner(os.getpid())
        lease = None
        try:
            # the run's lease on durable storage, by this process (the agent) before anything restores or commits
            lease = subsystems.take_lease(cfg, rd.name, plan.take_over)
            try:
                # builds the hooks; preflight() caught what it could in the foreground
                hooks = subsystems.make_hooks if lease is None else functools.partial(subsystems.make_hooks,
                                                                                      lease=lease)
                sup = Supervisor(cfg, rd, hooks_factory=hooks, proc=_container_seam(cfg, rd))
            except OSError as oe:
                raise UnfitError("run %s cannot start: %s" % (rd.name, oe), hint="check the permissions of %s" % rd.path)
        except OnboxError as e:
            if lease is not None:
                lease.close(release=True)  # taken, then the start failed: nothing ran under it
            if created:  # a refused launch leaves nothing behind (the runs dir too, when it made that)
                undo()
            ready({"ok": False, "run": rd.name, "error": e.message, "hint": e.hint, "exit": int(e.exit_code)})
            if foreground:
                raise
            return int(e.exit_code)
        sup.on_ready = lambda s: ready({"ok": s.state.value == vocab.RUNNING, "run": rd.name, "run_dir": rd.path,
                                        "pid": s.child.pid if s.child else None, "agent_pid": os.getpid(),
                                        "state": s.state.value, "adopted": child is not None,
                                        "error": s.message if s.state.value != vocab.RUNNING else None,
                                        # what makes the run this run (onbox/launch/match.py): onboxctl records it
                                        "command": cfg.command, "workdir": cfg.workdir, "durable": cfg.durable,
                                        "ckpt_dir": cfg.ckpt_dir})
        try:
            return exit_code_for(sup.run(adopt=child))
        finally:
            if lease is not None:  # released only when the run ended for good here (an adoptable child keeps it)
                lease.close(release=sup.state.terminal and sup.state != RunState.FENCED, ended=sup.state.value)

    if foreground:
        try:
            return agent(on_ready)
        finally:
            lock.release()
    ok, info = detach.daemonize(agent, rd.file(paths.AGENT_LOG))
    lock.release()
    on_ready(info)
    return 0 if ok else int(info.get("exit") or 1)


def _recorded(rd: RunDir, fallback: RunConfig) -> RunConfig:
    """The configuration the run's live child was started with (its config.json), else `fallback`."""
    try:
        return rd.run_config()
    except (OSError, ValueError, TypeError, UsageError):
        return fallback


def _container_seam(cfg: RunConfig, rd: RunDir) -> Optional[Any]:
    """The process seam of a container job (onbox/launch/container.py), None for any other run."""
    from onbox.launch.container import seam_for

    def log(message: str) -> None:
        sys.stderr.write("onbox[%d]: %s\n" % (os.getpid(), message))

    return seam_for(cfg, rd, os.path.abspath(paths.ckpt_dir(cfg.ckpt_dir, rd.path)), os.environ, log)
