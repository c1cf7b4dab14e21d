"""`onbox status`, `ls`, `logs`, `stop`: read the run directories; `stop` asks the agent for a graceful stop.

Exit codes beyond 0: 2 for a bad name or value, an ONBOX_HOME that is not a directory, and a corrupt state.json
(a malformed file, like a malformed run file: `onbox status` still prints every other run first); 1 when
`onbox stop` gave up waiting (the stop request stays: the agent still stops the run); 3 when ONBOX_HOME's disk
keeps `onbox stop` from knowing or recording the end (read-only, full): the message says what did happen.

The four commands that read run directories share one summary of a run (state, records, progress, checkpoint and
lease lines); `onbox stop` is a thin command over onbox/launch/stopping.py (prepare_stop, then stop), as `onbox run`
is over onbox/launch (prepare, then start).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

import click

from onbox import vocab
from onbox.clikit import FiniteFloat, LaidOut, echo_json, echo_line
from onbox.errors import OnboxError, UsageError

# `onbox stop --json`: the run's state.json plus `outcome` (stopped, already_ended, nothing_to_stop, asked), and with
# `asked` the grace the agent applies and how long `onbox stop` would have waited (`wait_s`); onboxctl stop reads it
STOP_SCHEMA = vocab.SCHEMA_STOP
# `onbox status --json`: every run's state.json plus what this command adds (README.md, "What onboxctl reads");
# onboxctl reads it over ssh. Fields are added, never renamed: scripts read them too.
STATUS_SCHEMA = vocab.SCHEMA_STATUS


def _check_home() -> None:
    """ONBOX_HOME must be (or become) a directory: a regular file there used to read as "no runs", exit 0."""
    from onbox import paths

    problem = paths.home_problem()
    if problem:
        raise UsageError("ONBOX_HOME %s is unusable: %s" % (paths.onbox_home(), problem),
                         hint="point ONBOX_HOME at a directory (unset, it is ~/.onbox)")


def _rundir(name: str) -> Any:
    from onbox import paths
    from onbox.supervisor.rundir import RunDir

    if not paths.valid_run_name(name):
        raise UsageError("invalid run name %r" % name)
    _check_home()
    rd = RunDir(paths.run_dir(name))
    if not rd.exists():
        raise UsageError("no run named %s in %s" % (name, paths.runs_dir()), hint="`onbox ls` lists runs")
    return rd


def corrupt_hint(rd: Any) -> str:
    return ("state.json is written atomically, so this is a damaged disk or a hand edit. If the agent runs (`cat "
            "%s` names its pid), its next state change rewrites the file; if not, move the file aside (`mv %s "
            "%s.corrupt`), check that no process of the run is left (`onbox reap`, `ps`), then `onbox run --name %s` "
            "relaunches it from config.json and resumes from the newest checkpoint" % (
                rd.lock_path, rd.state_path, rd.state_path, rd.name))


def _summary(rd: Any) -> Dict[str, Any]:
    from onbox import paths
    from onbox.proc import ProcessSeam
    from onbox.supervisor.detach import TERMINAL, agent_alive, lock_holder

    state, problem = rd.load_state()
    if problem:
        return {"schema": STATUS_SCHEMA, "run": rd.name, "state": "corrupt", "agent_alive": False, "progress": None,
                "checkpoint": None, "corrupt": "%s is corrupt: %s" % (rd.state_path, problem),
                "hint": corrupt_hint(rd)}
    if state is None:
        state = {"run": rd.name, "state": "unknown",
                 "note": "no state.json: the run never started (or its agent died before writing one); "
                         "`onbox run --name %s` starts it" % rd.name}
    state["schema"] = STATUS_SCHEMA
    alive = agent_alive(state)
    if not alive and state.get("state") not in TERMINAL and state.get("state") != "unknown":
        holder = lock_holder(rd, ProcessSeam())
        if holder is not None:  # a newer agent that could not record itself yet (a full disk)
            alive = True
            state["agent_pid"], state["agent_start_time"] = holder.pid, holder.start_time
    state["agent_alive"] = alive
    deadline = state.get("deadline")
    if isinstance(deadline, dict) and isinstance(deadline.get("at"), (int, float)):  # the time left now
        state["deadline"] = dict(deadline, left_s=round(deadline["at"] - time.time(), 3))
    records = _records_problem(rd, state, alive)
    if records:
        state["records_problem"] = records
    # what the subsystems recorded beside state.json (hooks.RunContext): newest metrics and checkpoints
    for key, filename in (("progress", paths.PROGRESS_FILE), ("checkpoint", paths.CHECKPOINT_STATUS_FILE),
                          ("mlflow", paths.MLFLOW_RUN_FILE)):
        state[key] = _read_doc(rd.file(filename))
    # the box's clock, for onboxctl status's BEAT: when this was read, and the agent's newest beat (its seq file)
    state["read_at"] = time.time()
    try:
        state["beat_at"] = os.stat(rd.file(paths.HEARTBEAT_SEQ_FILE)).st_mtime
    except OSError:
        state["beat_at"] = None
    # the run's lease on durable storage (onbox/checkpoints/leases/fencing.py): {epoch, holder, renewed_at, ...}
    lease = (state.get("checkpoint") or {}).get("lease")
    state["lease"] = lease if isinstance(lease, dict) else None
    if not alive and state.get("state") not in TERMINAL and state.get("state") != "unknown":
        state["note"] = "the agent is not running: `onbox adopt %s` re-attaches to a live child" % rd.name
        if records:
            state["note"] += "; %s" % records
    elif records:
        state["note"] = records
    return state


def _records_problem(rd: Any, state: Dict[str, Any], alive: bool) -> Optional[str]:
    from onbox.supervisor.detach import records_problem

    return records_problem(rd, state, alive)


def _read_doc(path: str) -> Optional[Dict[str, Any]]:
    from onbox.fsutil import read_json

    try:
        doc = read_json(path)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _progress_line(p: Optional[Dict[str, Any]]) -> Optional[str]:
    if not p:
        return None
    parts = ["%s %s" % (label, p[key]) for key, label in (("step", "step"), ("loss", "loss"),
                                                           ("eval_loss", "eval loss"), ("tokens_per_s", "tokens/s"),
                                                           ("samples_per_s", "samples/s")) if p.get(key) is not None]
    return ", ".join(parts) or None


def _checkpoint_line(c: Optional[Dict[str, Any]]) -> Optional[str]:
    if not c:
        return None

    def name(entry: Any) -> str:
        return "%s (step %s)" % (entry.get("name"), entry.get("step")) if isinstance(entry, dict) else "none"

    line = "newest local %s · durable %s" % (name(c.get("latest_local")), name(c.get("latest_durable")))
    chosen = c.get("selection")
    for key, flag in (("patterns", "--ckpt-pattern"), ("ignore", "--ckpt-ignore")):  # what the user said counts
        globs = chosen.get(key) if isinstance(chosen, dict) else None
        if isinstance(globs, list) and globs:
            line += " · %s %s" % (flag, " ".join(repr(str(g)) for g in globs))
    last = c.get("last_sync") or {}
    if last.get("ok") is False:
        line += " · LAST SYNC FAILED: %s" % last.get("error")  # U33: never let a failed sync look fine
    if c.get("warning"):
        line += " · WARNING: %s" % c["warning"]
    if isinstance(c.get("unreadable"), dict):  # the last sync's "ok" says nothing of a newer checkpoint it skipped
        line += " · NEWEST UNREADABLE, NOT COMMITTED: %s (%s)" % (c["unreadable"].get("name"),
                                                                c["unreadable"].get("problem"))
    return line


def _lease_line(lease: Any, fenced: Any) -> Optional[str]:
    """The run's lease in words: held (epoch, holder, renewed how long ago), or FENCED by whom."""
    from onbox.checkpoints.leases import renewed_ago

    fence = fenced if isinstance(fenced, dict) else (lease or {}).get("fenced") if isinstance(lease, dict) else None
    if isinstance(fence, dict):
        return "FENCED: lease epoch %s of %s%s holds the run now (this agent had epoch %s)" % (
            fence.get("newer_epoch"), fence.get("newer_holder"),
            " on %s" % fence["host"] if fence.get("host") else "", fence.get("epoch"))
    if not isinstance(lease, dict):
        return None
    renewed = lease.get("renewed_at")
    ago = " " + renewed_ago(time.time(), renewed) if isinstance(renewed, (int, float)) else ""
    return "epoch %s held by %s, renewed%s%s" % (lease.get("epoch"), lease.get("holder"), ago,
                                                 " (ttl %.0f s)" % lease["ttl"] if isinstance(lease.get("ttl"),
                                                                                              (int, float)) else "")


