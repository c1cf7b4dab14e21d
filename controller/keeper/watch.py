"""What one pass does with one run it observed: judge it (decide.py), move its record, say what changed, and open a
recovery when one is due (recovery.py carries it on, phase by phase).

    HEALTHY                   WATCHING again (a SUSPECT box answers again)
    SUSPECT                   WATCHING -> SUSPECT, the first failed probe's start kept (detected)
    LOST                      a recovery elsewhere (declared_lost, then a spare or a provisioned box)
    LOST while blind          SUSPECT kept, `keeper_blind` said: nothing is declared lost (sight.py)
    RELAUNCH_HERE             a recovery on the same box (preempted, its agent gone)
    ENDED                     ENDED: the keeper leaves the run alone
    WAIT                      said once; a person decides (the box's records are unreadable)
    WAIT (beats unreadable)   SUSPECT kept: a box that fails ssh is not lost while its beats cannot be read
and an open recovery whose run trained a new step is closed (first_new_step). A tracker that cannot be read is said
once per streak (`tracker_unreadable`, then `tracker_readable`), and so is the keeper's blindness (`keeper_blind`,
then `keeper_sees_again`), both kept in recovery.json across keepers.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol

from controller.keeper.decide import Beats, Observation, Verdict, judge
from controller.keeper.policy import LaunchRecord
from controller.keeper.records import KeepState, RunKeep
from controller.keeper.recovery import Emit, Recoverer
from onbox import untrusted
from onbox.clock import Clock


class Fresh(Protocol):
    """Since when the keeper has looked at run RUN without a gap (its start, its sight back, the tracker back)."""

    def __call__(self, run: str) -> float: ...


class RunWatch:
    def __init__(self, clock: Clock, emit: Emit, save: Callable[[RunKeep], None], recoverer: Recoverer,
                 fresh: Fresh, renew: Callable[[str, float], None]) -> None:
        self.clock = clock
        self.emit = emit
        self.save = save
        self.recoverer = recoverer
        self.fresh = fresh
        self.renew = renew  # (run, now): the run's look starts again (its beats read again after a gap)

    def blind(self, keep: RunKeep, why: Optional[str]) -> None:
        """Say the keeper's blindness once per streak, and its end; seeing again starts a suspicion over."""
        now = self.clock.time()
        if why is not None and keep.blind_since is None:
            keep.blind_since = now
            self.emit(keep, "keeper_blind", "the keeper cannot see: %s; it declares nothing lost and takes nothing "
                                            "over until it sees again (if the boxes really are gone, every one of "
                                            "them: a spare in the pool or a tracker beyond this machine lets it "
                                            "tell)" % why)
            self.save(keep)
        elif why is None and keep.blind_since is not None:
            self.emit(keep, "keeper_sees_again", "the keeper sees again (after %.0f s blind): every doubt starts "
                                                 "over from now" % max(0.0, now - keep.blind_since))
            keep.blind_since = None
            if keep.suspect_since is not None:
                keep.suspect_since = now
            self.renew(keep.run, now)
            self.save(keep)

    def judge(self, rec: LaunchRecord, keep: RunKeep, observed: List[Observation], seen: List[Beats], asked: float,
              blind: Optional[str]) -> None:
        """One pass's judgement of a run that is not recovering (its boxes' answers, `asked` when)."""
        self.tracker_streak(keep, seen)
        self.remember(keep, observed, seen)
        self.recoverer.note_first_step(keep, observed)
        now = self.clock.time()
        # the first failed probe counts too: one that hung for --lost-after is that long without an answer
        since = keep.suspect_since if keep.suspect_since is not None else asked
        lost_after = rec.lost_after_s()
        j = judge(observed, seen, since, now, lost_after, fast=now - self.fresh(rec.run) >= lost_after)
        if j.verdict == Verdict.LOST and blind is not None:
            if keep.state == KeepState.WATCHING:
                keep.suspect_since = asked
                keep.move(KeepState.SUSPECT, j.reason)
            keep.message = untrusted.printable("not declared lost: the keeper cannot see (%s); %s" % (blind, j.reason))
        elif j.verdict == Verdict.HEALTHY:
            keep.last_ok = now
            if keep.state == KeepState.SUSPECT:
                keep.suspect_since = None
                keep.move(KeepState.WATCHING, j.reason)
                self.emit(keep, "suspect_cleared", "%s: not lost" % j.reason)
        elif j.verdict == Verdict.SUSPECT:
            if keep.state == KeepState.WATCHING:
                keep.suspect_since = asked
                keep.move(KeepState.SUSPECT, j.reason)
                self.emit(keep, "suspect", j.reason)
            else:
                keep.message = untrusted.printable(j.reason)
        elif j.verdict == Verdict.WAIT and j.tracker:
            # the box fails ssh, and the beats that would tell whether it is lost cannot be read: stay SUSPECT (the
            # suspicion and its start are kept, decided once the beats read again); said by tracker_streak
            if keep.state == KeepState.WATCHING:  # its first probe hung for --lost-after
                keep.suspect_since = asked
                keep.move(KeepState.SUSPECT, j.reason)
            keep.message = untrusted.printable(j.reason)
        elif j.verdict == Verdict.WAIT:
            if keep.message != untrusted.printable(j.reason):  # said once, not every pass
                keep.message = untrusted.printable(j.reason)
                self.emit(keep, "needs_a_person", j.reason)
        elif j.verdict == Verdict.ENDED:
            keep.close_current()
            keep.move(KeepState.ENDED, j.reason)
            self.emit(keep, "ended", "%s: the keeper leaves it alone" % j.reason)
        elif j.verdict == Verdict.RELAUNCH_HERE:
            self.recoverer.start(rec, keep, "same_box", j.reason, needs_push=j.needs_push)
        elif j.verdict == Verdict.LOST:
            if keep.suspect_since is None:  # lost at its first failed probe (it hung for --lost-after)
                keep.suspect_since = asked
            self.recoverer.start(rec, keep, "elsewhere", j.reason, lost=[j.box] if j.box else None)
        self.save(keep)

    def tracker_streak(self, keep: RunKeep, seen: List[Beats]) -> None:
        """One `tracker_unreadable` event when the run's beats stop being readable, one `tracker_readable` when
        they read again: a streak is said once, also by `keep --once` from cron (it is kept in recovery.json)."""
        bad = next((b for b in seen if b.unreadable), None)
        now = self.clock.time()
        if bad is not None and keep.tracker_unreadable_since is None:
            keep.tracker_unreadable_since = now
            self.emit(keep, "tracker_unreadable", "the beats of %s cannot be read: %s; a box of it that fails ssh "
                                                  "is not declared lost while they cannot (the keeper waits: fix "
                                                  "the tracker, or recover the run by hand)"
                      % (keep.run, bad.problem or "the tracker could not be read"))
        elif bad is None and keep.tracker_unreadable_since is not None:
            self.emit(keep, "tracker_readable", "the beats of %s can be read again (after %.0f s)"
                      % (keep.run, max(0.0, now - keep.tracker_unreadable_since)))
            keep.tracker_unreadable_since = None
            self.renew(keep.run, now)  # beats that went late while they could not be read are no evidence

    def remember(self, keep: RunKeep, observed: List[Observation], seen: List[Beats]) -> None:
        """The newest step and durable checkpoint known (from the box, else the beats): work at risk and the
        resume point stay known after the box is gone."""
        o, b = observed[0], seen[0]
        last: Dict[str, Any] = dict(keep.last_seen)
        for key, a, c in (("step", o.step, b.step), ("durable_step", o.durable_step, b.durable_step),
                          ("durable_at", o.durable_at, b.durable_at)):
            v = a if a is not None else c
            if v is not None:
                last[key] = v
        if o.reached and o.state:
            last["state"] = o.state
        last["time"] = round(self.clock.time(), 3)
        keep.last_seen = last
