"""`onboxctl keep`: ONE loop, as the elastic agent's `_invoke_run`: each pass observes every watched run, judges it
(decide.py), acts on the verdict (recovery.py), writes the record, and sleeps `interval` seconds on the clock seam.

A pass over one run:
  RECOVERING                  advance the open recovery (choose a box, push, relaunch)
  otherwise                   ask each of its boxes (`onbox status RUN --json`) and the tracker, then
    HEALTHY                   WATCHING again (a SUSPECT box answers again)
    SUSPECT                   WATCHING -> SUSPECT, the first failed probe's start kept (detected)
    LOST                      a recovery elsewhere (declared_lost, then a spare or a provisioned box)
    RELAUNCH_HERE             a recovery on the same box (preempted, its agent gone)
    ENDED                     ENDED: the keeper leaves the run alone
    WAIT                      said once; a person decides (the box's records are unreadable)
    WAIT (beats unreadable)   SUSPECT kept: a box that fails ssh is not lost while its beats cannot be read
  and an open recovery whose run trained a new step is closed (first_new_step). A tracker that cannot be read is
  said once per streak (`tracker_unreadable`, then `tracker_readable`), kept in recovery.json across keepers.

One keeper per config dir: a flock on its runs/ directory is held while it runs; a second one is refused. A keeper on
another machine is not excluded by it: the agents' leases are (a launch under a live lease is refused).
"""
from __future__ import annotations

import dataclasses
import fcntl
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from controller.keeper.decide import Beats, Observation, Verdict, judge
from controller.keeper.policy import LaunchRecord
from controller.keeper.records import KeepState, RecordProblem, RecordStore, RunKeep
from controller.keeper.recovery import Recoverer
from onbox import untrusted
from onbox.clock import Clock, SystemClock
from onbox.errors import UsageError

if TYPE_CHECKING:
    from controller.keeper.world import World

Say = Callable[[Dict[str, Any]], None]


@dataclasses.dataclass
class PassReport:
    """What one pass saw and did."""

    time: float
    runs: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    events: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    problems: List[Dict[str, Optional[str]]] = dataclasses.field(default_factory=list)  # {text, hint}: a record
    failed: List[str] = dataclasses.field(default_factory=list)  # runs that reached a FAILED_* state in this pass

    def to_dict(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), schema="onboxctl.keep_pass/1")