def _all_runs() -> List[Any]:
    from onbox import paths
    from onbox.supervisor.rundir import RunDir

    _check_home()
    root = paths.runs_dir()
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []  # nothing has run here yet
    except OSError as e:
        raise UsageError("cannot list %s: %s" % (root, e.strerror or e), hint="check ONBOX_HOME and its permissions")
    return [RunDir(os.path.join(root, n)) for n in names if os.path.isfile(os.path.join(root, n, paths.CONFIG_FILE))]


@click.command(cls=LaidOut, examples=["onbox status              # every run on this box",
                                      "onbox status NAME         # one run: state, step, checkpoints, lease",
                                      "onbox status NAME --json  # what onboxctl reads (schema onbox.status/1)"])
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print state.json (plus agent liveness) as JSON.")
def status(name: Optional[str], as_json: bool) -> int:
    """State of run NAME, or of every run.

    Exit 0; 2 for an unknown or invalid name, an ONBOX_HOME that is not a directory, or a run whose state.json
    is corrupt (every other run is printed first; the corrupt one says how to recover).
    """
    if name:
        rd = _rundir(name)
        docs = [_summary(rd)]
        _say_nothing_committed(rd, docs[0])
    else:
        docs = [_summary(rd) for rd in _all_runs()]
    if as_json:
        echo_json(docs[0] if name else docs)
    else:
        _print_status(docs)
    corrupt = [d for d in docs if d.get("corrupt")]
    if corrupt:
        raise UsageError("run %s: %s" % (corrupt[0]["run"], corrupt[0]["corrupt"]) + (
            " (and %d more run(s))" % (len(corrupt) - 1) if len(corrupt) > 1 else ""), hint=corrupt[0]["hint"])
    return 0


