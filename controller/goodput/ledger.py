"""A run's goodput ledger: its wall time, from its first launch to its end (or now), split into

    productive   training whose steps are still part of the run's lineage (each step counts once: the LAST time it
                 was trained; a live run's steps since its newest durable checkpoint are at risk, not lost)
    recomputed   training whose steps were trained again later (a preemption, a crash, a fence or a box loss sent
                 the run back to an older checkpoint: the work at risk at that loss, realised), and the steps after
                 the newest durable checkpoint of a run that ended failed for good
    down         no trainer ran: from a loss to the next attempt's setup (the stop after a notice, detection,
                 provisioning, a backoff, a requeue, the relaunch), and a silent run until now
    restoring    an attempt's setup before its trainer started (finding, fetching and verifying the checkpoint to
                 resume from: the beat's `times`, setup_at to child_started_at)
    starting     the trainer's start to its first step
    stalled      no new step while the agent's `stall` alert was up (no step and no output while the child lives)

a pure function of the run's contexts (fold.py), which are a pure fold of its beats: `ledger_of(fold(beats), now)`.

The parts sum to the wall time: every instant of [start, end] is in exactly one segment. Two lives of the run can
overlap in time (a partitioned box trains on until it sees the newer lease, beside its replacement): the newer life
(later in seq order) owns those instants, the older one's are counted apart in `overlap` (time, and money, spent
twice), never in the parts. A step is charged to the lineage once: lives are judged from the newest back, and a
step a newer life trained (or that is past the final durable checkpoint of a run that failed for good) makes the
time an older life spent on it recomputed. Within a stretch between two reported steps the time is taken as evenly
spent, its lost steps at its end.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from controller.goodput.fold import Context
from controller.goodput.records import BACKOFF_STATE as BACKOFF
from controller.goodput.records import CLEAN_STATES
from controller.goodput.spans import Segment, Spans, free, merge
from onbox import vocab

PRODUCTIVE, RECOMPUTED, DOWN, RESTORING, STARTING, STALLED = (
    "productive", "recomputed", "down", "restoring", "starting", "stalled")
CATEGORIES = (PRODUCTIVE, RECOMPUTED, DOWN, RESTORING, STARTING, STALLED)
TRAINING = "training"  # a claim the lineage splits into productive and recomputed
FIRST = "first"  # a life's first step: judged by the lineage, no time of its own
SILENT_AFTER = 5.0  # heartbeat intervals without a beat: the trainer is no longer taken to be running (the tracker's)
LOST_FOR_GOOD = vocab.FAILED_STATES | {vocab.FENCED}

Slice = Tuple[int, int, int]  # steps (s0, s1] of a phase


@dataclasses.dataclass(frozen=True)
class Loss:
    """One life of the run that ended in a loss, and what it cost in work."""

    at: float  # when its trainer stopped (or its last beat)
    box: str
    attempt: int
    why: str  # preempted, failed, crash_loop, fenced, crashed (a restart followed), lost (its beats stopped)
    steps: int  # steps it trained that were trained again (or lost for good)
    seconds: float  # the recomputed time it spent (in the parts)
    overlap_s: float = 0.0  # and beside a newer life (not in the parts)


@dataclasses.dataclass
class Ledger:
    """The split of one run's wall time (see the module doc). `segments` tile [start, end]; `overlap` holds the time
    an older life spent beside a newer one (not in the parts)."""

    start: float
    end: float
    live: bool  # the run is training now (its end is `now`)
    state: str  # the newest beat's state
    segments: List[Segment]
    overlap: List[Segment]
    losses: List[Loss]
    steps_known: bool  # no step was ever reported: the time its trainer ran is taken as productive
    restarts: int  # lives after the first (a restart after a crash, a relaunch, a recovery, a requeue)
    preemptions: int
    at_risk_steps: Optional[int] = None  # the newest step less the newest durable checkpoint's
    at_risk_s: Optional[float] = None  # the newest step's time less that checkpoint's step time (else commit time)
    durable_step: Optional[int] = None
    kept_steps: int = 0  # the steps of the lineage, each once (productive); recomputed_steps: those trained again
    final: bool = False  # the run ended (done, stopped, failed for good): later `now`s change nothing
    live_until: Optional[float] = None  # a live run is taken as training until then (its beats' silence)

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def parts(self) -> Dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for s in self.segments:
            out[s.category] += s.seconds
        return out

    def by_box(self) -> Dict[str, Dict[str, float]]:
        out: Dict[str, Dict[str, float]] = {}
        for s in self.segments:
            out.setdefault(s.box, dict.fromkeys(CATEGORIES, 0.0))[s.category] += s.seconds
        return out

    def overlap_by_box(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for s in self.overlap:
            out[s.box] = out.get(s.box, 0.0) + s.seconds
        return out

    @property
    def goodput(self) -> Optional[float]:
        return self.parts[PRODUCTIVE] / self.wall if self.wall > 0 else None

    @property
    def recomputed_steps(self) -> int:
        return sum(x.steps for x in self.losses)

    def at(self, now: Optional[float]) -> Optional["Ledger"]:
        """This ledger as of a later `now` without folding again: a live run's training, or a waiting run's down
        time, runs on to `now`. None when `now` changes more than that (a live run fell silent: compute it again)."""
        if now is None or self.final or now <= self.end or not self.segments:
            return self
        if self.live and (self.live_until is None or now > self.live_until):
            return None
        last = self.segments[-1]
        part = PRODUCTIVE if self.live else DOWN
        segs = self.segments[:-1] + ([dataclasses.replace(last, end=now)] if last.category == part and
                                     last.end == self.end else [last, Segment(self.end, now, part, last.box)])
        return dataclasses.replace(self, end=now, segments=segs)

    def window(self, since: Optional[float] = None, until: Optional[float] = None) -> "Ledger":
        """The same ledger over [since, until] (its segments cut there, the losses in it)."""
        lo = self.start if since is None else max(self.start, since)
        hi = self.end if until is None else min(self.end, until)
        hi = max(lo, hi)

        def cut(segs: List[Segment]) -> List[Segment]:
            return [dataclasses.replace(s, start=max(s.start, lo), end=min(s.end, hi)) for s in segs
                    if min(s.end, hi) > max(s.start, lo)]

        return dataclasses.replace(self, start=lo, end=hi, segments=cut(self.segments), overlap=cut(self.overlap),
                                   losses=[x for x in self.losses if lo <= x.at <= hi])

    def to_dict(self, segments: bool = True) -> Dict[str, Any]:
        parts = self.parts
        doc: Dict[str, Any] = {
            "start": self.start, "end": self.end, "wall_s": round(self.wall, 3), "live": self.live,
            "state": self.state, "goodput": None if self.goodput is None else round(self.goodput, 6),
            "parts": {k: round(v, 3) for k, v in parts.items()},
            "by_box": {b: {k: round(v, 3) for k, v in p.items()} for b, p in sorted(self.by_box().items())},
            "overlap_s": {b: round(v, 3) for b, v in sorted(self.overlap_by_box().items())},
            "losses": [dataclasses.asdict(x) for x in self.losses], "recomputed_steps": self.recomputed_steps,
            "steps_known": self.steps_known, "kept_steps": self.kept_steps, "restarts": self.restarts, "preemptions": self.preemptions,
            "at_risk": {"steps": self.at_risk_steps, "seconds": self.at_risk_s, "durable_step": self.durable_step}}
        if segments:
            doc["segments"] = [[round(s.start, 3), round(s.end, 3), s.category, s.box] for s in self.segments]
        return doc


def _kind(c: Context, live: bool, nxt: Optional[Context]) -> str:
    """How a life ended: clean, live, or the loss (preempted, failed, crash_loop, fenced, crashed: its child exited
    and its agent restarted it, lost: its beats stopped)."""
    if c.end_state in CLEAN_STATES:
        return "clean"
    if c.end_state is not None:
        return c.end_state
    if c.last_state == BACKOFF:
        return "crashed"
    if live:
        return "live"
    if nxt is not None and nxt.box == c.box and nxt.agent_at is not None and nxt.agent_at == c.agent_at:
        return "crashed"  # its own agent started the next attempt (a backoff too short for a beat to see)
    return "lost"


def _stall_cut(c: Context, a: float, b: float) -> Optional[float]:
    """The newest stall alert's time inside (a, b): no step came from a until then."""
    i = bisect.bisect_left(c.stalls, b) - 1
    return c.stalls[i] if i >= 0 and c.stalls[i] > a else None


