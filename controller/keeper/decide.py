"""The keeper's judgement of one run, as a pure function of what it observed: no ssh, no clock, no files.

    observed (per box of the run)                           beats (tracker)     verdict
    ------------------------------------------------------  ------------------  ---------------------------------
    answers, agent alive                                     any                 HEALTHY
    answers, run done or stopped                             any                 ENDED (nothing to recover)
    answers, run failed by its own restart policy            any                 ENDED (a relaunch repeats it)
    answers, run fenced (a newer lease holds it)             any                 ENDED (it lives elsewhere now)
    answers, run preempted                                   any                 RELAUNCH_HERE
    answers, agent gone, run not ended (SIGKILLed agent)     any                 RELAUNCH_HERE (re-adopts a live child)
    answers, its agent has no such run (a reset box)         any                 RELAUNCH_HERE (pushed first)
    answers, but the agent's records are unreadable          any                 WAIT (a person decides)
    fails ssh                                                ok                  SUSPECT (beats arrive: not lost)
    fails ssh for less than --lost-after                     not ok              SUSPECT
    fails ssh for --lost-after or longer                     unreadable          WAIT (said; never LOST, see below)
    fails ssh for --lost-after or longer                     late/none           LOST (recover elsewhere)

A box that answers ssh is never declared lost. "late/none" is every liveness but `ok` and `unreadable`: late,
silent, ended, a run the tracker lists no beat of (`absent`), and no tracker configured at all (`unknown`: then
ssh alone decides). `unreadable` is a tracker that is configured but could not be read (down, an error page,
garbage, a document past the reader's bounds, or a run list the keeper cannot use for this run): "I could not read
the beats" is never "the beats stopped", so a box that fails ssh then is waited for (still SUSPECT: its suspicion
is kept, and decided on the beats once they read again), never taken over; a healthy run behind a broken sshd
must not be fenced because its tracker broke too. A group (`--nodes`) is judged as one: any node LOST makes the
group LOST (it recovers whole, on fresh boxes), any node SUSPECT keeps it SUSPECT, a live agent on any node keeps it
HEALTHY (the nodes stop together), and with every agent gone node 0's run decides.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Sequence

TERMINAL = ("done", "failed", "preempted", "stopped", "fenced")


class Verdict(str, enum.Enum):
    HEALTHY = "healthy"
    ENDED = "ended"
    RELAUNCH_HERE = "relaunch_here"
    WAIT = "wait"
    SUSPECT = "suspect"
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class Observation:
    """One box's answer about one run (`onbox status RUN --json` over ssh), or that ssh did not reach it."""

    box: str
    run: str
    reached: bool
    known: bool = False  # the box's agent has the run
    state: Optional[str] = None
    agent_alive: bool = False
    fenced: bool = False
    problem: Optional[str] = None  # the box answers, but its agent's word on the run is not usable
    step: Optional[int] = None
    step_time: Optional[float] = None  # when the newest step was seen (the box's clock)
    attempt_started: Optional[float] = None  # when the newest attempt started (the box's clock)
    durable_step: Optional[int] = None
    durable_at: Optional[float] = None
    lease: Optional[Dict[str, Any]] = None
    resumed_step: Optional[int] = None  # the step of the checkpoint the newest attempt resumed from
    error: Optional[str] = None  # why ssh failed


UNKNOWN = "unknown"  # no tracker configured for the run: ssh alone decides
UNREADABLE = "unreadable"  # a tracker is configured, but its word on the run could not be read
LIVENESS = ("ok", "late", "silent", "ended")  # what the tracker says of a run it lists (controller/tracker/API.md)


@dataclasses.dataclass(frozen=True)
class Beats:
    """The tracker's word on a run: liveness ok | late | silent | ended | absent (not listed) | unreadable (see
    the module docstring; `problem` says why) | unknown (no tracker to ask)."""

    liveness: str = UNKNOWN
    state: Optional[str] = None
    step: Optional[int] = None
    durable_step: Optional[int] = None
    durable_at: Optional[float] = None
    box: Optional[str] = None
    problem: Optional[str] = None  # why the beats are unreadable

    @property
    def ok(self) -> bool:
        return self.liveness == "ok"

    @property
    def unreadable(self) -> bool:
        return self.liveness == UNREADABLE


@dataclasses.dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str
    box: Optional[str] = None  # the box the reason is about
    needs_push: bool = False  # RELAUNCH_HERE on a box whose agent does not know the run
    tracker: bool = False  # WAIT because the beats could not be read (the keeper stays SUSPECT, says it once)


