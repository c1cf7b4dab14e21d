"""`onboxctl keep`: ONE loop, as the elastic agent's `_invoke_run`: each pass observes every watched run, judges it
(watch.py, decide.py), acts on the verdict (recovery.py), writes the record, and sleeps `interval` seconds on the
clock seam, waking early when a run's beats are about to turn late (its box is then asked at once).

A pass:
  1. the records, and the tracker's beats (one request per tracker)
  2. every box of every run that is not recovering is asked at once (probes.py: a bounded pool; a probe still out
     is taken by a later pass; a box in doubt that has not answered within --suspect-timeout is `silent`, and a
     probe already out that long is not waited for again)
  3. the keeper's sight (sight.py): too few boxes answered and no tracker beyond this machine: it is blind, and
     declares nothing lost
  4. each observed run judged (watch.py), in turn: cheap, no remote call but what a same-box relaunch needs
  5. every open recovery advanced, all at once, each in a thread of its own (its own record and phases; spares are
     handed out once, under the Recoverer's lock), a run declared lost at once, not after the other runs'
     judgements; a recovery still under way when its pass ends (a provision command renting a box) goes on, and
     its run is left out of the passes until it returns
`tick(wait=None)` (tests, `keep --once`) waits for every probe and recovery; `run()` waits --suspect-timeout for
the probes and not at all for the recoveries.

One keeper per config dir: a flock on its runs/ directory is held while it runs (lock.py); a second one is refused. A
keeper on another machine is not excluded by it: the agents' leases are (a launch under a live lease is refused).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from controller.keeper.decide import Beats, Observation
from controller.keeper.policy import LaunchRecord
from controller.keeper.probes import WORKERS, Probes
from controller.keeper.records import KeepState, RecordProblem, RecordStore, RunKeep
from controller.keeper.recovery import Recoverer
from controller.keeper.sight import Sight, Witnesses
from controller.keeper.view import summary
from controller.keeper.watch import RunWatch
from onbox import untrusted, vocab
from onbox.clock import Clock, SystemClock
from onbox.errors import OnboxError

if TYPE_CHECKING:
    from controller.keeper.world import World

Say = Callable[[Dict[str, Any]], None]
SUSPECT_TIMEOUT = 3.0  # seconds a box in doubt may take to answer before it is `silent` (keep --suspect-timeout)
BEAT_POLL = 1.0  # seconds between the tracker reads of a keeper waiting for its next pass, once a beat is due
SPARE_COOLDOWN = 600.0  # seconds a box declared lost is no spare: its run was just taken off it (it may come back)


@dataclasses.dataclass
class PassReport:
    """What one pass saw and did."""

    time: float
    runs: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    events: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    problems: List[Dict[str, Optional[str]]] = dataclasses.field(default_factory=list)  # {text, hint}: a record
    failed: List[str] = dataclasses.field(default_factory=list)  # runs that reached a FAILED_* state in this pass
    blind: Optional[str] = None  # why the keeper could not see in this pass (sight.py)
    sight: Tuple[int, int] = (0, 0)  # (boxes that answered, boxes asked)

    def to_dict(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), schema=vocab.SCHEMA_KEEP_PASS)


class Keeper:
    def __init__(self, store: RecordStore, world: "World", clock: Optional[Clock] = None,
                 say: Optional[Say] = None, runs: Optional[List[str]] = None,
                 suspect_timeout: float = SUSPECT_TIMEOUT, workers: int = WORKERS) -> None:
        self.store = store
        self.world = world
        self.clock = clock or SystemClock()
        self.say = say or (lambda _e: None)
        self.only = set(runs or [])
        self.suspect_timeout = suspect_timeout
        self._report: Optional[PassReport] = None
        self._said_problems: Set[str] = set()
        self._publish_problem: Optional[str] = None
        self._lock = threading.Lock()  # the report and `say`: recoveries tell from their threads
        self.probes = Probes(world.observe, self.clock, workers)
        self._tasks = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="keep-run")
        self._busy: Dict[str, Tuple["concurrent.futures.Future[None]", RunKeep, KeepState]] = {}
        self.sight = Sight()
        self._fresh: Dict[str, float] = {}
        self._due: Dict[str, Beats] = {}  # the beats of the runs watched in the newest pass, not late then
        self._watched: List[LaunchRecord] = []
        self._warming: List[Tuple[str, "concurrent.futures.Future[bool]"]] = []  # spares being warmed (spares.py)
        self.recoverer = Recoverer(world, self.clock, self._save, self._emit, recheck=self._recheck)
        self.watch = RunWatch(self.clock, self._emit, self._save, self.recoverer, self._fresh_since, self._renew)

    # -- records and events ----------------------------------------------------------------------------------
    def _save(self, keep: RunKeep) -> None:
        self.store.save_keep(keep, self.clock.time())

    def _emit(self, keep: RunKeep, kind: str, text: str, **fields: Any) -> None:
        # what the boxes, the tracker and a provision command said reaches `keep`'s output and recovery.json
        # with its control characters as escapes (no terminal escapes, no forged lines)
        ev = keep.event(self.clock.time(), kind, untrusted.printable(text), boxes=list(keep.boxes),
                        recovery=keep.current.id if keep.current else None, **fields)
        with self._lock:
            if self._report is not None:
                self._report.events.append(ev)
            self.say(ev)

    def _fresh_since(self, run: str) -> float:
        since = self.sight.since if self.sight.since is not None else self.clock.time()
        return max(since, self._fresh.get(run, since))

    def _renew(self, run: str, now: float) -> None:
        self._fresh[run] = now

    def _recheck(self, box: str, run: str) -> Observation:
        """Box `box` asked about `run` once more, at most --suspect-timeout (a probe of it still out is that one)."""
        self.probes.ask(box, run)  # none when one is out: then only what is left of its --suspect-timeout is waited
        got = None
        for _ in range(3):  # a probe still queued for a thread has not had its --suspect-timeout yet
            self.probes.wait([(box, run)], self.probes.left(box, run, self.suspect_timeout))
            got = self.probes.take(box, run, silent_after=self.suspect_timeout, give_up=True)
            if got is not None:
                break
        return got[0] if got else Observation(box, run, reached=False, silent=True, error="no answer")

    # -- one pass --------------------------------------------------------------------------------------------
    def tick(self, wait: Optional[float] = None) -> PassReport:
        """One pass. `wait`: how long the probes are waited for (None: every probe and recovery is waited for)."""
        started = self.clock.time()
        report = self._report = PassReport(time=round(started, 3))
        self._collect(report)
        loaded = self._load(report)
        active = [(rec, keep) for rec, keep in loaded if not keep.state.final and rec.run not in self._busy]
        beats = self._beats([rec for rec, _ in active]) if active else {}
        looking = [(rec, keep) for rec, keep in active if keep.state != KeepState.RECOVERING]
        keys = {rec.run: list(zip(keep.boxes, _node_runs(rec, keep))) for rec, keep in looking}
        for pairs in keys.values():
            for box, run in pairs:
                self.probes.ask(box, run)
        now = self.clock.time()
        doubt = {rec.run: keep.state == KeepState.SUSPECT or any(
            beats.get(run, Beats()).late(now + self.suspect_timeout) for _, run in keys[rec.run]) for rec, keep in looking}
        # a box in doubt whose probe has been out for --suspect-timeout already reads as silent: not waited for again
        self.probes.wait([k for run, pairs in keys.items() for k in pairs
                          if not doubt[run] or wait is None or self.probes.left(*k, self.suspect_timeout) > 0],
                         None if wait is None else self.suspect_timeout)
        answers: Dict[str, Tuple[List[Observation], float]] = {}
        now = self.clock.time()
        for rec, _ in looking:
            doubt[rec.run] = doubt[rec.run] or any(
                beats.get(run, Beats()).late(now + self.suspect_timeout) for _, run in keys[rec.run])
            taken = [self.probes.take(box, run, self.suspect_timeout if doubt[rec.run] else None,
                                      give_up=doubt[rec.run] and wait is not None) for box, run in keys[rec.run]]
            if all(t is not None for t in taken):  # else: still being asked, judged once it answers
                answers[rec.run] = ([t[0] for t in taken if t], min(t[1] for t in taken if t))
        if beats and any(not o.reached for obs, _ in answers.values() for o in obs):
            # a failed probe may have waited out its timeout: the beats read before it are that old (a box that
            # died meanwhile still looked "ok"), and only they can keep a box that fails ssh from being lost
            beats = dict(beats, **self._beats([rec for rec, _ in looking]))
        busy = _in_use(loaded, "", self.clock.time())
        witnesses = Witnesses(self.probes, self.world.boxes, [rec for rec, _ in active], busy, self.suspect_timeout,
                              wait, since=started)
        blind = report.blind = self.sight.look(self.clock.time(), [o for obs, _ in answers.values() for o in obs],
                                               bool(getattr(self.world, "tracker_elsewhere_answered", False)),
                                               witnesses)
        report.sight = self.sight.counts
        held = self._held(answers, beats, keys) if wait is not None else {}
        if wait is not None and not blind:  # `keep --once` and tests' passes: nothing goes on after the pass
            self._prepare(active, answers, keys, loaded)
            self._warm(active, busy)
        for rec, keep in sorted(active, key=lambda rk: rk[0].run in held):
            self.watch.blind(keep, blind)
            if rec.run in answers:
                if rec.run in held:  # after every other run's judgement
                    self.clock.sleep(max(0.0, held[rec.run] - self.clock.time()))
                obs, asked = answers[rec.run]
                self.watch.judge(rec, keep, obs, [beats.get(run, Beats()) for _, run in keys[rec.run]], asked, blind)
                self._recover(rec, keep, loaded, blind)  # at once: not after the held runs' judgements
        self._watched = [rec for rec, _ in active]
        self._due = {run: b for run, b in beats.items() if not b.late(self.clock.time() + self.suspect_timeout)}
        for rec, keep in active:
            self._recover(rec, keep, loaded, blind)
        if wait is None:
            concurrent.futures.wait([f for f, _, _ in self._busy.values()])
        self._collect(report)
        for rec, keep in active:
            if rec.run not in self._busy:
                self._publish(rec, keep)
        report.runs = [summary(rec, keep) for rec, keep in loaded]
        self._report = None
        return report

    def _prepare(self, active: List[Tuple[LaunchRecord, RunKeep]], answers: Dict[str, Tuple[List[Observation], float]],
                 keys: Dict[str, List[Tuple[str, str]]], loaded: List[Tuple[LaunchRecord, RunKeep]]) -> None:
        """The spares of each run with a silent box (no answer within --suspect-timeout: judged so in this pass, or
        a probe of it out that long while its beats are not late yet) checked ahead, while the run is only in doubt
        (spares.py): its recovery, if one follows, takes those answers."""
        now = self.clock.time()
        for rec, keep in active:
            if not rec.policy.pool or keep.state == KeepState.RECOVERING:
                continue
            silent = any(o.silent for o in answers.get(rec.run, ([], 0.0))[0]) or any(
                self.probes.out(*k) and self.probes.left(*k, self.suspect_timeout) <= 0 for k in keys.get(rec.run, []))
            if silent:
                self.recoverer.prepare(rec, keep, _in_use(loaded, rec.run, now))

    def _warm(self, active: List[Tuple[LaunchRecord, RunKeep]], busy: Set[str]) -> None:
        """The idle spares (not in `busy`) of the watched runs' pools warmed (spares.py), once each; those warmed since
        the last pass said (what a warming raised, other than a box's failure, is raised here)."""
        for name, future in [w for w in self._warming if w[1].done()]:
            self._warming.remove((name, future))
            error = future.exception()
            if error is not None and not isinstance(error, OnboxError):
                raise error
            if error is None and future.result():
                self.say({"time": round(self.clock.time(), 3), "kind": vocab.KEPT_SPARE_WARMED,
                          "text": "pushed onbox.pyz to idle spare %s (it had none): a recovery there will not wait "
                                  "for it" % name})
        pools = {rec.policy.pool: rec for rec, keep in active if rec.policy.pool}
        boxes = self.world.boxes() if pools else {}  # the inventory read once per pass
        for pool, rec in sorted(pools.items()):
            idle = sorted(n for n, b in boxes.items() if b.pool == pool and n not in busy)
            self._warming.extend(self.recoverer.spares.warm(idle, rec, self.world.warm))

    def _recover(self, rec: LaunchRecord, keep: RunKeep, loaded: List[Tuple[LaunchRecord, RunKeep]],
                 blind: Optional[str]) -> None:
        """The run's open recovery advanced in a thread of its own (once per pass; while blind, none elsewhere)."""
        if rec.run in self._busy or keep.state != KeepState.RECOVERING or (
                blind and keep.current and keep.current.kind == "elsewhere"):
            return
        self._busy[rec.run] = (self._tasks.submit(self._advance, rec, keep, _in_use(loaded, rec.run,
                                                                                     self.clock.time())),
                               keep, keep.state)

    def _beats(self, recs: List[LaunchRecord]) -> Dict[str, Beats]:
        """The tracker's word on `recs`, each stamped with when it was read (an `ok` beat's age goes on from then)."""
        now = self.clock.time()
        return {run: dataclasses.replace(b, read_at=now) for run, b in self.world.beats(recs).items()}

    def _held(self, answers: Dict[str, Tuple[List[Observation], float]], beats: Dict[str, Beats],
              keys: Dict[str, List[Tuple[str, str]]]) -> Dict[str, float]:
        """The runs with a silent box whose beats turn late within --suspect-timeout, and when: judged at that moment
        (the keeper woke for them a little early, to ask while the beats turn late), not a pass later."""
        now, out = self.clock.time(), {}
        for run, (obs, _) in answers.items():
            if not any(o.silent for o in obs):
                continue
            due = [b.late_at() for b in (beats.get(r, Beats()) for _, r in keys[run])]
            soon = [d for d in due if d is not None and now < d <= now + self.suspect_timeout]
            if soon:
                out[run] = min(soon) + 0.05
        return out

    def _load(self, report: PassReport) -> List[Tuple[LaunchRecord, RunKeep]]:
        """Every run's records, their problems said once."""
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
                rec, keep = self.store.load(name)
            except RecordProblem as e:
                report.problems.append({"text": e.message, "hint": e.hint})
                continue
            loaded.append((rec, keep))  # a run whose recovery is under way: as its thread last wrote it
        texts = {str(p["text"]) for p in report.problems}
        for p in report.problems:
            if p["text"] not in self._said_problems:  # said once, not every pass
                self.say({"time": report.time, "kind": "record_problem", "text": untrusted.printable(p["text"]),
                          "hint": p["hint"]})
        self._said_problems = texts
        return loaded

    def _advance(self, rec: LaunchRecord, keep: RunKeep, in_use: Set[str]) -> None:
        try:
            while self.recoverer.advance(rec, keep, in_use):
                pass
        finally:
            self.recoverer.release(rec.run)

    def _collect(self, report: PassReport) -> None:
        """The recoveries that returned: what they raised is raised here (a bug must stop the keeper, never read as
        a box's failure); a run that reached a FAILED_* state is reported."""
        for run, (future, keep, before) in list(self._busy.items()):
            if not future.done():
                continue
            del self._busy[run]
            future.result()
            if keep.state.final and keep.state != KeepState.ENDED and before != keep.state:
                report.failed.append(run)

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

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self, interval: float, once: bool = False, passes: Optional[int] = None,
            on_pass: Optional[Callable[[PassReport], None]] = None) -> PassReport:
        """Pass after pass until interrupted (or one with `once`, or `passes`, each waiting for everything)."""
        n = 0
        try:
            while True:
                t0 = self.clock.monotonic()
                report = self.tick(wait=None if once or passes is not None else self.suspect_timeout)
                n += 1
                if on_pass is not None:
                    on_pass(report)
                if once or (passes is not None and n >= passes):
                    return report
                self._sleep_until(t0 + interval)
        finally:
            self.close()

    def _sleep_until(self, deadline: float) -> None:
        """Until `deadline` (monotonic), or earlier once a watched run's beats are about to turn late: the tracker
        is read again then (every BEAT_POLL s while one is due), and a run whose beats turned late since the pass
        starts the next pass at once (its box is asked while its beats turn late, not up to --interval after)."""
        while True:
            now = self.clock.monotonic()
            if now >= deadline:
                return
            due = [b.late_at() for b in self._due.values()]
            first = min((d for d in due if d is not None), default=None)
            wall = self.clock.time()
            wake = deadline if first is None else min(deadline, now + max(BEAT_POLL, first - self.suspect_timeout
                                                                          - wall))
            self.clock.sleep(wake - now)
            if first is None or self.clock.time() < first - self.suspect_timeout or not self._watched:
                continue
            beats = self._beats(self._watched)
            later = self.clock.time() + self.suspect_timeout
            if any(b.late(later) for run, b in beats.items() if run in self._due):
                return
            self._due = {run: b for run, b in beats.items() if run in self._due}

    def close(self) -> None:
        """Stop taking probes and recoveries; those under way finish on their own bounds."""
        self.probes.close()
        self.recoverer.spares.close()
        self._tasks.shutdown(wait=False)


def _node_runs(rec: LaunchRecord, keep: RunKeep) -> List[str]:
    if not rec.nodes:
        return [rec.run]
    from onbox.multinode.role import node_run_name

    return [node_run_name(rec.run, i) for i in range(len(keep.boxes))]


def _in_use(loaded: List[Tuple[LaunchRecord, RunKeep]], me: str, now: float) -> Set[str]:
    """Boxes another watched run lives on, or a recovery of another run has chosen, and boxes a recovery declared
    lost within SPARE_COOLDOWN: its run was taken off it a moment ago (a blip's heal must not make it a spare that
    another run is shuffled onto)."""
    out: Set[str] = set()
    for rec, keep in loaded:
        for r in keep.history + ([keep.current] if keep.current else []):
            lost_at = r.phases.get("declared_lost")
            if r.kind == "elsewhere" and lost_at is not None and now - lost_at < SPARE_COOLDOWN and not r.cancelled:
                out.update(r.lost or r.from_boxes)
        if rec.run == me or keep.state.final:
            continue
        out.update(keep.boxes)
        if keep.current is not None:
            out.update(keep.current.to_boxes)
    return out
