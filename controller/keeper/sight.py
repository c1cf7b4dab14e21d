"""Whether the keeper can see: "these boxes died" or "I lost the network" (decide.sight is the rule).

Each pass counts the boxes of the watched runs that answered and those that did not (a box whose host refused the
connection answered: the network to it works; a timeout, no route or no name is darkness). When they cannot settle
it (too few answered, or fewer than two were asked), the witnesses are asked too: the idle boxes of the watched
runs' pools (the spares), at once, each bounded by the suspect-timeout. A tracker beyond this machine that answered
settles it at once: the keeper's network works. A tracker on this machine proves nothing: when the keeper's network
goes, the boxes cannot reach it either, and every beat goes late.

While blind the keeper declares nothing lost and takes nothing over (a relaunch on a box that answers still goes);
each run it watches is told once (`keeper_blind`), and once more when it sees again (`keeper_sees_again`), both kept
in recovery.json (`blind_since`) so that `keep --once` from cron says a streak once. Seeing again is a fresh start
for every doubt: a run still suspect has its suspicion start again then, and the fast path (decide.py) waits
--lost-after again, since the beats went late while the keeper could not look.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from controller.boxes.inventory import Box
from controller.keeper.decide import BLIND_FLOOR, Observation, sight
from controller.keeper.policy import LaunchRecord
from controller.keeper.probes import Probes

MAX_WITNESSES = 32  # idle boxes asked in a doubtful pass


class Sight:
    """The keeper's sight, pass after pass: `blind` (why, while blind) and `since` (when it began to see: its first
    pass, or the pass it saw again; None while blind)."""

    def __init__(self) -> None:
        self.blind: Optional[str] = None
        self.since: Optional[float] = None
        self.counts: Tuple[int, int] = (0, 0)  # (answered, asked) in the newest pass

    def look(self, now: float, observed: Iterable[Observation], tracker_seen: bool,
             witnesses: "Witnesses") -> Optional[str]:
        """This pass's verdict (why the keeper is blind, or None), the witnesses asked when the watched boxes do not
        settle it."""
        seen: Dict[str, bool] = {}
        for o in observed:
            seen[o.box] = seen.get(o.box, False) or o.reached or o.heard
        dark = [b for b, lit in seen.items() if not lit]
        answered, asked = sum(seen.values()), len(seen)
        if dark and not tracker_seen and (asked < BLIND_FLOOR or sight(answered, asked, False)):
            for o in witnesses.ask(set(seen)):
                answered, asked = answered + (1 if o.reached or o.heard else 0), asked + 1
        self.counts = (answered, asked)
        why = sight(answered, asked, tracker_seen) if dark else None
        if why is None and (self.blind is not None or self.since is None):
            self.since = now
        self.blind = why
        return why


class Witnesses:
    """The idle boxes of the watched runs' pools, asked together (the Probes' pool), each bounded by the
    suspect-timeout: an unanswered one is dark."""

    def __init__(self, probes: Probes, boxes: Callable[[], Dict[str, Box]], runs: Sequence[LaunchRecord],
                 busy: Set[str], timeout: float, budget: Optional[float], since: float = float("-inf")) -> None:
        self.probes = probes
        self.boxes = boxes  # the inventory, read only when a pass is in doubt
        self.runs = runs
        self.busy = busy
        self.timeout = timeout
        self.budget = budget
        self.since = since  # the pass's start (wall clock): a witness asked before it says nothing of now

    def candidates(self) -> List[Tuple[str, str]]:
        """(box, a run of its pool to ask it about): the idle boxes of the watched runs' pools, by name."""
        pools: Dict[str, str] = {}
        for rec in self.runs:
            pools.setdefault(rec.policy.pool, rec.run)
        return sorted((name, pools[b.pool]) for name, b in self.boxes().items()
                      if b.pool is not None and b.pool in pools and name not in self.busy)

    def ask(self, skip: Set[str]) -> List[Observation]:
        keys = [(b, r) for b, r in self.candidates() if b not in skip][:MAX_WITNESSES]
        for box, run in keys:
            # an answer left from an earlier pass (a witness slower than its timeout then) was asked before the
            # network may have gone: it is dropped, and the witness asked again now
            self.probes.drop_answered(box, run)
            self.probes.ask(box, run)
        self.probes.wait(keys, self.timeout if self.budget is not None else None)
        out = []
        for box, run in keys:
            got = self.probes.take(box, run, silent_after=self.timeout, give_up=True)
            if got is not None:
                obs, asked = got
                out.append(obs if asked >= self.since else Observation(
                    box, run, reached=False, silent=True, error="its answer was asked before this pass"))
        return out
