"""`onbox sync`, `onbox checkpoints`, `onbox verify`: thin commands over onbox.checkpoints."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import click

from onbox.commands.clikit import echo_json
from onbox.errors import ExitCode, UsageError

MiB = 1024 * 1024


def _context(name: str, durable: Optional[str], ckpt_dir: Optional[str], create: bool = True) -> Any:
    """A RunContext for a run on this box, from its saved config.json (flags override). `create`: make the run
    dir (for the events a commit writes); a read-only listing creates nothing."""
    from onbox import fsutil, paths
    from onbox.clock import SystemClock
    from onbox.config import RunConfig
    from onbox.supervisor.hooks import RunContext
    from onbox.untrusted import CONFIG_MAX_BYTES

    if not paths.valid_run_name(name):
        raise UsageError("invalid run name %r" % name)
    run_dir = paths.run_dir(name)
    cfg = RunConfig(name=name)
    cfg_path = os.path.join(run_dir, "config.json")
    if os.path.exists(cfg_path):
        try:
            cfg = RunConfig.from_dict(fsutil.read_json(cfg_path, CONFIG_MAX_BYTES, "config"), source=cfg_path)
        except ValueError as e:
            raise UsageError("unreadable %s: %s" % (cfg_path, e))
    elif durable is None or ckpt_dir is None:
        raise UsageError("no run %r on this box (no %s)" % (name, cfg_path),
                         hint="see `onbox ls`, or give both --durable and --ckpt-dir")
    if durable:
        cfg.durable = durable
    if ckpt_dir:
        cfg.ckpt_dir = ckpt_dir
    if create:
        os.makedirs(run_dir, exist_ok=True)
    events = os.path.join(run_dir, "events.jsonl")
    clock = SystemClock()

    def emit(event_type: str, **fields: Any) -> None:
        fsutil.append_jsonl(events, dict(fields, type=event_type, time=clock.time(), source="onbox-cli"))

    return RunContext(name=name, run_dir=run_dir, ckpt_dir=cfg.ckpt_dir or os.path.join(run_dir, "checkpoints"),
                      config=cfg, clock=clock, emit=emit, attempt=lambda: 0)


@click.command("sync")
@click.argument("name")
@click.option("--now", is_flag=True, help="Do not wait for the settle interval (format checks still apply).")
@click.option("--durable", default=None, help="Durable target (path or rclone remote); default: the run's.")
@click.option("--ckpt-dir", default=None, help="Local checkpoint dir; default: the run's.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def sync(name: str, now: bool, durable: Optional[str], ckpt_dir: Optional[str], as_json: bool) -> None:
    """Commit run NAME's newest complete checkpoint to durable storage (MANIFEST.json last).

    Exit 0 only when the checkpoint is committed (or already was); 1 when the commit failed, with the reason.
    """
    from onbox.checkpoints import SyncFailed
    from onbox.checkpoints.hook import CheckpointCommitHook, summary

    ctx = _context(name, durable, ckpt_dir)
    if not ctx.config.durable:
        raise UsageError("run %r has no durable target" % name, hint="give --durable PATH or an rclone remote")
    hook = CheckpointCommitHook(ctx)
    complete = hook.scan_now(settle=0.0 if now else None)
    if not complete:
        raise SyncFailed(*_nothing_to_commit(name, ctx.ckpt_dir, hook, now))
    result = hook.commit_one(complete[-1])
    if result is None or result.status == "source_changed":
        last = hook.status.get("last_sync") or {}
        raise SyncFailed("commit of %s to %s FAILED: %s" % (complete[-1].name, ctx.config.durable,
                                                            last.get("error") or "the file changed while copying"),
                         hint="the local checkpoint is untouched; see events.jsonl, fix the cause, re-run")
    if as_json:
        echo_json(summary(result))
        return
    if result.status == "already":
        click.echo("already committed: %s (step %s) at %s" % (result.name, result.step, result.url))
    else:
        click.echo("committed %s (step %s, %.1f MiB in %.2f s) to %s" % (
            result.name, result.step, result.bytes / MiB, result.seconds, result.url))


def _nothing_to_commit(name: str, ckpt_dir: str, hook: Any, now: bool) -> Tuple[str, str]:
    """(message, hint) of `onbox sync` when no complete checkpoint is there: what to do depends on why."""
    if hook.scans.failed is not None:
        return ("nothing to commit for run %s: %s" % (name, hook.scans.failed),
                "point the trainer's saves (and --ckpt-dir) at a directory of its checkpoints only")
    waiting = [c for c in hook.cands if not c.complete]
    if not waiting:
        return ("nothing to commit for run %s: there is no checkpoint in %s yet" % (name, ckpt_dir),
                "the trainer must save one there first: check that it writes to $ONBOX_CKPT_DIR (or that "
                "--ckpt-dir is the directory it saves to), then run `onbox sync %s` again" % name)
    why = "; ".join("%s: %s" % (c.name, c.reason) for c in waiting)
    return ("nothing to commit for run %s: no complete checkpoint in %s yet (%s)" % (name, ckpt_dir, why),
            "wait for the trainer to finish writing it, then run this again" if now else
            "wait for the trainer to finish writing it, or use --now to skip the settle interval (the format "
            "checks still apply)")


def _trainer_alive(run_dir: str) -> bool:
    """The run's child (the trainer) is alive now: its pid and start time in state.json match a process."""
    from onbox import fsutil
    from onbox.proc import is_alive

    try:
        state = fsutil.read_json(os.path.join(run_dir, "state.json"))
    except (OSError, ValueError):
        return False
    if not isinstance(state, dict) or not isinstance(state.get("child_pid"), int):
        return False
    return is_alive(state["child_pid"], state.get("child_start_time"))