def _claims(c: Context, end: float, kind: str, measured: bool, dead: float, notice: Optional[float],
            ) -> List[Tuple[float, float, str, Optional[Slice]]]:
    """What one life did over [begin, end], in time order: restoring, starting, training (steps to be judged),
    stalled, its tail (the step it was in: productive while it lives or when it ended clean, else recomputed) and
    the time after the notice (a trainer that trains on through its grace is training until its last step; then it
    saves and exits) or after its trainer died (a backoff): down, or productive for a clean stop."""
    out: List[Tuple[float, float, str, Optional[Slice]]] = []
    begin = c.begin
    child = min(max(c.child_at if c.child_at is not None else begin, begin), dead)

    def add(a: float, b: float, cat: str, sl: Optional[Slice] = None) -> None:
        cut = _stall_cut(c, a, b)
        if cut is not None:
            out.append((a, cut, STALLED, None))
            a = cut
        if b > a:
            out.append((a, b, cat, sl if cat == TRAINING else None))

    if c.setup_at is not None and child > c.setup_at:
        out.append((max(c.setup_at, begin), child, RESTORING, None))
    samples = [s for s in c.samples if child <= s[0] <= dead]
    after = PRODUCTIVE if kind == "clean" else DOWN
    if notice is not None and not child <= notice < dead:
        notice = None
    if not samples:
        stop = notice if notice is not None else dead
        add(child, stop, STARTING if measured else PRODUCTIVE)
        out.append((stop, dead, after, None))
    else:
        first = samples[0]
        low = c.resumed_step if c.resumed_step is not None and c.resumed_step < first[1] else first[1] - 1
        at = first[0]
        if low < first[1] - 1 and len(samples) > 1 and samples[1][1] > first[1] and samples[1][2] == first[2]:
            # several steps before its first report (a beat's progress, no trainer points): its first step is
            # placed back at the rate of the next ones, not at the report
            rate = (samples[1][0] - first[0]) / (samples[1][1] - first[1])
            at = min(first[0], max(child, first[0] - (first[1] - low - 1) * rate))
        add(child, at, STARTING)
        # its first step, trained while it was starting: judged like any, its time stays starting
        out.append((at, at, FIRST, (low, low + 1 if at < first[0] else first[1], first[2])))
        if at < first[0]:
            add(at, first[0], TRAINING, (low + 1, first[1], first[2]))
        for a, b in zip(samples, samples[1:]):
            s0 = a[1] if b[1] > a[1] and b[2] == a[2] else b[1] - 1  # a reset counter or a new phase: one step
            add(a[0], b[0], TRAINING, (s0, b[1], b[2]))
        last = samples[-1][0]
        tail = PRODUCTIVE if kind in ("live", "clean") else RECOMPUTED
        if notice is not None and notice > last:  # the step it was in when the notice came, then the stop
            add(last, notice, tail)
            out.append((notice, dead, after, None))
        elif notice is not None:  # it trained on after the notice: from its last step it saved and exited
            out.append((last, dead, after, None))
        else:
            add(last, dead, tail)
    if end > dead:
        out.append((dead, end, after, None))
    return [x for x in out if x[1] > x[0] or x[2] == FIRST]


