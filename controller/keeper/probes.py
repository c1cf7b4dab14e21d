"""The keeper's probes of its boxes, all at once: every box of every watched run (and the witnesses a doubtful pass
asks, sight.py) is asked in a bounded pool of threads, so a dead box's probe, waiting out its timeout, never delays
the judgement of another run.

At most one probe per (box, run) is in flight: a probe still out when its pass goes on stays out, and the pass after
takes its answer (stamped with when it was asked: a box that does not answer is failing from the moment it was
asked). A probe out for longer than the suspect-timeout of a box already in doubt (its beats late, or its probe
failed before) reads as `silent`: no answer within that time, the fast path's second signal (decide.py).

What a probe raises (World.observe raises for anything but a box it cannot reach: no ssh client here, a bug) is
raised again where its answer is taken: it must never read as "the box is lost".
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Callable, Dict, Iterable, Optional, Tuple

from controller.keeper.decide import Observation
from onbox.clock import Clock

Key = Tuple[str, str]  # (box, run)
WORKERS = 64  # probes at once: an ssh client each, mostly waiting on the network


@dataclasses.dataclass
class Probe:
    asked: float  # wall clock (records, --lost-after)
    future: "Optional[concurrent.futures.Future[Observation]]" = None
    started: Optional[float] = None  # monotonic, once a thread runs it: time queued for a thread is no silence


class Probes:
    def __init__(self, observe: Callable[[str, str], Observation], clock: Clock, workers: int = WORKERS) -> None:
        self._observe = observe
        self._clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers),
                                                           thread_name_prefix="keep-probe")
        self._out: Dict[Key, Probe] = {}
        self._lock = threading.Lock()

    def ask(self, box: str, run: str) -> None:
        """Probe `box` about `run`, unless a probe of it is still out."""
        with self._lock:
            if (box, run) in self._out:
                return
            p = self._out[(box, run)] = Probe(self._clock.time())
            p.future = self._pool.submit(self._run, p, box, run)

    def _run(self, p: Probe, box: str, run: str) -> Observation:
        with self._lock:
            p.started = self._clock.monotonic()
        return self._observe(box, run)

    def wait(self, keys: Iterable[Key], budget: Optional[float]) -> None:
        """Until every probe of `keys` has answered, or `budget` seconds (None: no bound; each probe is bounded by its
        own ssh timeouts)."""
        with self._lock:
            futures = [f for f in (self._out[k].future for k in keys if k in self._out) if f is not None]
        if futures:
            concurrent.futures.wait(futures, timeout=budget)

    def left(self, box: str, run: str, within: float) -> float:
        """Seconds until the probe of (box, run) has been out for `within` (0 once it has, or when none is out)."""
        with self._lock:
            p = self._out.get((box, run))
            if p is None:
                return 0.0
            return within if p.started is None else max(0.0, within - (self._clock.monotonic() - p.started))

    def take(self, box: str, run: str, silent_after: Optional[float] = None, give_up: bool = False
             ) -> Optional[Tuple[Observation, float]]:
        """(the answer, when it was asked), once it came; a silent observation when the probe has been out for
        `silent_after` seconds, or at once with `give_up` (the caller waited that long for it); it stays out, and its
        own answer is taken later. None while it is out (or none was asked)."""
        with self._lock:
            p = self._out.get((box, run))
            if p is None:
                return None
            assert p.future is not None
            if p.future.done():
                del self._out[(box, run)]
            elif silent_after is not None and p.started is not None and (
                    give_up or self._clock.monotonic() - p.started >= silent_after):
                return Observation(box, run, reached=False, silent=True,
                                   error="no answer within %g s (--suspect-timeout)" % silent_after), p.asked
            else:
                return None
        return p.future.result(), p.asked  # raises what the probe raised

    def drop_answered(self, box: str, run: str) -> None:
        """The answer of (box, run), when it came and was not taken, dropped unread (a probe still out stays)."""
        with self._lock:
            p = self._out.get((box, run))
            if p is not None and p.future is not None and p.future.done() and p.future.exception() is None:
                del self._out[(box, run)]

    def out(self, box: str, run: str) -> bool:
        with self._lock:
            return (box, run) in self._out

    def close(self) -> None:
        """Stop taking probes; those out finish on their own timeouts (their threads end with them)."""
        self._pool.shutdown(wait=False)