def _say_nothing_committed(rd: Any, doc: Dict[str, Any]) -> None:
    """`nothing_committed` (one line: why) in the status of one run that has ended without a durable checkpoint:
    what `onboxctl stop --wait` says then. Only for a named run: it scans the run's checkpoint dir."""
    from onbox.supervisor.detach import TERMINAL

    ckpt = doc.get("checkpoint") if isinstance(doc.get("checkpoint"), dict) else {}
    if doc.get("state") in TERMINAL and not doc.get("agent_alive") and not (ckpt or {}).get("latest_durable"):
        doc["nothing_committed"] = _nothing_committed(rd, doc, ckpt or {})


def _print_status(docs: List[Dict[str, Any]]) -> None:
    from onbox.supervisor.runsummary import LIVE, deadline_line, has_metrics, phase_line

    for doc in docs:
        if doc.get("corrupt"):
            echo_line("%s: CORRUPT — %s" % (doc.get("run"), doc["corrupt"]))
            continue
        last = doc.get("last_exit") or {}
        echo_line("%s: %s (attempt %s, restarts %s, child %s, agent %s)" % (
            doc.get("run"), doc.get("state"), doc.get("attempt"), doc.get("restarts"), doc.get("child_pid") or "-",
            "alive" if doc.get("agent_alive") else "not running"))
        for label, line in (("progress", _progress_line(doc.get("progress"))),
                            ("lease", _lease_line(doc.get("lease"), doc.get("fenced"))),
                            ("phase", phase_line(doc["phase"]) if isinstance(doc.get("phase"), dict) else None),
                            ("checkpoint", _checkpoint_line(doc.get("checkpoint"))),
                            ("deadline", deadline_line(doc["deadline"], time.time(), doc.get("state") in LIVE)
                             if isinstance(doc.get("deadline"), dict) else None),
                            ("mlflow", (doc.get("mlflow") or {}).get("run_url"))):
            if line:
                echo_line("  %s: %s" % (label, line))
        if last:
            echo_line("  last exit: %s — %s" % (last.get("classification"), last.get("message")))
        if doc.get("message"):
            echo_line("  %s" % doc["message"])
        for w in doc.get("warnings") or []:
            if isinstance(w, dict) and not (w.get("code") == "no_metrics" and has_metrics(doc.get("progress"))):
                echo_line("  %s: %s%s" % ("WARNING" if w.get("severity") == "critical" else "warning",
                                          w.get("message"), (" — %s" % w["hint"]) if w.get("hint") else ""))
        if doc.get("nothing_committed"):
            echo_line("  %s" % doc["nothing_committed"])
        if doc.get("note"):
            echo_line("  note: %s" % doc["note"])


