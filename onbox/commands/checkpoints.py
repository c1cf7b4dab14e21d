"""`onbox sync`, `onbox checkpoints`, `onbox verify`: thin commands over onbox.checkpoints."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import click

from onbox.clikit import LaidOut, PathValue, echo_json, echo_line
from onbox.errors import ExitCode, OnboxError, UsageError

MiB = 1024 * 1024


def _context(name: str, durable: Optional[str], ckpt_dir: Optional[str], create: bool = True) -> Any:
    """A RunContext for a run on this box, from its saved config.json (flags override). `create`: make the run
    dir (for the events a commit writes); a read-only listing creates nothing."""
    from onbox import fsutil, paths
    from onbox.clock import SystemClock
    from onbox.config import RunConfig
    from onbox.supervisor.hooks import RunContext
    from onbox.supervisor.rundir import RunDir

    if not paths.valid_run_name(name):
        raise UsageError("invalid run name %r" % name)
    run_dir = paths.run_dir(name)
    rd = RunDir(run_dir)
    cfg = RunConfig(name=name)
    if os.path.exists(rd.config_path):
        try:
            cfg = rd.run_config(validate=False, source=rd.config_path)
        except (ValueError, TypeError) as e:
            raise UsageError("unreadable %s: %s" % (rd.config_path, e))
    elif durable is None or ckpt_dir is None:
        raise UsageError("no run %r on this box (no %s)" % (name, rd.config_path),
                         hint="see `onbox ls`, or give both --durable and --ckpt-dir")
    if durable:
        cfg.durable = durable
    if ckpt_dir:
        cfg.ckpt_dir = ckpt_dir
    if create:  # a writer: `onbox run`'s rule for the durable dir holds here too
        _check_durable(cfg.durable)
        os.makedirs(run_dir, exist_ok=True)
    events = rd.events_path
    clock = SystemClock()

    def emit(event_type: str, **fields: Any) -> None:
        fsutil.append_jsonl(events, dict(fields, type=event_type, time=clock.time(), source="onbox-cli"))

    return RunContext(name=name, run_dir=run_dir, ckpt_dir=paths.ckpt_dir(cfg.ckpt_dir, rd.path),
                      config=cfg, clock=clock, emit=emit, attempt=lambda: 0)


def _check_durable(durable: Optional[str]) -> None:
    """A mounted durable dir that `onbox run` would refuse (the root, a system directory) is refused here too."""
    from onbox.config import is_remote
    from onbox.launch.checks import DURABLE_HINT, durable_problem

    if durable and not is_remote(durable):
        problem = durable_problem(os.path.abspath(os.path.expanduser(durable)))
        if problem:
            raise UsageError("--durable %s %s" % (durable, problem), hint=DURABLE_HINT)


@click.command("sync", cls=LaidOut, examples=["onbox sync NAME                # once the newest checkpoint has settled",
                                             "onbox sync NAME --now --json   # at once"])
@click.argument("name")
@click.option("--now", is_flag=True, help="Do not wait for the settle interval (format checks still apply).")
@click.option("--durable", default=None, type=PathValue(), help="Durable target (path or rclone remote); default: the run's.")
@click.option("--ckpt-dir", default=None, type=PathValue(), help="Local checkpoint dir; default: the run's.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def sync(name: str, now: bool, durable: Optional[str], ckpt_dir: Optional[str], as_json: bool) -> None:
    """Commit run NAME's newest complete checkpoint to durable storage (MANIFEST.json last).

    Exit 0 only when the checkpoint is committed (or already was); 1 when the commit failed, with the reason.
    """
    from onbox.checkpoints import SyncFailed
    from onbox.checkpoints.hook import CheckpointCommitHook
    from onbox.checkpoints.hook.scheduler import summary
    from onbox.untrusted import printable

    ctx = _context(name, durable, ckpt_dir)
    if not ctx.config.durable:
        raise UsageError("run %r has no durable target" % name, hint="give --durable PATH or an rclone remote")
    hook = CheckpointCommitHook(ctx)
    complete = hook.scan_now(settle=0.0 if now else None)
    if not complete:  # the names are the trainer's (printable: one line, no terminal escapes)
        message, hint = _nothing_to_commit(name, ctx.ckpt_dir, hook, now)
        raise SyncFailed(printable(message), hint=hint)
    result = hook.commit_one(complete[-1])
    fence = hook.fenced()
    if result is None and fence is not None:
        from onbox.checkpoints.leases.fencing import Fenced

        e = Fenced(fence)
        raise SyncFailed(printable("commit of %s to %s refused: %s" % (complete[-1].name, ctx.config.durable,
                                                                      e.message)), hint=e.hint)
    if result is None or result.status == "source_changed":
        last = hook.status.get("last_sync") or {}
        raise SyncFailed(printable("commit of %s to %s FAILED: %s" % (
            complete[-1].name, ctx.config.durable, last.get("error") or "the file changed while copying")),
                         hint="the local checkpoint is untouched; see events.jsonl, fix the cause, re-run")
    if as_json:
        echo_json(summary(result))
        return
    if result.status == "already":
        echo_line("already committed: %s (step %s) at %s" % (result.name, result.step, result.url))
    else:
        echo_line("committed %s (step %s, %.1f MiB in %.2f s) to %s" % (
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


@click.command("checkpoints", cls=LaidOut, examples=[
    "onbox checkpoints NAME", "onbox checkpoints NAME --json",
    "onbox checkpoints --all --json   # every run's (what onboxctl pull and down read)"])
@click.argument("name", required=False)
@click.option("--all", "every", is_flag=True, help="Every run on this box (what `onboxctl pull` and `down` read); "
                                                  "an rclone remote is not asked then.")
@click.option("--durable", default=None, type=PathValue(), help="Durable target; default: the run's.")
@click.option("--ckpt-dir", default=None, type=PathValue(), help="Local checkpoint dir; default: the run's.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON (schema onbox.checkpoints/1 a run).")
def checkpoints(name: Optional[str], every: bool, durable: Optional[str], ckpt_dir: Optional[str],
                as_json: bool) -> None:
    """List run NAME's checkpoints (or every run's, --all): local (complete or why not) and durable (committed,
    with step and hash)."""
    from onbox.checkpoints.listing import LIST_SCHEMA

    if bool(name) == every:
        raise UsageError("give a run NAME or --all, not %s" % ("both" if every else "neither"),
                         hint="onbox checkpoints NAME [--json] · onbox checkpoints --all [--json]")
    if every and (durable or ckpt_dir):
        raise UsageError("--durable and --ckpt-dir name one run's dirs: not with --all")
    if not every:
        assert name is not None
        docs = [_listing(_context(name, durable, ckpt_dir, create=False))]
    else:
        docs = [_listing_or_problem(n) for n in _run_names()]
    if as_json:
        echo_json({"schema": LIST_SCHEMA, "runs": docs} if every else docs[0])
        return
    for doc in docs:
        if every:
            echo_line("== %s ==" % doc["run"])
        _print_listing(doc)


def _run_names() -> List[str]:
    """Every run dir on this box, config.json or not: a dir the agent cannot read is listed with its problem."""
    from onbox import paths

    problem = paths.home_problem()
    if problem:
        raise UsageError("ONBOX_HOME %s is unusable: %s" % (paths.onbox_home(), problem),
                         hint="point ONBOX_HOME at a directory (unset, it is ~/.onbox)")
    try:
        names = os.listdir(paths.runs_dir())
    except FileNotFoundError:
        return []  # nothing has run here yet
    except OSError as e:
        raise UsageError("cannot list %s: %s" % (paths.runs_dir(), e.strerror or e),
                         hint="check ONBOX_HOME and its permissions")
    return sorted(n for n in names if paths.valid_run_name(n) and os.path.isdir(paths.run_dir(n)))


def _listing(ctx: Any, ask_remote: bool = True) -> Dict[str, Any]:
    """onbox.checkpoints/1 of one run: the checkpoints package's listing, with the run's state and node role."""
    from onbox.checkpoints.listing import run_listing
    from onbox.supervisor.rundir import RunDir

    state, _corrupt = RunDir(ctx.run_dir).load_state()
    return run_listing(ctx, ask_remote=ask_remote, state=state, node=_node_of(ctx.config))


def _node_of(cfg: Any) -> Optional[Dict[str, Any]]:
    """{rank, run, nnodes} of a node of a multi-node group (never its key), None for a run of its own or a group
    file this box cannot read (the gate then judges the run as one of its own: the stricter reading)."""
    from onbox.multinode.role import load_group

    if not cfg.node_group:
        return None
    try:
        group = load_group(cfg.node_group)
    except UsageError:
        return None
    return {"rank": group.rank, "run": group.run, "nnodes": group.nnodes}


def _listing_or_problem(name: str) -> Dict[str, Any]:
    from onbox import paths
    from onbox.checkpoints.listing import blank
    from onbox.supervisor.rundir import RunDir

    try:
        return _listing(_context(name, None, None, create=False), ask_remote=False)
    except OnboxError as e:  # no config.json, a malformed one, --durable inside --ckpt-dir: said, not fatal
        return blank(name, RunDir(paths.run_dir(name)).load_state()[0], e.message)


def _print_listing(doc: Dict[str, Any]) -> None:
    if doc.get("problem"):
        echo_line("  %s" % doc["problem"])
        return
    echo_line("local (%s; %s):" % (doc["ckpt_dir"], "the trainer runs" if doc["trainer_alive"] else
                                   "no trainer running"))
    if doc["local_problem"]:
        echo_line("  WARNING: %s" % doc["local_problem"])
    for c in doc["local"]:
        echo_line("  %-40s step %-8s %10.1f MiB  %s" % (c["name"], c["step"], c["bytes"] / MiB,
                                                      ("complete, " if c["complete"] else "") + c["reason"]))
    echo_line("durable (%s):" % (doc["durable"] or "none configured"))
    if doc["committed"] is None:
        echo_line("  (a remote: `onbox checkpoints %s` lists it)" % doc["run"])
    for e in doc["committed"] or []:
        echo_line("  %-40s step %-8s %10.1f MiB  %s %s" % (e["name"], e.get("step"), (e.get("bytes") or 0) / MiB,
                                                         _verification(e), (e.get("digest") or "")[:12]))
    for m in doc["manifests"]:
        if m["problem"]:
            echo_line("  %-40s %s" % (m["name"], m["problem"]))
    last = doc["status"].get("last_sync")
    if last:
        echo_line("last sync: %s%s" % ("ok" if last.get("ok") else "FAILED", "" if last.get("ok") else
                                       ": %s" % last.get("error")))


def _verification(entry: Dict[str, Any]) -> str:
    """An index entry's verification state in a few words: at commit, or the newest re-check."""
    checks = (entry.get("verification") or {}).get("checks") or []
    if not checks:
        return "verified" if entry.get("verified") else "unverified"
    last = checks[-1]
    return "%s (re-checked %s by %s)" % ("verified" if last.get("result") == "passed" else "FAILED re-check",
                                         last.get("time"), last.get("by"))


