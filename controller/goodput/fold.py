"""A run's beats, in seq order, folded into its attempts: one `Context` per life of the trainer (an attempt of one
agent on one box), with when its setup began, when its child was spawned, the steps it completed and when, the
stall alerts, how it ended. The ledger (ledger.py) is computed from the contexts.

Seq order is the run's order: an agent's seq grows by one per beat and a fresh run dir starts it at the wall clock in
milliseconds, so a replacement box's beats come after the box it replaced, and a partitioned box's late beats (sent
after the heal) before them, whatever their times say. A new context starts when the box, the attempt, the agent
(times.agent_started_at) or the child (times.child_started_at) changes, or a beat follows one whose state was final.

A step belongs to a context only when it was reported after its child started: a relaunched agent carries the run's
last step in its progress (progress.json) until the trainer reports a new one, and an attempt after a backoff starts
with the crashed attempt's newest step. A life resumed from the newest checkpoint it began with (the run's durable
step, one committed before its child started, the local one a later life's first beat found; a run's first life
from 0): its first reported step equal to that one is the step it resumed from ("resumed
from step 400"), not one it trained, and the steps up to its first report were trained while it started. The fold is incremental (the tracker feeds it the beats it stores) and
bounded: a context keeps every step sample since its newest durable checkpoint (a loss sends the run back there) and
thins the older ones (past MAX_SAMPLES, and to CLOSED_SAMPLES once the context ended), so a week-long attempt costs
what its last commit interval holds, and computing a ledger stays a few milliseconds however long the run.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import List, Optional, Set, Tuple

from controller.goodput.records import BACKOFF_STATE, FINAL_STATES, STOPPING_STATE, Beat
from onbox import vocab

MAX_SAMPLES = 1024  # step samples a live context keeps before the older ones are thinned (to half of it)
CLOSED_SAMPLES = 128  # and one that ended: its part before its newest durable step is settled unless a loss
DEFAULT_INTERVAL = 30.0  # the agent's default heartbeat interval


@dataclasses.dataclass
class Context:
    """One life of the trainer: an attempt of one agent on one box."""

    index: int
    box: str
    attempt: int
    first_beat: float
    last_beat: float
    agent_at: Optional[float] = None
    setup_at: Optional[float] = None  # when its setup began (restore, verify): the agent's start or a backoff's end
    child_at: Optional[float] = None  # when its child was spawned
    interval: float = DEFAULT_INTERVAL
    samples: List[Tuple[float, int, int]] = dataclasses.field(default_factory=list)  # (time, step, phase) completed
    stalls: List[float] = dataclasses.field(default_factory=list)  # times of beats carrying the stall alert
    stopping_at: Optional[float] = None  # the first beat saying `stopping` (a notice, a stop, a fence)
    backoff_at: Optional[float] = None  # the first beat saying `backoff` (its child exited, a restart follows)
    end_state: Optional[str] = None  # the final state it reported (None: it never did)
    last_state: str = ""
    durable_step: Optional[int] = None
    durable_at: Optional[float] = None
    durable_step_time: Optional[float] = None
    preempted: bool = False  # a preemption notice was under way
    thinned: int = 0  # samples dropped by the bound
    after: float = float("-inf")  # without its child's spawn time: steps reported after the previous life's last beat
    resumed_step: Optional[int] = None  # the newest checkpoint's step when it began: what it most likely resumed from

    @property
    def begin(self) -> float:
        """When this life began: its setup, else its child's spawn, else its first beat."""
        t = self.setup_at if self.setup_at is not None else self.child_at if self.child_at is not None \
            else self.first_beat
        return min(t, self.first_beat, self.samples[0][0] if self.samples else t)

    @property
    def last_step(self) -> Optional[Tuple[float, int, int]]:
        return self.samples[-1] if self.samples else None


