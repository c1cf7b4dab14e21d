"""`onbox status`, `ls`, `logs`, `stop`: read the run directories; `stop` asks the agent for a graceful stop.

Exit codes beyond 0: 2 for a bad name or value, an ONBOX_HOME that is not a directory, and a corrupt state.json
(a malformed file, like a malformed run file: `onbox status` still prints every other run first); 1 when
`onbox stop` gave up waiting (the stop request stays: the agent still stops the run); 3 when ONBOX_HOME's disk
keeps `onbox stop` from knowing or recording the end (read-only, full): the message says what did happen.

Past 400 lines on purpose: the four commands that read run directories share one summary of a run (state,
records, progress, checkpoint and lease lines), and `onbox stop`'s request/signal fallback sits beside the state it
reads; the views are data the commands print or dump as JSON.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

import click

from onbox.clikit import FiniteFloat, echo_json, echo_line
from onbox.errors import JobFailed, OnboxError, UnfitError, UsageError

STOP_MARGIN = 30.0  # seconds `onbox stop` waits beyond the grace for the agent's final commit and exit
# `onbox stop --json`: the run's state.json plus `outcome` (stopped, already_ended, nothing_to_stop, asked), and with
# `asked` the grace the agent applies and how long `onbox stop` would have waited (`wait_s`); onboxctl stop reads it
STOP_SCHEMA = "onbox.stop/1"
# `onbox status --json`: every run's state.json plus what this command adds (README.md, "What onboxctl reads");
# onboxctl reads it over ssh. Fields are added, never renamed: scripts read them too.
STATUS_SCHEMA = "onbox.status/1"


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
    """Why what state.json says may be stale: the run's filesystem cannot take writes now (the agent then holds
    the newest state in memory, onbox/supervisor/records.py). Checked with statvfs, for runs not known ended."""
    from onbox import fsutil, paths
    from onbox.supervisor.detach import TERMINAL

    if state.get("state") in TERMINAL and not alive:
        return None
    problem = fsutil.space_problem(rd.path)
    if not problem:
        return None
    return ("ONBOX_HOME's filesystem %s is %s: the agent cannot record this run's state, so what is shown may be "
            "stale; %s" % (paths.onbox_home(), problem,
                           "it supervises on and writes the state once there is space: free space there (`df -h`, "
                           "`df -i`)" if alive else "free space there, then `onbox status` again"))


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


@click.command()
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


@click.command()
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


@click.command()
@click.argument("name")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output until the run ends.")
@click.option("-n", "lines", type=click.IntRange(min=0), default=50, show_default=True,
              help="Lines from the end to show first.")
def logs(name: str, follow: bool, lines: int) -> int:
    """Show (or follow) run NAME's output log."""
    from onbox.supervisor.detach import TERMINAL, agent_alive
    from onbox.supervisor.rundir import LogTailer, tail_lines

    rd = _rundir(name)
    for line in tail_lines(rd.log_path, lines):
        click.echo(line)
    if not follow:
        return 0
    tailer = LogTailer(rd.log_path, from_end=True)
    while True:
        for line in tailer.read_new():
            click.echo(line)
        sys.stdout.flush()
        state = rd.read_state() or {}
        if state.get("state") in TERMINAL and not agent_alive(state):
            for line in tailer.read_new() + tailer.flush_partial():
                click.echo(line)
            return 0
        time.sleep(0.2)


def _effective_grace(rd: Any, grace: Optional[float]) -> float:
    """The grace the agent will apply: --grace, else the run's configured grace, else the supervisor default."""
    from onbox.supervisor.stop import DEFAULT_GRACE

    if grace is not None:
        return grace
    try:
        configured = float(rd.load_config().get("grace"))
    except (OSError, ValueError, TypeError):
        configured = None
    if configured is None or not math.isfinite(configured) or configured < 0:
        return DEFAULT_GRACE
    return min(configured, 86400.0)