def judge_box(obs: Observation, beats: Beats, suspect_since: Optional[float], now: float,
              lost_after: float) -> Judgement:
    """One box and its run (the table in the module docstring)."""
    if obs.reached:
        if obs.problem:
            return Judgement(Verdict.WAIT, "%s answers, but %s" % (obs.box, obs.problem), obs.box)
        if not obs.known:
            return Judgement(Verdict.RELAUNCH_HERE, "%s answers, but its agent has no run %s" % (obs.box, obs.run),
                             obs.box, needs_push=True)
        if obs.agent_alive:
            return Judgement(Verdict.HEALTHY, "%s: the agent of %s is alive (%s)" % (obs.box, obs.run, obs.state),
                             obs.box)
        if obs.fenced or obs.state == "fenced":
            return Judgement(Verdict.ENDED, "%s: %s was fenced (a newer lease holds the run)" % (obs.box, obs.run),
                             obs.box)
        if obs.state in ("done", "stopped"):
            return Judgement(Verdict.ENDED, "%s: %s ended %s" % (obs.box, obs.run, obs.state), obs.box)
        if obs.state == "failed":
            return Judgement(Verdict.ENDED, "%s: %s failed under its own restart policy (not recovered: a relaunch "
                                            "would repeat it)" % (obs.box, obs.run), obs.box)
        if obs.state == "preempted":
            return Judgement(Verdict.RELAUNCH_HERE, "%s answers and %s was preempted" % (obs.box, obs.run), obs.box)
        return Judgement(Verdict.RELAUNCH_HERE, "%s answers, but the agent of %s is gone (state %s)"
                         % (obs.box, obs.run, obs.state), obs.box)
    why = obs.error or "ssh failed"
    if beats.ok:
        return Judgement(Verdict.SUSPECT, "%s fails ssh (%s), but its beats arrive: not lost" % (obs.box, why), obs.box)
    failing = 0.0 if suspect_since is None else max(0.0, now - suspect_since)
    if failing < lost_after:
        return Judgement(Verdict.SUSPECT, "%s fails ssh (%s) for %.0f s of %.0f s; beats %s" % (
            obs.box, why, failing, lost_after, beats.liveness), obs.box)
    if beats.unreadable:
        return Judgement(Verdict.WAIT, "%s fails ssh for %.0f s (--lost-after %.0f s), but its beats could not be "
                                       "read (%s): not declared lost until they can" % (
                                           obs.box, failing, lost_after, beats.problem or "the tracker"), obs.box,
                         tracker=True)
    return Judgement(Verdict.LOST, "%s failed ssh for %.0f s (--lost-after %.0f s) and its beats are %s: %s" % (
        obs.box, failing, lost_after, beats.liveness, why), obs.box)


def judge(observed: Sequence[Observation], beats: Sequence[Beats], suspect_since: Optional[float], now: float,
          lost_after: float) -> Judgement:
    """A run on one box, or a group over several (node 0 first): the module docstring's rules."""
    each: List[Judgement] = [judge_box(o, b, suspect_since, now, lost_after) for o, b in zip(observed, beats)]
    if len(each) == 1:
        return each[0]
    for verdict in (Verdict.LOST, Verdict.SUSPECT, Verdict.WAIT):
        hit = [j for j in each if j.verdict == verdict]
        if hit:
            return Judgement(verdict, "node %d: %s" % (each.index(hit[0]), hit[0].reason), hit[0].box,
                             tracker=hit[0].tracker)
    if any(j.verdict == Verdict.HEALTHY for j in each):
        alive = [j for j in each if j.verdict == Verdict.HEALTHY]
        return Judgement(Verdict.HEALTHY, alive[0].reason, alive[0].box)
    first = each[0]
    if first.verdict == Verdict.ENDED:
        return first
    return Judgement(Verdict.RELAUNCH_HERE, "the group: %s" % first.reason, first.box,
                     needs_push=any(j.needs_push for j in each))


def first_new_step(obs: Observation) -> Optional[int]:
    """The step the relaunched run reached, once it trained one (None before): a step of the run's newest attempt,
    seen after that attempt started (both on the box's clock), by a live agent."""
    if not (obs.reached and obs.known and obs.step is not None):
        return None
    if obs.attempt_started is not None and obs.step_time is not None:
        return obs.step if obs.step_time >= obs.attempt_started else None
    return None