class Fold:
    """The contexts of one run, fed its beats in seq order (`add`). A beat whose seq is not above the last one fed
    is a duplicate (ignored) or out of order: `add` says False, and the caller folds the run again from the start."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self.contexts: List[Context] = []
        self.last_seq = -1
        self.max_samples = max_samples
        self.beats = 0
        self._stale: Optional[Tuple[float, int, int]] = None  # the previous life's newest step: a new one carries it

    def add(self, b: Beat) -> bool:
        if b.seq <= self.last_seq:
            return b.seq == self.last_seq  # a resend is fine; an older beat arriving now is not
        self.last_seq = b.seq
        self.beats += 1
        cur = self.contexts[-1] if self.contexts else None
        if cur is None or self._new_life(cur, b):
            prev = cur
            cur = Context(index=len(self.contexts), box=b.box, attempt=b.attempt, first_beat=b.time, last_beat=b.time,
                          agent_at=b.agent_at, setup_at=b.setup_at, child_at=b.child_at)
            if prev is not None and prev.durable_step is not None and b.durable_step is None:
                cur.durable_step, cur.durable_at = prev.durable_step, prev.durable_at
                cur.durable_step_time = prev.durable_step_time
            # what it resumed from (the agent restores the newest checkpoint that verifies): at least the durable step
            # the run had; a run's first life with none starts from scratch
            cur.resumed_step = 0 if prev is None else prev.durable_step
            if prev is not None:
                cur.after = prev.last_beat
            if prev is not None:  # it ended: what a later loss could still take is past its durable step
                thin(prev, CLOSED_SAMPLES)
            self.contexts.append(cur)
            self._stale = prev.last_step if prev is not None else None
        self._update(cur, b)
        return True

    @staticmethod
    def _new_life(cur: Context, b: Beat) -> bool:
        if b.box != cur.box or b.attempt != cur.attempt:
            return True
        if b.agent_at is not None and cur.agent_at is not None and b.agent_at != cur.agent_at:
            return True
        if b.child_at is not None and cur.child_at is not None and b.child_at != cur.child_at:
            return True
        return cur.end_state is not None and b.state not in FINAL_STATES

    def _update(self, c: Context, b: Beat) -> None:
        c.last_beat = max(c.last_beat, b.time)
        c.last_state = b.state
        if b.interval is not None and b.interval > 0:
            c.interval = b.interval
        for name in ("agent_at", "setup_at", "child_at"):
            if getattr(c, name) is None and getattr(b, name) is not None:
                setattr(c, name, getattr(b, name))
        if b.durable_step is not None and (c.durable_step is None or b.durable_step >= c.durable_step):
            c.durable_step, c.durable_at, c.durable_step_time = b.durable_step, b.durable_at, b.durable_step_time
        if not c.samples:
            # what it resumed from: a checkpoint committed before its child started (one committed later is its own
            # work), or the local one its first beat found; never one this life made
            start = c.child_at if c.child_at is not None else c.first_beat
            known = [x for x in (c.resumed_step, b.local_step if b.time == c.first_beat and c.index else None,
                                 b.durable_step if b.durable_at is not None and b.durable_at <= start else None)
                     if x is not None]
            c.resumed_step = max(known) if known else None
        phase = b.phase or 0
        ref = c.child_at if c.child_at is not None else c.after
        if b.first_point is not None and b.first_point[0] >= ref:
            self._sample(c, b.first_point[0], b.first_point[1], phase)
        if b.step is not None:
            if b.step_time is not None:
                if b.step_time >= ref:
                    self._sample(c, b.step_time, b.step, phase)
            elif c.samples or self._stale is None or self._stale[1] != b.step:  # a thinned beat: its time is the beat's
                self._sample(c, b.time, b.step, phase)
        if b.stalled:
            c.stalls.append(b.time)
        if b.preempted:
            c.preempted = True
        if b.state == STOPPING_STATE and c.stopping_at is None:
            c.stopping_at = b.time
        if b.state == BACKOFF_STATE and c.backoff_at is None:
            c.backoff_at = b.time
        if b.state in FINAL_STATES and c.end_state is None:
            c.end_state = b.state
            if b.state == vocab.PREEMPTED:
                c.preempted = True

    def _sample(self, c: Context, t: float, step: int, phase: int) -> None:
        if not c.samples and step == c.resumed_step:
            return  # "resumed from step 400": the step it starts from, not one it trained
        last = c.samples[-1] if c.samples else None
        if last is not None and (t < last[0] or (step == last[1] and phase == last[2])):
            return  # no new step (its time goes to the next one), or a record older than the newest
        c.samples.append((t, step, phase))
        if len(c.samples) > self.max_samples:
            thin(c, self.max_samples // 2)



def thin(c: Context, budget: int) -> None:
    """At most `budget` samples in `c`: those past its durable step (where a loss sends the run back: the time must
    be exact there; at most half the budget, the newest) and those beside a stall alert kept whole, the older ones
    evenly fewer (the first and the last always kept). A merged stretch keeps its steps: the lineage counts them all,
    only the time inside it is taken as evenly spent."""
    samples = c.samples
    if len(samples) <= budget:
        return
    cut = len(samples)
    if c.durable_step is not None:
        cut = next((i for i, s in enumerate(samples) if s[1] > c.durable_step), len(samples))
    cut = max(cut, len(samples) - budget // 2)
    old, hot = samples[:cut], samples[cut:]
    keep: Set[int] = set()
    for t in c.stalls:  # the samples around a stall bound it: keep them
        k = bisect.bisect_left(old, (t,))
        keep.update((k - 1, k))
    room = max(2, budget - len(hot) - len(keep))
    stride = max(1, -(-len(old) // room))
    kept = [x for i, x in enumerate(old) if i % stride == 0 or i in keep or i == len(old) - 1]
    c.thinned += len(samples) - len(kept) - len(hot)
    c.samples = kept + hot


def fold(beats: List[Beat]) -> Fold:
    """The contexts of a run whose beats are `beats` (any order: sorted by seq here)."""
    f = Fold()
    for b in sorted(beats, key=lambda x: x.seq):
        f.add(b)
    return f