def _write_stop_request(rd: Any, grace: Optional[float]) -> bool:
    """stop.request for the agent; False when the disk refused it (full, failing, read-only): the stop then goes by
    signal (a live agent) or straight to the supervisor `onbox stop` runs itself."""
    from onbox import fsutil

    try:
        fsutil.atomic_write_json(rd.stop_request, {"grace": grace, "requested_at": time.time()})
        return True
    except OSError as e:
        fault = fsutil.disk_fault(e)
        if fault is None:
            raise UsageError("cannot write the stop request %s: %s" % (rd.stop_request, e.strerror or e),
                             hint="check the permissions of %s" % rd.path)
        click.echo("onbox: warning: cannot write %s (%s: %s): the stop goes to the agent without it" % (
            rd.stop_request, fault, e.strerror), err=True)
    return False


def _drop_stop_request(rd: Any, written: bool) -> None:
    if written:
        try:
            os.unlink(rd.stop_request)
        except FileNotFoundError:
            pass


def _signal_stop(rd: Any, state: Dict[str, Any], grace: Optional[float]) -> None:
    """Ask the live agent to stop with STOP_SIGNAL: only the agent state.json names (pid AND start time) and only
    when it catches that signal (its default action would end the agent and leave the child unsupervised)."""
    from onbox.proc import ProcessSeam, ProcRef
    from onbox.supervisor.detach import lock_holder
    from onbox.supervisor.preempt import STOP_SIGNAL

    seam = ProcessSeam()
    pid, start = state.get("agent_pid"), state.get("agent_start_time")
    if not (isinstance(pid, int) and isinstance(start, int) and seam.start_time_of(pid) == start):
        holder = lock_holder(rd, seam)  # state.json may name an earlier agent: the one holding the lock counts
        pid, start = (holder.pid, holder.start_time) if holder else (None, None)
    why = None
    if not isinstance(pid, int) or not isinstance(start, int):
        why = "no live agent holds the run's lock"
    elif not seam.catches(pid, STOP_SIGNAL):
        why = "agent %d does not take the stop signal (an older onbox, or still starting)" % pid
    elif not seam.signal_process(ProcRef(pid, start), STOP_SIGNAL):
        why = "agent %d is gone" % pid
    if why is None:
        if grace is not None:
            click.echo("onbox: warning: --grace cannot go by signal: the run's own grace applies", err=True)
        return
    child = state.get("child_pid")
    raise JobFailed("run %s: cannot write the stop request and cannot signal its agent: %s" % (rd.name, why),
                    hint="free space on ONBOX_HOME (`df -h %s`) and run `onbox stop %s` again%s" % (
                        rd.path, rd.name, "; or stop the child's process group yourself: `kill -TERM -%s`"
                        % child if child else ""))


def _take_lock(rd: Any, lock: Any) -> bool:
    """The run's lock, taken (True: no live agent) or not (a live agent holds it). A lock file that cannot be opened
    or created (a read-only or full ONBOX_HOME without one) is said as what it is, not a traceback."""
    from onbox import fsutil, paths

    try:
        return bool(lock.acquire())
    except OSError as e:
        disk = fsutil.space_problem(rd.path)
        if fsutil.disk_fault(e) is None and not disk:
            raise UsageError("cannot open run %s's lock %s: %s" % (rd.name, rd.lock_path, e.strerror or e),
                             hint="check the permissions of %s" % rd.path)
        raise UnfitError("run %s: cannot tell whether its agent lives: its lock %s cannot be opened (%s) and "
                         "ONBOX_HOME %s is %s" % (rd.name, rd.lock_path, e.strerror or e, paths.onbox_home(),
                                                  disk or fsutil.disk_fault(e)),
                         hint="%s, then `onbox stop %s` again" % (_disk_fix(disk), rd.name))