@click.command("verify", cls=LaidOut, examples=[
    "onbox verify /workspace/durable/NAME              # every committed checkpoint of the run",
    "onbox verify /workspace/durable/NAME/checkpoints/CKPT --load --json"])
@click.argument("path", type=PathValue(click.Path(exists=True, dir_okay=True, file_okay=True)))
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

    from onbox.checkpoints.recheck import record_verification
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
            echo_line("%s %s%s%s" % (mark, row["path"], " [%s]" % row["kind"] if row["kind"] not in ("", "uncommitted")
                                     else "", ": %s" % detail if detail else ""))
        if report.step is not None:
            said = ""
            if report.has_manifest and report.manifest_step != report.step:
                said = "; the manifest says %s" % ("no step" if report.manifest_step is None else report.manifest_step)
            echo_line("step %d (read from %s%s)" % (report.step, report.step_source, said))
        if report.load_note:
            echo_line(report.load_note)
        for p in report.problems:
            echo_line("onbox: %s: %s" % (report.path, p), err=True)
        if report.ok:
            echo_line("verified: %s (%s)" % (report.path, "; ".join(report.checked)))
        else:
            echo_line("NOT VERIFIED: %s (%d problem(s))" % (report.path, len(report.problems)))
            if report.load_unavailable:
                echo_line("hint: run it where torch imports, or add --no-load-ok to accept the format and hash "
                          "checks alone", err=True)
        if recorded:
            echo_line("recorded in checkpoints_index.json: %s" % ", ".join(recorded))
        if warning:
            echo_line("onbox: warning: %s" % warning, err=True)
    if report.load_unavailable and len(report.problems) == 1:
        ctx.exit(int(ExitCode.UNFIT))  # nothing is known wrong with the checkpoint; this box cannot load it
    if not report.ok:
        ctx.exit(1)