class Keeper:
    def __init__(self, store: RecordStore, world: "World", clock: Optional[Clock] = None,
                 say: Optional[Say] = None, runs: Optional[List[str]] = None) -> None:
        self.store = store
        self.world = world
        self.clock = clock or SystemClock()
        self.say = say or (lambda _e: None)
        self.only = set(runs or [])
        self._report: Optional[PassReport] = None
        self._said_problems: Set[str] = set()
        self._publish_problem: Optional[str] = None
        self.recoverer = Recoverer(world, self.clock, self._save, self._emit)

    # -- records and events ----------------------------------------------------------------------------------
    def _save(self, keep: RunKeep) -> None:
        self.store.save_keep(keep, self.clock.time())

    def _emit(self, keep: RunKeep, kind: str, text: str, **fields: Any) -> None:
        # what the boxes, the tracker and a provision command said reaches `keep`'s output and recovery.json
        # with its control characters as escapes (no terminal escapes, no forged lines)
        ev = keep.event(self.clock.time(), kind, untrusted.printable(text), boxes=list(keep.boxes),
                        recovery=keep.current.id if keep.current else None, **fields)
        if self._report is not None:
            self._report.events.append(ev)
        self.say(ev)

    # -- one pass --------------------------------------------------------------------------------------------
    def tick(self) -> PassReport:
        report = self._report = PassReport(time=round(self.clock.time(), 3))
        loaded: List[Tuple[LaunchRecord, RunKeep]] = []
        try:
            names = self.store.runs()
        except RecordProblem as e:
            names = []
            report.problems.append({"text": e.message, "hint": e.hint})
        for name in names:
            if self.only and name not in self.only:
                continue
            try:
                loaded.append(self.store.load(name))
            except RecordProblem as e:
                report.problems.append({"text": e.message, "hint": e.hint})
        texts = {str(p["text"]) for p in report.problems}
        for p in report.problems:
            if p["text"] not in self._said_problems:  # said once, not every pass
                self.say({"time": report.time, "kind": "record_problem", "text": untrusted.printable(p["text"]),
                          "hint": p["hint"]})
        self._said_problems = texts
        active = [(rec, keep) for rec, keep in loaded if not keep.state.final]
        beats = self.world.beats([rec for rec, _ in active]) if active else {}
        for rec, keep in active:
            before = keep.state
            self._one(rec, keep, beats, _in_use(loaded, rec.run))
            self._publish(rec, keep)
            if keep.state.final and keep.state != KeepState.ENDED and before != keep.state:
                report.failed.append(rec.run)
        report.runs = [summary(rec, keep) for rec, keep in loaded]
        self._report = None
        return report

    def _one(self, rec: LaunchRecord, keep: RunKeep, beats: Dict[str, Beats], in_use: Set[str]) -> None:
        if keep.state == KeepState.RECOVERING:
            while self.recoverer.advance(rec, keep, in_use):
                pass
            return
        runs = _node_runs(rec, keep)
        # a box that does not answer is failing from the moment it was asked, not from when the probe gave up
        # (a probe of a dead box waits out its timeout: stamped at its end, --lost-after would start that much late)
        asked = self.clock.time()
        observed = [self.world.observe(box, run) for box, run in zip(keep.boxes, runs)]
        if beats and any(not o.reached for o in observed):
            # a failed probe may have waited out its timeout: the beats read before it are that old (a box that
            # died meanwhile still looked "ok"), and only they can keep a box that fails ssh from being lost
            beats = dict(beats, **self.world.beats([rec]))
        # World.beats has an entry for every run of a configured tracker (absent, or unreadable when it could not
        # be read); none for a run without one ("unknown": ssh alone decides)
        seen = [beats.get(run, Beats()) for run in runs]
        self._tracker_streak(keep, seen)
        self._remember(keep, observed, seen)
        self.recoverer.note_first_step(keep, observed)
        now = self.clock.time()
        # the first failed probe counts too: one that hung for --lost-after is that long without an answer
        since = keep.suspect_since if keep.suspect_since is not None else asked
        j = judge(observed, seen, since, now, rec.lost_after_s())
        if j.verdict == Verdict.HEALTHY:
            keep.last_ok = now
            if keep.state == KeepState.SUSPECT:
                keep.suspect_since = None
                keep.move(KeepState.WATCHING, j.reason)
                self._emit(keep, "suspect_cleared", "%s: not lost" % j.reason)
        elif j.verdict == Verdict.SUSPECT:
            if keep.state == KeepState.WATCHING:
                keep.suspect_since = asked
                keep.move(KeepState.SUSPECT, j.reason)
                self._emit(keep, "suspect", j.reason)
            else:
                keep.message = untrusted.printable(j.reason)
        elif j.verdict == Verdict.WAIT and j.tracker:
            # the box fails ssh, and the beats that would tell whether it is lost cannot be read: stay SUSPECT (the
            # suspicion and its start are kept, decided once the beats read again); said by _tracker_streak
            if keep.state == KeepState.WATCHING:  # its first probe hung for --lost-after
                keep.suspect_since = asked
                keep.move(KeepState.SUSPECT, j.reason)
            keep.message = untrusted.printable(j.reason)
        elif j.verdict == Verdict.WAIT:
            if keep.message != untrusted.printable(j.reason):  # said once, not every pass
                keep.message = untrusted.printable(j.reason)
                self._emit(keep, "needs_a_person", j.reason)
        elif j.verdict == Verdict.ENDED:
            keep.close_current()
            keep.move(KeepState.ENDED, j.reason)
            self._emit(keep, "ended", "%s: the keeper leaves it alone" % j.reason)
        elif j.verdict == Verdict.RELAUNCH_HERE:
            self.recoverer.start(rec, keep, "same_box", j.reason, needs_push=j.needs_push)
        elif j.verdict == Verdict.LOST:
            if keep.suspect_since is None:  # lost at its first failed probe (it hung for --lost-after)
                keep.suspect_since = asked
            self.recoverer.start(rec, keep, "elsewhere", j.reason)
        self._save(keep)
        if keep.state == KeepState.RECOVERING:
            while self.recoverer.advance(rec, keep, in_use):
                pass

    def _publish(self, rec: LaunchRecord, keep: RunKeep) -> None:
        """The run's new events to the tracker, when there is one; what it did not take is sent again next pass."""
        new = [e for e in keep.events if isinstance(e.get("n"), int) and e["n"] > keep.published]
        if not new or not (self.world.tracker or rec.tracker):
            return
        problem = self.world.publish(rec, new)
        if problem is None:
            keep.published = max(e["n"] for e in new)
            self._save(keep)
        elif problem != self._publish_problem:
            self._publish_problem = problem
            self.say({"time": round(self.clock.time(), 3), "kind": "tracker_problem",
                      "text": "events not sent to the tracker (kept in recovery.json, sent later): %s"
                              % untrusted.printable(problem)})

    def _tracker_streak(self, keep: RunKeep, seen: List[Beats]) -> None:
        """One `tracker_unreadable` event when the run's beats stop being readable, one `tracker_readable` when
        they read again: a streak is said once, also by `keep --once` from cron (it is kept in recovery.json)."""
        bad = next((b for b in seen if b.unreadable), None)
        now = self.clock.time()
        if bad is not None and keep.tracker_unreadable_since is None:
            keep.tracker_unreadable_since = now
            self._emit(keep, "tracker_unreadable", "the beats of %s cannot be read: %s; a box of it that fails ssh "
                                                   "is not declared lost while they cannot (the keeper waits: fix "
                                                   "the tracker, or recover the run by hand)"
                       % (keep.run, bad.problem or "the tracker could not be read"))
        elif bad is None and keep.tracker_unreadable_since is not None:
            self._emit(keep, "tracker_readable", "the beats of %s can be read again (after %.0f s)"
                       % (keep.run, max(0.0, now - keep.tracker_unreadable_since)))
            keep.tracker_unreadable_since = None

    def _remember(self, keep: RunKeep, observed: List[Observation], seen: List[Beats]) -> None:
        """The newest step and durable checkpoint known (from the box, else the beats): work at risk and the
        resume point stay known after the box is gone."""
        o, b = observed[0], seen[0]
        last = dict(keep.last_seen)
        for key, a, c in (("step", o.step, b.step), ("durable_step", o.durable_step, b.durable_step),
                          ("durable_at", o.durable_at, b.durable_at)):
            v = a if a is not None else c
            if v is not None:
                last[key] = v
        if o.reached and o.state:
            last["state"] = o.state
        last["time"] = round(self.clock.time(), 3)
        keep.last_seen = last

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self, interval: float, once: bool = False, passes: Optional[int] = None,
            on_pass: Optional[Callable[[PassReport], None]] = None) -> PassReport:
        """Pass after pass until interrupted (or one with `once`, or `passes`)."""
        n = 0
        while True:
            t0 = self.clock.monotonic()
            report = self.tick()
            n += 1
            if on_pass is not None:
                on_pass(report)
            if once or (passes is not None and n >= passes):
                return report
            self.clock.sleep(max(0.0, interval - (self.clock.monotonic() - t0)))