def _disk_fix(disk: Optional[str]) -> str:
    """What makes ONBOX_HOME's filesystem take writes again, for a hint."""
    from onbox import paths

    home = paths.onbox_home()
    if disk == "read-only":
        return "remount ONBOX_HOME's filesystem (%s) read-write" % home
    return "free space on ONBOX_HOME (`df -h %s`, `df -i %s`)" % (home, home)


def _wait_ran_out(rd: Any, state: Dict[str, Any], waited: float, written: bool) -> OnboxError:
    """What `onbox stop` says when its wait runs out, as it is: the trainer may have stopped while its agent stays,
    unable to record it (a full or read-only ONBOX_HOME: the agent holds the final state in memory for up to
    final_sync_timeout) or still committing. "did not stop" is said only when the trainer has not stopped."""
    from onbox import fsutil, paths
    from onbox.proc import ProcessSeam

    child, start = state.get("child_pid"), state.get("child_start_time")
    stopped = isinstance(child, int) and isinstance(start, int) and ProcessSeam().start_time_of(child) != start
    disk = fsutil.space_problem(rd.path)
    if stopped and disk:
        return UnfitError("run %s: its trainer has stopped (child %s ended), but its final state is not recorded: "
                          "ONBOX_HOME's filesystem %s is %s; the agent (pid %s) holds it and writes it, then exits, "
                          "once the disk takes it" % (rd.name, child, paths.onbox_home(), disk,
                                                      state.get("agent_pid") or "?"),
                          hint="%s: `onbox status %s` then shows how the run ended and its final commit" % (
                              _disk_fix(disk), rd.name))
    if stopped:
        return JobFailed("run %s: its trainer has stopped (child %s ended), but its agent is still finishing after "
                         "%g s (the final commit)" % (rd.name, child, waited),
                         hint="`onbox status %s` follows it; a stuck agent: `onbox logs %s`, its agent.log" % (
                             rd.name, rd.name))
    records = _records_problem(rd, state, True)
    return JobFailed("run %s did not stop within %g s%s" % (rd.name, waited, "; " + records if records else ""),
                     hint="the %s and the agent still stops the run: `onbox status %s`; a stuck agent: `onbox logs "
                          "%s`, its agent.log" % ("stop request stays in place" if written else
                                                  "agent got the stop by signal", rd.name, rd.name))


def _stop_doc(state: Dict[str, Any], outcome: str, **extra: Any) -> Dict[str, Any]:
    """What `onbox stop --json` prints: state.json as it is now, with the schema and what the command did."""
    return dict(state, schema=STOP_SCHEMA, outcome=outcome, **extra)


@click.command()
@click.argument("name")
@click.option("--grace", type=FiniteFloat(0.0, 86400.0),
              help="Seconds the child gets to checkpoint before the hard kill (0-86400; default: the run's).")
@click.option("--wait", type=FiniteFloat(0.0, 86400.0),
              help="Seconds to wait for the agent to finish (0-86400; default: the grace plus 30).")
@click.option("--no-wait", is_flag=True,
              help="Return once the live agent has the request (it stops the run on its own; `onbox status NAME` "
                   "follows it). A run without a live agent is still stopped before this returns.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one document: the run's state and what was done (outcome: stopped, already_ended, "
                   "nothing_to_stop, asked).")
