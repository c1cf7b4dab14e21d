"""The run lifecycle as one documented str-Enum: the states (their words and the terminal set are onbox/vocab.py's),
the legal transitions, the exit codes."""
from __future__ import annotations

import enum

from onbox import vocab


class RunState(str, enum.Enum):
    """The run's lifecycle. Transitions (anything else raises IllegalTransition):

    STARTING  -> RUNNING (the attempt's child was spawned) | FAILED (it could not be started)
                 | FENCED (a newer lease holds the run: no attempt starts)
    RUNNING   -> BACKOFF (it exited and the policy restarts it) | DONE | FAILED | STOPPING (a notice or stop)
                 | STARTING (a phase of a [[phase]] curriculum ended: the next phase's attempt starts at once, from
                   the ended phase's final checkpoint; not a restart, no backoff; phases.py)
                 | FENCED (the child had ended, and the final commit found a newer lease: nothing left to stop)
    BACKOFF   -> STARTING (the backoff elapsed) | STOPPING (a notice or stop while waiting)
    STOPPING  -> PREEMPTED (notice handled: checkpoint committed, exit 75) | STOPPED (`onbox stop`)
                 | FENCED (a newer lease holds the run: its trainer stopped, nothing committed, exit 1)
    DONE, FAILED, PREEMPTED, STOPPED, FENCED are terminal. A supervisor starts in STARTING, or RUNNING when it
    adopts. A fence (a newer lease on durable storage: another agent took the run over) becomes a stop like a
    notice's, with a grace of at most half a sync interval and no final commit; the run ends FENCED whatever
    stop was under way. A relaunch on this box is refused by the newer holder's live lease.
    """

    STARTING = vocab.STARTING
    RUNNING = vocab.RUNNING
    BACKOFF = vocab.BACKOFF
    STOPPING = vocab.STOPPING
    DONE = vocab.DONE
    FAILED = vocab.FAILED
    PREEMPTED = vocab.PREEMPTED
    STOPPED = vocab.STOPPED
    FENCED = vocab.FENCED

    @property
    def terminal(self) -> bool:
        return self.value in vocab.TERMINAL_STATES


TRANSITIONS = {
    RunState.STARTING: (RunState.RUNNING, RunState.FAILED, RunState.FENCED),
    RunState.RUNNING: (RunState.BACKOFF, RunState.DONE, RunState.FAILED, RunState.STOPPING, RunState.STARTING,
                       RunState.FENCED),
    RunState.BACKOFF: (RunState.STARTING, RunState.STOPPING),
    RunState.STOPPING: (RunState.PREEMPTED, RunState.STOPPED, RunState.FENCED),
}
TERMINAL_VALUES = vocab.TERMINAL_STATES  # what state.json says of a run that ended


class IllegalTransition(RuntimeError):
    def __init__(self, old: RunState, new: RunState) -> None:
        allowed = ", ".join(s.value for s in TRANSITIONS.get(old, ())) or "none (terminal)"
        super().__init__("illegal run state transition %s -> %s; allowed from %s: %s"
                         % (old.value, new.value, old.value, allowed))


def check_transition(old: RunState, new: RunState) -> None:
    if new not in TRANSITIONS.get(old, ()):
        raise IllegalTransition(old, new)


def wait_for(state: RunState, now: float, next_tick: float, backoff_until: float) -> float:
    """How long the loop may block before its next step (monotonic seconds): until the next tick, the backoff's end,
    not at all in STARTING, briefly in STOPPING (an adopted child sends no SIGCHLD, and the deadlines are close)."""
    t = next_tick - now
    if state == RunState.BACKOFF:
        t = min(t, backoff_until - now)
    if state == RunState.STOPPING:
        t = min(t, 0.05)
    if state == RunState.STARTING:
        t = 0.0
    return max(0.0, t)


def exit_code_for(state: RunState) -> int:
    """0 done/stopped · 1 failed or fenced · 75 preempted (README, exit codes)."""
    from onbox.errors import ExitCode

    return int({RunState.DONE: ExitCode.OK, RunState.STOPPED: ExitCode.OK, RunState.FAILED: ExitCode.JOB_FAILED,
                RunState.PREEMPTED: ExitCode.PREEMPTED}.get(state, ExitCode.JOB_FAILED))