def ledger_of(contexts: List[Context], now: Optional[float] = None, silent_after: float = SILENT_AFTER) -> Ledger:
    """The ledger of a run's contexts (fold.py), as of `now` (None: as of its newest beat)."""
    if not contexts:
        t = now or 0.0
        return Ledger(t, t, False, "", [], [], [], False, 0, 0)
    last = contexts[-1]
    measured = any(c.samples for c in contexts)
    ends: List[float] = []
    kinds: List[str] = []
    deads: List[float] = []
    notices: List[Optional[float]] = []
    live = False
    for i, c in enumerate(contexts):
        fresh = c is last and c.end_state is None and now is not None and now - c.last_beat <= silent_after * c.interval
        end = max(now if fresh and now is not None else c.last_beat, c.begin)
        kind = _kind(c, fresh, contexts[i + 1] if i + 1 < len(contexts) else None)
        live = live or kind == "live"
        dead = end  # when its trainer stopped running: a backoff's start (its child exited), else its end
        if kind == "crashed":
            dead = c.backoff_at if c.backoff_at is not None and c.begin <= c.backoff_at <= end else c.last_beat
        ends.append(end)
        kinds.append(kind)
        deads.append(dead)
        notices.append(c.stopping_at if c.stopping_at is not None and c.begin <= c.stopping_at <= dead else None)
    start = min(c.begin for c in contexts)
    final = kinds[-1] in ("clean",) or kinds[-1] in LOST_FOR_GOOD
    run_end = max(ends) if final or now is None else max(max(ends), now)

    claims = [_claims(c, ends[i], kinds[i], measured, deads[i], notices[i]) for i, c in enumerate(contexts)]
    resolved, lost_steps, kept_steps = _lineage(contexts, claims, kinds)

    # overlap: newer lives own the instants they cover; an older life's claims there are counted apart
    taken = Spans()
    visible: List[Segment] = []
    hidden: List[Segment] = []
    recomputed_s = [0.0] * len(contexts)
    hidden_s = [0.0] * len(contexts)
    for i in range(len(contexts) - 1, -1, -1):
        c = contexts[i]
        for a, b, cat in resolved[i]:
            for lo, hi in free(taken, a, b):
                visible.append(Segment(lo, hi, cat, c.box))
                if cat == RECOMPUTED:
                    recomputed_s[i] += hi - lo
            for lo, hi in taken.overlap(a, b):
                hidden.append(Segment(lo, hi, cat, c.box))
                if cat == RECOMPUTED:
                    hidden_s[i] += hi - lo
        taken.add(c.begin, ends[i])
    # down: what no life covers, charged to the box the run went on on (the last one's after the last life)
    begins = sorted((c.begin, c.box) for c in contexts)
    for lo, hi in free(taken, start, run_end):
        j = bisect.bisect_left(begins, (hi, ""))
        box = begins[j][1] if j < len(begins) else last.box
        visible.append(Segment(lo, hi, DOWN, box))

    losses = []
    for i, c in enumerate(contexts):
        if kinds[i] not in ("clean", "live"):
            notice = notices[i]
            losses.append(Loss(notice if notice is not None else deads[i], c.box, c.attempt, kinds[i], lost_steps[i], round(recomputed_s[i], 3),
                               round(hidden_s[i], 3)))
    tip = last.last_step
    at_steps = at_s = None
    if tip is not None:
        at_steps = max(0, tip[1] - last.durable_step) if last.durable_step is not None else tip[1]
        # from when the trainer reported the checkpoint's step, as `onboxctl status` and the dashboard count it (an
        # older agent's beat has only the commit time)
        since = last.durable_step_time if last.durable_step_time is not None else last.durable_at
        if since is not None:
            at_s = round(max(0.0, tip[0] - since), 3)
    return Ledger(start=start, end=run_end, live=live, state=last.last_state, segments=merge(visible),
                  overlap=merge(hidden), losses=losses, steps_known=measured, restarts=len(contexts) - 1,
                  preemptions=sum(1 for c in contexts if c.end_state == vocab.PREEMPTED or (
                      c.end_state is None and c.preempted and c.stopping_at is not None)),  # (a fence is no notice)
                  at_risk_steps=at_steps, at_risk_s=at_s, durable_step=last.durable_step, kept_steps=kept_steps,
                  final=final, live_until=last.last_beat + silent_after * last.interval if live else None)


