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
    no answer at all within --suspect-timeout (armed)        late/silent         LOST (the fast path, below)

A box that answers ssh is never declared lost. "late/none" is every liveness but `ok` and `unreadable`: late,
silent, ended, a run the tracker lists no beat of (`absent`), and no tracker configured at all (`unknown`: then
ssh alone decides). `unreadable` is a tracker that is configured but could not be read (down, an error page,
garbage, a document past the reader's bounds, or a run list the keeper cannot use for this run): "I could not read
the beats" is never "the beats stopped", so a box that fails ssh then is waited for (still SUSPECT: its suspicion
is kept, and decided on the beats once they read again), never taken over; a healthy run behind a broken sshd
must not be fenced because its tracker broke too. A group (`--nodes`) is judged as one: any node LOST makes the
group LOST (it recovers whole, on fresh boxes), any node SUSPECT keeps it SUSPECT, a live agent on any node keeps it
HEALTHY (the nodes stop together), and with every agent gone node 0's run decides.

The fast path: a box whose beats are LATE by the tracker's own rule (no beat received for 2 heartbeat intervals,
evaluated at the moment of the judgement from the age the tracker reported) and whose probe got no answer at all
(`silent`: it timed out, or there is no route to it; a refused connection is an answer: the machine is up) is lost
at once, without waiting out --lost-after: two independent signals, the beats and ssh, both say nothing of it is
left. The keeper arms it (`fast`) only once it has seen its boxes and the tracker without a gap for --lost-after
(after its own start, after it was blind, after the tracker could not be read): beats that went late while the
keeper's own network or the tracker was away are no evidence against a box.

The keeper's own sight (`sight`): a keeper whose network went away sees every box fail at once, and a tracker on
its own machine then sees every beat go late too. It suspects itself, and declares nothing lost, when no tracker
beyond its own machine answered and fewer than a quarter of the boxes it asked answered (none of two to four,
at most one of five to eight, ...); a box answers when ssh reached it, or when its host did and refused (a closed
port, a refused key: the network to it works). At least two must have been asked: with one box it cannot tell its own
blindness from that box's death, and decides as before. Why a quarter: a reclaim wave leaves the spares (and
whatever else the keeper watches) answering, while a keeper whose own network went reaches nothing, or only a box
or two it reaches by another path (one on its own LAN while its uplink is down). A wave that leaves fewer than a
quarter of the boxes answering is waited out as blindness: recovering a healthy run behind a blip throws away its
work, recovering a dead one a little later costs only the wait.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional, Sequence

from onbox import vocab

TERMINAL = vocab.TERMINAL_STATES
LATE_AFTER = 2.0  # heartbeat intervals without a beat before the tracker calls a run late (controller/tracker/store.py)
BLIND_FLOOR = 2  # boxes asked: with fewer, the keeper cannot tell its own blindness from one box's death


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
    silent: bool = False  # ssh got no answer at all (a timeout, no route), not a refusal: see the fast path
    heard: bool = False  # ssh failed, but the box's host answered (refused, closed, a key or login refused)


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
    age: Optional[float] = None  # seconds since the tracker received the newest beat, when it answered
    interval: Optional[float] = None  # the agent's heartbeat interval (seconds), as the tracker knows it
    read_at: Optional[float] = None  # when the keeper read it (its clock)

    @property
    def ok(self) -> bool:
        return self.liveness == "ok"

    def late(self, now: float) -> bool:
        """Late or silent by the tracker's rule at `now`: as it said, or an `ok` beat that has aged past LATE_AFTER
        intervals since the read (the same rule, applied at the judgement instead of at the read)."""
        if self.liveness in ("late", "silent"):
            return True
        due = self.late_at()
        return due is not None and now > due

    def late_at(self) -> Optional[float]:
        """When an `ok` beat turns late if no newer one arrives (the keeper's clock); None when it cannot say."""
        if self.liveness != "ok" or self.age is None or not self.interval or self.read_at is None:
            return None
        return self.read_at + LATE_AFTER * self.interval - self.age

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
              lost_after: float, fast: bool = False) -> Judgement:
    """One box and its run (the table in the module docstring); `fast`: the fast path is armed."""
    if obs.reached:
        if obs.problem:
            return Judgement(Verdict.WAIT, "%s answers, but %s" % (obs.box, obs.problem), obs.box)
        if not obs.known:
            return Judgement(Verdict.RELAUNCH_HERE, "%s answers, but its agent has no run %s" % (obs.box, obs.run),
                             obs.box, needs_push=True)
        if obs.agent_alive:
            return Judgement(Verdict.HEALTHY, "%s: the agent of %s is alive (%s)" % (obs.box, obs.run, obs.state),
                             obs.box)
        if obs.fenced or obs.state == vocab.FENCED:
            return Judgement(Verdict.ENDED, "%s: %s was fenced (a newer lease holds the run)" % (obs.box, obs.run),
                             obs.box)
        if obs.state in (vocab.DONE, vocab.STOPPED):
            return Judgement(Verdict.ENDED, "%s: %s ended %s" % (obs.box, obs.run, obs.state), obs.box)
        if obs.state == vocab.FAILED:
            return Judgement(Verdict.ENDED, "%s: %s failed under its own restart policy (not recovered: a relaunch "
                                            "would repeat it)" % (obs.box, obs.run), obs.box)
        if obs.state == vocab.PREEMPTED:
            return Judgement(Verdict.RELAUNCH_HERE, "%s answers and %s was preempted" % (obs.box, obs.run), obs.box)
        return Judgement(Verdict.RELAUNCH_HERE, "%s answers, but the agent of %s is gone (state %s)"
                         % (obs.box, obs.run, obs.state), obs.box)
    why = obs.error or "ssh failed"
    if fast and obs.silent and beats.late(now):
        return Judgement(Verdict.LOST, "%s did not answer (%s) and its beats are late (%s): nothing of it is left" % (
            obs.box, why, _beat_age(beats, now)), obs.box)
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


def _beat_age(beats: Beats, now: float) -> str:
    if beats.age is None or beats.read_at is None:
        return beats.liveness
    return "none for %.0f s at %g s beats" % (beats.age + max(0.0, now - beats.read_at), beats.interval or 0)


def judge(observed: Sequence[Observation], beats: Sequence[Beats], suspect_since: Optional[float], now: float,
          lost_after: float, fast: bool = False) -> Judgement:
    """A run on one box, or a group over several (node 0 first): the module docstring's rules."""
    each: List[Judgement] = [judge_box(o, b, suspect_since, now, lost_after, fast) for o, b in zip(observed, beats)]
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


def sight(answered: int, asked: int, tracker_seen: bool) -> Optional[str]:
    """Why the keeper suspects its own network (None: it sees): `answered` of the `asked` boxes answered ssh this
    pass, and whether a tracker beyond its own machine answered (the module docstring's rule)."""
    if tracker_seen or asked < BLIND_FLOOR or answered * 4 >= asked:
        return None
    return ("%d of the %d boxes it asked answered ssh, and no tracker beyond this machine answered: its own network "
            "may be down" % (answered, asked))
