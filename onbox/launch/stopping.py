"""`onbox stop` as a plan and a start, like a launch: prepare_stop() reads the run and checks the request in the
foreground (a corrupt state.json, --timeout with --no-wait: exit 2, nothing written); stop(plan) acts. It writes
stop.request for the agent (a disk that refuses it: the stop signal instead), and then either the live agent stops
the run and stop() waits for it (bounded, on the clock seam), or no agent holds the run's lock and this process
stops the orphaned child itself through the supervisor's own stop procedure (detach.stop_without_agent).

Exit codes of what it raises: 1 when the wait ran out (the stop request stays: the agent still stops the run);
2 for bad input; 3 when ONBOX_HOME's disk keeps the stop from knowing or recording the end (read-only, full).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Dict, Optional

from onbox import vocab
from onbox.clock import Clock, SystemClock
from onbox.errors import JobFailed, OnboxError, UnfitError, UsageError
from onbox.supervisor.rundir import RunDir

STOP_MARGIN = 30.0  # seconds `onbox stop` waits beyond the grace for the agent's final commit and exit
POLL_S = 0.1  # how often the wait reads state.json and tries the run's lock


@dataclasses.dataclass
class StopPlan:
    """A stop checked and ready for stop(): the run, its state when asked, and what the command was told."""

    rd: RunDir
    state: Dict[str, Any]
    grace: Optional[float] = None  # --grace: the child's time to checkpoint (None: the run's own)
    wait: bool = True  # wait for the agent to finish (--no-wait: return once the live agent has the request)
    timeout: Optional[float] = None  # the wait's bound (None: the grace plus STOP_MARGIN)


@dataclasses.dataclass
class StopOutcome:
    """What stop() did: `outcome` is already_ended, nothing_to_stop, asked (--no-wait: the live agent has it) or
    stopped; `state` is state.json as it is now; with `asked`, the grace the agent applies and its own bound."""

    outcome: str
    state: Dict[str, Any]
    grace: Optional[float] = None
    wait_s: Optional[float] = None


def prepare_stop(rd: RunDir, grace: Optional[float] = None, wait: bool = True,
                 timeout: Optional[float] = None, corrupt_hint: str = "") -> StopPlan:
    """The stop of run `rd`, checked: nothing is written when it refuses."""
    if not wait and timeout is not None:
        raise UsageError("--timeout and --no-wait go separately",
                         hint="--no-wait returns at once; --timeout S waits at most S s")
    state, problem = rd.load_state()
    if problem:
        raise UsageError("run %s: %s is corrupt: %s" % (rd.name, rd.state_path, problem), hint=corrupt_hint or None)
    return StopPlan(rd, state or {}, grace, wait, timeout)


def stop(plan: StopPlan, clock: Optional[Clock] = None,
         warn: Callable[[str], None] = lambda line: None) -> StopOutcome:
    """Carry the stop out; `warn` gets each line worth a warning (a stop request the disk refused, a --grace a
    signal cannot carry)."""
    from onbox.proc import ProcessSeam
    from onbox.supervisor import detach

    clock = clock or SystemClock()
    rd, state, grace = plan.rd, plan.state, plan.grace
    if state.get("state") in detach.TERMINAL:  # the run has ended: nothing to ask, whether or not its agent is gone
        if plan.wait and detach.agent_alive(state):  # it ended a moment ago: its agent is finishing its records
            _wait_for_agent(rd, detach.RunLock(rd.lock_path), plan.timeout if plan.timeout is not None
                            else STOP_MARGIN, False, clock)
        return StopOutcome(vocab.STOP_ALREADY_ENDED, rd.read_state() or state)
    written = _write_stop_request(rd, grace, clock, warn)
    lock = detach.RunLock(rd.lock_path)
    if _take_lock(rd, lock):  # no live agent: stop the orphaned child ourselves, through the same supervisor path
        try:
            child = detach.live_child(rd, ProcessSeam())
            if child is None:
                _drop_stop_request(rd, written)
                now = rd.read_state() or state  # an agent that ended a moment ago has recorded how the run ended
                ended = now.get("state") in detach.TERMINAL
                return StopOutcome(vocab.STOP_ALREADY_ENDED if ended else vocab.STOP_NOTHING, now)
            from onbox import subsystems

            detach.stop_without_agent(rd, child, subsystems.make_hooks, grace, written)
        finally:
            lock.release()
    else:
        if not written:
            _signal_stop(rd, state, grace, warn)
        effective = effective_grace(rd, grace if written else None)  # a signal carries no --grace
        if not plan.wait:  # the live agent has the request (or the signal): it stops the run on its own
            return StopOutcome(vocab.STOP_ASKED, rd.read_state() or state, grace=effective,
                               wait_s=effective + STOP_MARGIN)
        _wait_for_agent(rd, lock, plan.timeout if plan.timeout is not None else effective + STOP_MARGIN, written,
                        clock)
    final = rd.read_state() or {}
    if final.get("state") not in detach.TERMINAL:  # the agent ended without recording how the run ended
        raise JobFailed("run %s: its agent has ended but the final state is not recorded (state.json still says %s)%s"
                        % (rd.name, final.get("state"), "; " + (detach.records_problem(rd, final, False) or "")),
                        hint="`onbox status %s` and its agent.log tell more" % rd.name)
    return StopOutcome(vocab.STOP_STOPPED, final)


def _wait_for_agent(rd: RunDir, lock: Any, bound: float, written: bool, clock: Clock) -> None:
    """Until the agent is gone (it held the run's lock for its whole life) or `bound` seconds have passed."""
    from onbox.supervisor import detach

    limit = clock.monotonic() + bound
    while True:
        state = rd.read_state() or {}
        if not detach.agent_alive(state) and (state.get("state") in detach.TERMINAL or lock.acquire()):
            lock.release()
            return
        if clock.monotonic() >= limit:  # not bad usage (2): the operation asked for did not finish
            raise wait_ran_out(rd, state, bound, written)
        clock.sleep(POLL_S)


def effective_grace(rd: RunDir, grace: Optional[float]) -> float:
    """The grace the agent will apply: --grace, else the run's configured grace, else the supervisor default."""
    from onbox.supervisor.stop import DEFAULT_GRACE

    if grace is not None:
        return grace
    try:
        raw = rd.load_config().get("grace")
        configured = float(raw) if raw is not None else None
    except (OSError, ValueError, TypeError):
        configured = None
    if configured is None or not math.isfinite(configured) or configured < 0:
        return DEFAULT_GRACE
    return min(configured, 86400.0)


def _write_stop_request(rd: RunDir, grace: Optional[float], clock: Clock, warn: Callable[[str], None]) -> bool:
    """stop.request for the agent; False when the disk refused it (full, failing, read-only): the stop then goes by
    signal (a live agent) or straight to the supervisor `onbox stop` runs itself."""
    from onbox import fsutil

    try:
        fsutil.atomic_write_json(rd.stop_request, {"grace": grace, "requested_at": clock.time()})
        return True
    except OSError as e:
        fault = fsutil.disk_fault(e)
        if fault is None:
            raise UsageError("cannot write the stop request %s: %s" % (rd.stop_request, e.strerror or e),
                             hint="check the permissions of %s" % rd.path)
        warn("cannot write %s (%s: %s): the stop goes to the agent without it" % (rd.stop_request, fault, e.strerror))
    return False


def _drop_stop_request(rd: RunDir, written: bool) -> None:
    if written:
        try:
            os.unlink(rd.stop_request)
        except FileNotFoundError:
            pass


def _signal_stop(rd: RunDir, state: Dict[str, Any], grace: Optional[float], warn: Callable[[str], None]) -> None:
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
            warn("--grace cannot go by signal: the run's own grace applies")
        return
    child = state.get("child_pid")
    raise JobFailed("run %s: cannot write the stop request and cannot signal its agent: %s" % (rd.name, why),
                    hint="free space on ONBOX_HOME (`df -h %s`) and run `onbox stop %s` again%s" % (
                        rd.path, rd.name, "; or stop the child's process group yourself: `kill -TERM -%s`"
                        % child if child else ""))


def _take_lock(rd: RunDir, lock: Any) -> bool:
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


def wait_ran_out(rd: RunDir, state: Dict[str, Any], waited: float, written: bool) -> OnboxError:
    """What `onbox stop` says when its wait runs out, as it is: the trainer may have stopped while its agent stays,
    unable to record it (a full or read-only ONBOX_HOME: the agent holds the final state in memory for up to
    final_sync_timeout) or still committing. "did not stop" is said only when the trainer has not stopped."""
    from onbox import fsutil, paths
    from onbox.proc import ProcessSeam
    from onbox.supervisor.detach import records_problem

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
    records = records_problem(rd, state, True)
    return JobFailed("run %s did not stop within %g s%s" % (rd.name, waited, "; " + records if records else ""),
                     hint="the %s and the agent still stops the run: `onbox status %s`; a stuck agent: `onbox logs "
                          "%s`, its agent.log" % ("stop request stays in place" if written else
                                                  "agent got the stop by signal", rd.name, rd.name))