def _lineage(contexts: List[Context], claims: List[List[Tuple[float, float, str, Optional[Slice]]]],
             kinds: List[str]) -> Tuple[List[List[Tuple[float, float, str]]], List[int], int]:
    """Each training claim split into productive and recomputed, judged from the newest life back: a step trained
    again by a newer life, or past the final durable step of a run that failed for good, was recomputed. Returns the
    claims resolved, the steps each life lost, and the steps kept (each counted once: the lineage's length)."""
    done: Dict[int, Spans] = {}
    lost = [0] * len(contexts)
    kept = 0
    last = contexts[-1]
    if kinds[-1] in LOST_FOR_GOOD and last.samples:
        final = last.durable_step if last.durable_step is not None else -1
        done.setdefault(last.samples[-1][2], Spans()).add(float(final), float("inf"))
    out: List[List[Tuple[float, float, str]]] = [[] for _ in contexts]
    for i in range(len(contexts) - 1, -1, -1):
        mine: List[Tuple[float, float, str]] = []
        for a, b, cat, sl in reversed(claims[i]):
            if sl is None:
                mine.append((a, b, cat))
                continue
            s0, s1, phase = sl
            spans = done.setdefault(phase, Spans())
            n = s1 - s0
            gone = sum(hi - lo for lo, hi in spans.overlap(float(s0), float(s1)))
            spans.add(float(s0), float(s1))
            frac = min(1.0, gone / n) if n > 0 else 0.0
            lost[i] += round(gone)
            kept += round(n - gone)
            if cat == FIRST:  # the life's first step: its time is the trainer's start, only the step is judged
                continue
            cut = b - frac * (b - a)
            if b > cut:
                mine.append((cut, b, RECOMPUTED))
            if cut > a:
                mine.append((a, cut, PRODUCTIVE))
        out[i] = mine[::-1]
    return out, lost, kept