def _node_runs(rec: LaunchRecord, keep: RunKeep) -> List[str]:
    if not rec.nodes:
        return [rec.run]
    from onbox.multinode.role import node_run_name

    return [node_run_name(rec.run, i) for i in range(len(keep.boxes))]


def _in_use(loaded: List[Tuple[LaunchRecord, RunKeep]], me: str) -> Set[str]:
    """Boxes another watched run lives on, or a recovery of another run has chosen."""
    out: Set[str] = set()
    for rec, keep in loaded:
        if rec.run == me or keep.state.final:
            continue
        out.update(keep.boxes)
        if keep.current is not None:
            out.update(keep.current.to_boxes)
    return out


def summary(rec: LaunchRecord, keep: RunKeep) -> Dict[str, Any]:
    """One run as `keep --json` and `status --json` show it."""
    from controller.keeper.recovery import open_phase, split

    cur = keep.current
    return {"run": rec.run, "state": "recovering" if keep.recovering else keep.state.value,
            "keeper_state": keep.state.value, "boxes": list(keep.boxes), "recoveries": keep.recoveries,
            "pool": rec.policy.pool, "message": keep.message, "phase": open_phase(cur),
            "current": dict(cur.to_dict(), split=split(cur)) if cur else None,
            "last": keep.history[-1].to_dict() if keep.history else None, "last_seen": keep.last_seen,
            "max_at_risk": rec.policy.max_at_risk}


class KeeperLock:
    """One keeper per config dir: an exclusive flock on its `runs/` directory (held open for the keeper's life; no
    lock file is written, and a killed keeper's lock goes with its process)."""

    def __init__(self, runs_dir: str) -> None:
        self.path = runs_dir
        self.fd: Optional[int] = None

    def acquire(self, create: bool = True) -> "KeeperLock":
        if create:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        elif not os.path.isdir(self.path):
            return self  # no runs recorded: nothing to keep, nothing to exclude
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UsageError("another `onboxctl keep` is watching the runs in %s" % self.path,
                             hint="one keeper per config dir: stop the other one (systemctl stop onbox-keep), or give "
                                  "this one its own ONBOX_CONFIG_DIR")
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