@click.command(cls=LaidOut, examples=["onbox ls         # run, state, attempt, child PID, last update",
                                      "onbox ls --json  # the same, one object a run"])
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def ls(as_json: bool) -> int:
    """List runs on this box."""
    rows = [_summary(rd) for rd in _all_runs()]
    if as_json:
        echo_json([{k: r.get(k) for k in ("run", "state", "attempt", "child_pid", "agent_alive", "updated_at")}
                   for r in rows])
        return 0
    echo_line("%-40s %-10s %-7s %-8s %s" % ("RUN", "STATE", "ATTEMPT", "CHILD", "UPDATED"))
    for r in rows:
        upd = r.get("updated_at")
        echo_line("%-40s %-10s %-7s %-8s %s" % (
            r.get("run"), r.get("state"), r.get("attempt"), r.get("child_pid") or "-",
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(upd)) if isinstance(upd, (int, float)) else "-"))
    return 0


@click.command(cls=LaidOut, examples=["onbox logs NAME         # its last 50 lines", "onbox logs NAME -n 500",
                                      "onbox logs NAME -f      # and what follows, until the run ends"])
@click.argument("name")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output until the run ends.")
@click.option("-n", "lines", type=click.IntRange(min=0), default=50, show_default=True,
              help="Lines from the end to show first.")
def logs(name: str, follow: bool, lines: int) -> int:
    """Show (or follow) run NAME's output log."""
    from onbox.clock import SystemClock
    from onbox.supervisor.detach import TERMINAL, agent_alive
    from onbox.supervisor.rundir import LogTailer, tail_lines

    rd = _rundir(name)
    for line in tail_lines(rd.log_path, lines):
        click.echo(line)
    if not follow:
        return 0
    tailer = LogTailer(rd.log_path, from_end=True)
    clock = SystemClock()
    while True:
        for line in tailer.read_new():
            click.echo(line)
        sys.stdout.flush()
        state = rd.read_state() or {}
        if state.get("state") in TERMINAL and not agent_alive(state):
            for line in tailer.read_new() + tailer.flush_partial():
                click.echo(line)
            return 0
        clock.sleep(0.2)


def _stop_doc(state: Dict[str, Any], outcome: str, **extra: Any) -> Dict[str, Any]:
    """What `onbox stop --json` prints: state.json as it is now, with the schema and what the command did."""
    return dict(state, schema=STOP_SCHEMA, outcome=outcome, **extra)


STOP_EXAMPLES = [
    "onbox stop NAME                       # wait until it has stopped (at most its grace plus 30 s)",
    "onbox stop NAME --grace 120 --timeout 600",
    "onbox stop NAME --no-wait --json      # return once the agent has the request",
]


@click.command(cls=LaidOut, examples=STOP_EXAMPLES, renamed_values={"--wait": "--timeout"})
@click.argument("name")
@click.option("--grace", type=FiniteFloat(0.0, 86400.0), metavar="SECONDS",
              help="Seconds the child gets to checkpoint before the hard kill (0-86400; default: the run's).")
