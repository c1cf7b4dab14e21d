"""Spares checked ahead (issue 31, a wave): a spare is checked (World.spare_problem: it answers ssh, has this
onbox.pyz, runs no live agent, passes `onbox audit` for the run's dirs) while a run is only in doubt, so that the
recovery that may follow takes that answer instead of checking on its critical path. With 16 boxes lost at once,
16 checks (a first start of onbox.pyz and an audit each) made after the declaration took ~5 s of the wave; made
while the beats turn late, they cost nothing there.

What a preparation does and does not do: it asks a spare the questions the recovery would ask (and pushes
onbox.pyz there when the spare has none: a pool's spares are the keeper's to fill); it claims nothing, launches
nothing and writes no record, so a run whose box answers again leaves no trace but a checked spare. A box still
silent is prepared for once per PREPARED_FRESH / 2; each run prepares as many spares as it has boxes, not one
another run is preparing (`planned`), and its recovery tries those first.

Idle spares are warmed too, once per keeper (World.warm): a spare of a watched run's pool with no onbox.pyz and no
push record at all is given this onbox.pyz (and its first start made) while nothing is lost, so that neither the
check ahead nor a recovery waits for that; a spare with any onbox.pyz or push record is left as it is.

An answer is used only while fresh: a check that finished more than PREPARED_FRESH seconds ago is made again (a
spare that was idle then may have been given a run since, by a person or another keeper; within this keeper the
claims under the Recoverer's lock hand each spare out once). A check still under way is waited for, not made
twice. Answers are kept per (spare, durable target, checkpoint dir): `onbox audit` answers for those.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from onbox.clock import Clock

if TYPE_CHECKING:
    from controller.keeper.policy import LaunchRecord

PREPARED_FRESH = 30.0  # seconds an answer from a spare's check is used for (from when the check finished)
WORKERS = 16  # spares checked ahead at once: an ssh client each, mostly waiting on the box
WARMERS = 4  # spares warmed at once, in a pool of their own: a dead spare's warming never delays a check ahead

Check = Callable[[str, "LaunchRecord"], Optional[str]]  # (spare, record) -> why it cannot take the run, or None
Key = Tuple[str, Optional[str], Optional[str]]


@dataclasses.dataclass
class Ahead:
    started: float  # monotonic
    future: "concurrent.futures.Future[Tuple[Optional[str], float]]"  # (the problem, monotonic when it finished)


class SpareChecks:
    def __init__(self, check: Check, clock: Clock, workers: int = WORKERS) -> None:
        self._check = check
        self._clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers),
                                                           thread_name_prefix="keep-spare")
        self._warmers = concurrent.futures.ThreadPoolExecutor(max_workers=WARMERS, thread_name_prefix="keep-warm")
        self._ahead: Dict[Key, Ahead] = {}
        self._planned: Dict[str, Tuple[str, float]] = {}  # spare -> (the run it is prepared for, monotonic)
        self._warmed: Set[str] = set()  # spares this keeper has warmed, or is warming
        self._lock = threading.Lock()

    @staticmethod
    def key(name: str, rec: "LaunchRecord") -> Key:
        return name, rec.durable, rec.ckpt_dir

    def planned_for(self, name: str) -> Optional[str]:
        """The run spare `name` was prepared for within PREPARED_FRESH (None: none)."""
        with self._lock:
            run, at = self._planned.get(name, ("", -PREPARED_FRESH))
        return run if run and self._clock.monotonic() - at < PREPARED_FRESH else None

    def prepare(self, rec: "LaunchRecord", candidates: Sequence[str], need: int) -> None:
        """Check ahead, for `rec`, the first `need` of `candidates` (the recovery's order) that no other run is
        preparing; one already prepared for `rec` counts, and is checked again once its answer is half-stale."""
        now = self._clock.monotonic()
        with self._lock:
            mine = [n for n in candidates if self._planned.get(n, ("", 0.0))[0] == rec.run
                    and now - self._planned[n][1] < PREPARED_FRESH]
            free = [n for n in candidates if n not in mine and (
                n not in self._planned or now - self._planned[n][1] >= PREPARED_FRESH)]
            chosen = (mine + free)[:max(0, need)]
            for name in chosen:
                self._planned[name] = (rec.run, now)
                ahead = self._ahead.get(self.key(name, rec))
                if ahead is None or now - ahead.started >= PREPARED_FRESH / 2:
                    self._ahead[self.key(name, rec)] = Ahead(now, self._pool.submit(self._run, name, rec))

    def _run(self, name: str, rec: "LaunchRecord") -> Tuple[Optional[str], float]:
        problem = self._check(name, rec)
        return problem, self._clock.monotonic()

    def problem(self, name: str, rec: "LaunchRecord") -> Optional[str]:
        """Why spare `name` cannot take `rec` now: the answer of a check made ahead while it is fresh (one under way
        is waited for), else a check made now. What a check raised is raised here."""
        with self._lock:
            ahead = self._ahead.get(self.key(name, rec))
        if ahead is not None:
            problem, finished = ahead.future.result()
            if self._clock.monotonic() - finished < PREPARED_FRESH:
                return problem
        return self._check(name, rec)

    def taken(self, name: str) -> None:
        """Spare `name` was chosen: its answer is spent (a later recovery checks it again) and its plan is over."""
        with self._lock:
            self._planned.pop(name, None)
            for key in [k for k in self._ahead if k[0] == name]:
                del self._ahead[key]

    def warm(self, names: Iterable[str], rec: "LaunchRecord", warm: Callable[[str, "LaunchRecord"], bool]
             ) -> List[Tuple[str, "concurrent.futures.Future[bool]"]]:
        """`warm(name, rec)` in the background for each of `names` this keeper has not warmed yet (once each)."""
        with self._lock:
            todo = [n for n in names if n not in self._warmed]
            self._warmed.update(todo)
        return [(n, self._warmers.submit(warm, n, rec)) for n in todo]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._warmers.shutdown(wait=False)