def stop(name: str, grace: Optional[float], wait: Optional[float], no_wait: bool, as_json: bool) -> int:
    """Stop run NAME gracefully: checkpoint signal, final commit, exit; no restart.

    Waits for the agent (--wait, default the grace plus 30 s; --no-wait: not at all). Exit 0 when the run stopped
    (or had already ended, or the live agent has the request with --no-wait); 1 when the wait ran out: the stop
    request stays in place and the agent still stops the run (`onbox status NAME`), or the trainer has stopped and
    the agent is still finishing (the final commit); 2 for bad input, an unknown run or a corrupt state.json; 3
    when ONBOX_HOME's filesystem is full or read-only and the trainer has stopped but its agent cannot record the
    end (it does once the disk takes writes), or the run's lock cannot be opened there.
    """
    from onbox.proc import ProcessSeam
    from onbox.supervisor import detach

    if no_wait and wait is not None:
        raise UsageError("--wait and --no-wait go separately", hint="--no-wait returns at once; --wait S waits S s")
    rd = _rundir(name)
    state, problem = rd.load_state()
    if problem:
        raise UsageError("run %s: %s is corrupt: %s" % (name, rd.state_path, problem), hint=corrupt_hint(rd))
    state = state or {}
    if state.get("state") in detach.TERMINAL and not detach.agent_alive(state):
        if as_json:
            echo_json(_stop_doc(state, "already_ended"))
        else:
            echo_line("%s is already %s" % (name, state.get("state")))
        return 0
    written = _write_stop_request(rd, grace)
    lock = detach.RunLock(rd.lock_path)
    if _take_lock(rd, lock):  # no live agent: stop the orphaned child ourselves, through the same supervisor path
        child = detach.live_child(rd, ProcessSeam())
        if child is None:
            lock.release()
            _drop_stop_request(rd, written)
            now = rd.read_state() or state  # an agent that ended a moment ago has recorded how the run ended
            ended = now.get("state") in detach.TERMINAL
            if as_json:
                echo_json(_stop_doc(now, "already_ended" if ended else "nothing_to_stop"))
            elif ended:
                echo_line("%s is already %s" % (name, now.get("state")))
            else:
                echo_line("%s has no live agent and no live child; nothing to stop" % name)
            return 0
        try:
            from onbox import subsystems

            detach.stop_without_agent(rd, child, subsystems.make_hooks, grace, written)
        finally:
            lock.release()
    else:
        if not written:
            _signal_stop(rd, state, grace)
        effective = _effective_grace(rd, grace if written else None)  # a signal carries no --grace
        waited = wait if wait is not None else effective + STOP_MARGIN
        if no_wait:  # the live agent has the request (or the signal): it stops the run on its own
            now = rd.read_state() or state
            if as_json:
                echo_json(_stop_doc(now, "asked", grace=effective, wait_s=effective + STOP_MARGIN))
            else:
                echo_line("%s: stop asked (grace %g s); `onbox status %s` follows it" % (name, effective, name))
            return 0
        limit = time.monotonic() + waited
        while True:
            state = rd.read_state() or {}
            if not detach.agent_alive(state) and (state.get("state") in detach.TERMINAL or lock.acquire()):
                lock.release()  # the agent is gone (it held the lock for its whole life)
                break
            if time.monotonic() >= limit:  # not bad usage (2): the operation asked for did not finish
                raise _wait_ran_out(rd, state, waited, written)
            time.sleep(0.1)
    final = rd.read_state() or {}
    if final.get("state") not in detach.TERMINAL:  # the agent ended without recording how the run ended
        raise JobFailed("run %s: its agent has ended but the final state is not recorded (state.json still says %s)%s"
                        % (name, final.get("state"), "; " + (_records_problem(rd, final, False) or "")),
                        hint="`onbox status %s` and its agent.log tell more" % name)
    if as_json:
        echo_json(_stop_doc(final, "stopped"))
    else:
        echo_line("%s: %s" % (name, final.get("state")))
        echo_line("  %s" % _committed_line(rd, final))
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
    from onbox.config import RunConfig

    try:
        cfg = RunConfig.from_dict(rd.load_config(), "config.json")
    except (OSError, ValueError, TypeError, OnboxError):
        return nothing_committed(status.get("durable"), status)
    ckpt_dir = state.get("ckpt_dir") or cfg.ckpt_dir or rd.file(paths.CHECKPOINTS_DIR)
    why = diagnose(ckpt_dir, cfg, _read_doc(rd.file(paths.PROGRESS_FILE)))
    return nothing_committed(status.get("durable") or cfg.durable, status, why)