@click.option("--wait/--no-wait", default=True,
              help="Wait for the agent to finish (the default), or return once the live agent has the request (it "
                   "stops the run on its own; `onbox status NAME` follows it). A run without a live agent is still "
                   "stopped before this returns.")
@click.option("--timeout", type=FiniteFloat(0.0, 86400.0), metavar="SECONDS",
              help="The longest wait (0-86400; default: the grace plus 30). `--wait SECONDS` is its old, deprecated "
                   "spelling.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one document: the run's state and what was done (outcome: stopped, already_ended, "
                   "nothing_to_stop, asked).")
def stop(name: str, grace: Optional[float], wait: bool, timeout: Optional[float], as_json: bool) -> int:
    """Stop run NAME gracefully: checkpoint signal, final commit, exit; no restart.

    Exit 0 when the run stopped (or had already ended, or the live agent has the request with --no-wait); 1 when
    the wait ran out: the stop request stays in place and the agent still stops the run (`onbox status NAME`), or
    the trainer has stopped and the agent is still finishing (the final commit); 2 for bad input, an unknown run or
    a corrupt state.json; 3 when ONBOX_HOME's filesystem is full or read-only and the trainer has stopped but its
    agent cannot record the end (it does once the disk takes writes), or the run's lock cannot be opened there.
    """
    from onbox.launch.stopping import prepare_stop
    from onbox.launch.stopping import stop as stop_run

    rd = _rundir(name)
    plan = prepare_stop(rd, grace, wait, timeout, corrupt_hint(rd))
    done = stop_run(plan, warn=lambda line: click.echo("onbox: warning: %s" % line, err=True))
    if as_json:
        extra = {"grace": done.grace, "wait_s": done.wait_s} if done.outcome == vocab.STOP_ASKED else {}
        echo_json(_stop_doc(done.state, done.outcome, **extra))
    elif done.outcome == vocab.STOP_ALREADY_ENDED:
        echo_line("%s is already %s" % (name, done.state.get("state")))
    elif done.outcome == vocab.STOP_NOTHING:
        echo_line("%s has no live agent and no live child; nothing to stop" % name)
    elif done.outcome == vocab.STOP_ASKED:
        echo_line("%s: stop asked (grace %g s); `onbox status %s` follows it" % (name, done.grace or 0.0, name))
    else:
        echo_line("%s: %s" % (name, done.state.get("state")))
        echo_line("  %s" % _committed_line(rd, done.state))
    return 0


def _committed_line(rd: Any, state: Dict[str, Any]) -> str:
    """The run's newest durable checkpoint, or why nothing was committed (the checkpoint hook's word, else what is
    in its checkpoint dir now that the trainer has stopped: onbox/checkpoints/local/whynone.py)."""
    from onbox import paths

    status = _read_doc(rd.file(paths.CHECKPOINT_STATUS_FILE)) or {}
    latest = status.get("latest_durable")
    if isinstance(latest, dict) and latest.get("name"):
        return "newest durable checkpoint: %s%s%s" % (latest["name"], " (step %s)" % latest["step"] if latest.get(
            "step") is not None else "", " in %s" % status["durable"] if status.get("durable") else "")
    return _nothing_committed(rd, state, status)


def _nothing_committed(rd: Any, state: Dict[str, Any], status: Dict[str, Any]) -> str:
    """Why the run has no committed checkpoint, in one line (whynone.nothing_committed over what the box knows)."""
    from onbox import paths
    from onbox.checkpoints.local.whynone import diagnose, nothing_committed

    try:
        cfg = rd.run_config(validate=False)
    except (OSError, ValueError, TypeError, OnboxError):
        return nothing_committed(status.get("durable"), status)
    ckpt_dir = state.get("ckpt_dir") or paths.ckpt_dir(cfg.ckpt_dir, rd.path)
    why = diagnose(ckpt_dir, cfg, _read_doc(rd.file(paths.PROGRESS_FILE)))
    return nothing_committed(status.get("durable") or cfg.durable, status, why)