@click.command("checkpoints")
@click.argument("name")
@click.option("--durable", default=None, help="Durable target; default: the run's.")
@click.option("--ckpt-dir", default=None, help="Local checkpoint dir; default: the run's.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def checkpoints(name: str, durable: Optional[str], ckpt_dir: Optional[str], as_json: bool) -> None:
    """List run NAME's checkpoints: local (complete or why not) and durable (committed, with step and hash)."""
    from onbox.checkpoints.detect import (
        CheckpointDirTooLarge,
        CompletionTracker,
        ScanBound,
        read_progress,
        scan,
    )
    from onbox.checkpoints.hook import CheckpointCommitHook

    ctx = _context(name, durable, ckpt_dir, create=False)
    hook = CheckpointCommitHook(ctx)
    # scanned here, not through hook.scan_now(): a listing must not write checkpoint_status.json, which the
    # live agent owns (a read-modify-write from here could put back a stale last_sync)
    writing = _trainer_alive(ctx.run_dir)
    # with no trainer alive nothing is being written: what fails a check is torn, what lacks its last file
    # stays incomplete, and nothing is "still changing"
    problem = None
    try:
        found = scan(ctx.ckpt_dir, ScanBound.of(ctx.config))
    except CheckpointDirTooLarge as too_large:
        found, problem = [], str(too_large)
    cands = CompletionTracker(ctx.config.settle_seconds if writing else 0.0).update(
        found, ctx.clock.monotonic(), ctx.clock.time(), read_progress(ctx.run_dir))
    local: List[Dict[str, Any]] = [{"name": c.name, "path": c.path, "step": c.step, "bytes": c.bytes,
                                    "complete": c.complete, "reason": c.reason, "format": c.format,
                                    "complete_by": c.complete_by} for c in cands]
    durable_list = hook.committer.committed() if hook.committer else []
    doc: Dict[str, Any] = {"run": name, "ckpt_dir": ctx.ckpt_dir, "durable": ctx.config.durable, "local": local,
                           "committed": durable_list, "status": hook.status, "trainer_alive": writing,
                           "local_problem": problem}
    if as_json:
        echo_json(doc)
        return
    click.echo("local (%s; %s):" % (ctx.ckpt_dir, "the trainer runs" if writing else "no trainer running"))
    if problem:
        click.echo("  WARNING: %s" % problem)
    for c in local:
        click.echo("  %-40s step %-8s %10.1f MiB  %s" % (c["name"], c["step"], c["bytes"] / MiB,
                                                       ("complete, " if c["complete"] else "") + c["reason"]))
    click.echo("durable (%s):" % (ctx.config.durable or "none configured"))
    for e in durable_list:
        click.echo("  %-40s step %-8s %10.1f MiB  %s %s" % (e["name"], e.get("step"), (e.get("bytes") or 0) / MiB,
                                                          _verification(e), (e.get("digest") or "")[:12]))
    last = hook.status.get("last_sync")
    if last:
        click.echo("last sync: %s%s" % ("ok" if last.get("ok") else "FAILED", "" if last.get("ok") else
                                        ": %s" % last.get("error")))


def _verification(entry: Dict[str, Any]) -> str:
    """An index entry's verification state in a few words: at commit, or the newest re-check."""
    checks = (entry.get("verification") or {}).get("checks") or []
    if not checks:
        return "verified" if entry.get("verified") else "unverified"
    last = checks[-1]
    return "%s (re-checked %s by %s)" % ("verified" if last.get("result") == "passed" else "FAILED re-check",
                                         last.get("time"), last.get("by"))


@click.command("verify")
@click.argument("path", type=click.Path(exists=True, dir_okay=True, file_okay=True))
@click.option("--load", is_flag=True, help="Also torch.load(weights_only=True) each torch file; fails if torch "
                                           "cannot be imported here (see --no-load-ok).")
@click.option("--no-load-ok", is_flag=True, help="With --load: when torch cannot be imported, accept the format and "
                                                 "hash checks alone (and say so) instead of failing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def verify(ctx: click.Context, path: str, load: bool, no_load_ok: bool, as_json: bool) -> None:
    """Verify a checkpoint: manifest sizes and hashes, torch zip/pickle structure and CRCs, safetensors bounds,
    optional load.

    PATH: a committed checkpoint dir (with MANIFEST.json), one file, or a durable run dir (<durable>/<run>):
    every committed checkpoint in it is verified; dirs without a MANIFEST.json (interrupted commits) are listed and
    ignored. A dir without MANIFEST.json given directly is not verified: onbox writes the manifest last.
    A committed checkpoint's result (passed or failed, when, what was checked) is recorded in its run's
    checkpoints_index.json.

    Exit 0 only when everything asked was checked and passed; 1 on any problem (each names the file); 3 when
    --load could not run (no torch here) and nothing else failed.
    """
    import time

    from onbox.checkpoints.index import record_verification
    from onbox.checkpoints.verify import verify_path

    report = verify_path(path, load=load, no_load_ok=no_load_ok)
    # a re-check of committed checkpoints goes into their run's checkpoints_index.json (under the run's commit
    # lock); a read-only mount or a busy lock costs the record, never the verdict
    recorded, warning = record_verification(path, report.checkpoints, time.time())
    if as_json:
        echo_json(dict(report.to_dict(), index_recorded=recorded, index_warning=warning))
    else:
        for row in report.files:
            mark = "--  " if row["kind"] == "uncommitted" else "ok  " if row["ok"] else "BAD "
            detail = row["problem"] or row.get("note") or ""
            click.echo("%s %s%s%s" % (mark, row["path"], " [%s]" % row["kind"] if row["kind"] not in ("", "uncommitted")
                                      else "", ": %s" % detail if detail else ""))
        if report.step is not None:
            said = ""
            if report.has_manifest and report.manifest_step != report.step:
                said = "; the manifest says %s" % ("no step" if report.manifest_step is None else report.manifest_step)
            click.echo("step %d (read from %s%s)" % (report.step, report.step_source, said))
        if report.load_note:
            click.echo(report.load_note)
        for p in report.problems:
            click.echo("onbox: %s: %s" % (report.path, p), err=True)
        if report.ok:
            click.echo("verified: %s (%s)" % (report.path, "; ".join(report.checked)))
        else:
            click.echo("NOT VERIFIED: %s (%d problem(s))" % (report.path, len(report.problems)))
            if report.load_unavailable:
                click.echo("hint: run it where torch imports, or add --no-load-ok to accept the format and hash "
                           "checks alone", err=True)
        if recorded:
            click.echo("recorded in checkpoints_index.json: %s" % ", ".join(recorded))
        if warning:
            click.echo("onbox: warning: %s" % warning, err=True)
    if report.load_unavailable and len(report.problems) == 1:
        ctx.exit(int(ExitCode.UNFIT))  # nothing is known wrong with the checkpoint; this box cannot load it
    if not report.ok:
        ctx.exit(1)
