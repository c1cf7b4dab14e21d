"""The tracker's goodput ledgers (controller/goodput/): every run's beats folded as they are stored, and the
ledger of each run computed from its fold when asked (`GET /api/v1/goodput`, a run page, `GET /metrics`).

The fold is fed by beat id (the overview's cursor: it only grows), so a poll or a scrape costs the beats stored since
the last one: SQLite reads the few fields the ledger needs out of each new beat's document (one json_extract with
every path: one parse, in C, without the GIL), and the first record of the trainer points it brought. A beat that
arrives below its run's newest seq (two agents of one run pushing at once, a backlog sent late) folds that run again
from its first beat, in seq order. A beat thinned of its document (older than a week) keeps its state, step and
box; its step time, stall alert and `times` are gone, and a run folded again after a restart of the tracker reads
them as unknown (its setup time counts as down, not restoring).

"Now" for a run is on its box's clock: the newest beat's time plus how long ago the tracker received it, so a box
whose clock is off is judged live or silent as the tracker's liveness judges it.
"""
from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from controller.goodput.fold import Fold
from controller.goodput.ledger import Ledger, ledger_of
from controller.goodput.records import Beat, beat_from_doc, number, whole
from controller.tracker.store import Store, parse_doc

log = logging.getLogger("onbox.tracker")

PAGE = 50000  # beats folded per read
_PATHS = ("$.progress.time", "$.checkpoint.latest_durable.step", "$.checkpoint.latest_durable.committed_at",
          "$.times.agent_started_at", "$.times.setup_at", "$.times.child_started_at", "$.phase.index",
          "$.interval_s", "$.preemption", "$.alerts", "$.checkpoint.latest_local.step")
_COLS = ("SELECT b.id, b.run, b.seq, b.time, b.box, b.attempt, b.state, b.step, %s, "
         "json_extract(p.time, '$[0]'), json_extract(p.step, '$[0]') "
         "FROM beats b LEFT JOIN points p ON p.run = b.run AND p.bid = b.id " % (
             "CASE WHEN b.doc IS NOT NULL THEN json_extract(b.doc, %s) END" % ", ".join("'%s'" % p for p in _PATHS)))
_NEW = _COLS + "WHERE b.id > ? ORDER BY b.id LIMIT ?"
_RUN = _COLS + "WHERE b.run = ? AND b.seq > ? ORDER BY b.seq, b.attempt LIMIT ?"
# the same rows without SQLite's JSON functions (an SQLite without them, or a document that is not JSON)
_PLAIN = ("SELECT b.id, b.run, b.seq, b.time, b.box, b.attempt, b.state, b.step, b.doc FROM beats b ")


def _beat_of_row(row: Tuple[Any, ...]) -> Optional[Beat]:
    """A Beat from a row of _NEW/_RUN (None: a row this store would never write)."""
    _id, _run, seq, t, box, attempt, state, step, extracted, p_time, p_step = row
    seq, t, attempt = whole(seq), number(t), whole(attempt)
    if seq is None or t is None or attempt is None or not isinstance(state, str):
        return None
    f: List[Any] = [None] * len(_PATHS)
    if isinstance(extracted, str):
        try:
            got = json.loads(extracted)
        except ValueError:
            got = None
        if isinstance(got, list) and len(got) == len(_PATHS):
            f = got
    alerts = f[9]
    pt, ps = number(p_time), whole(p_step)
    return Beat(seq=seq, time=t, box=box if isinstance(box, str) and box else "?", attempt=attempt,
                state=state.lower(), step=whole(step), step_time=number(f[0]),
                first_point=(pt, ps) if pt is not None and ps is not None else None,
                durable_step=whole(f[1]), durable_at=number(f[2]), local_step=whole(f[10]),
                stalled=isinstance(alerts, list) and any(isinstance(a, dict) and a.get("code") == "stall"
                                                         for a in alerts),
                agent_at=number(f[3]), setup_at=number(f[4]), child_at=number(f[5]), phase=whole(f[6]),
                interval=number(f[7]), preempted=isinstance(f[8], dict))


def _beat_of_plain(row: Tuple[Any, ...]) -> Optional[Beat]:
    _id, run, seq, t, box, attempt, state, step, doc = row
    if doc is not None:
        try:
            b = beat_from_doc(parse_doc(doc))
        except (ValueError, TypeError, RecursionError):
            b = None
        if b is not None:
            return b
    return _beat_of_row((_id, run, seq, t, box, attempt, state, step, None, None, None))


class GoodputBook:
    """Every run's fold, kept up to date from the beats table; the ledgers on demand. Thread-safe (one lock)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.folds: Dict[str, Fold] = {}
        self.cursor = 0  # the highest beat id folded
        self.skipped = 0
        self._lock = threading.Lock()
        # each run's ledger as of its fold's newest beat, carried on to a later `now` while only its live tail or its
        # down time grows (Ledger.at): a scrape of 1,000 runs computes again only those that beat since
        self._ledgers: Dict[str, Tuple[Tuple[int, int], Ledger, float]] = {}

    def _rows(self, sql: str, params: Tuple[Any, ...]) -> List[Tuple[Any, Any, Optional[Beat]]]:
        """(id, run, Beat) of each row; SQLite's JSON path, else the Python one."""
        try:
            return [(r[0], r[1], _beat_of_row(r)) for r in self.store.query(sql, params)]
        except sqlite3.OperationalError:  # no JSON functions, or a document that is not JSON (never written here)
            plain = sql.replace(_COLS, _PLAIN)
            return [(r[0], r[1], _beat_of_plain(r)) for r in self.store.query(plain, params)]

    def refresh(self) -> int:
        """Fold the beats stored since the last refresh; returns how many."""
        with self._lock:
            again: set = set()
            total = 0
            while True:
                rows = self._rows(_NEW, (self.cursor, PAGE))
                for bid, run, beat in rows:
                    if isinstance(bid, int) and bid > self.cursor:
                        self.cursor = bid
                    if beat is None or not isinstance(run, str):
                        self.skipped += 1
                        continue
                    if run in again:
                        continue
                    if not self.folds.setdefault(run, Fold()).add(beat):
                        again.add(run)
                total += len(rows)
                if len(rows) < PAGE:
                    break
            for run in again:
                self._refold(run)
                self._ledgers.pop(run, None)
            return total

    def _refold(self, run: str) -> None:
        f = Fold()
        after = -1
        while True:
            rows = self._rows(_RUN, (run, after, PAGE))
            for _bid, _run, beat in rows:
                if beat is not None:
                    f.add(beat)
                    after = max(after, beat.seq)
            if len(rows) < PAGE:
                break
        self.folds[run] = f
        log.info("onbox tracker: goodput of run %s folded again from its %d beats (a beat arrived out of order)",
                 run, f.beats)

    def box_now(self, run: str, now: float) -> Optional[float]:
        """`now` on the run's box clock: its newest beat's time plus the age of its reception."""
        rows = self.store.query("SELECT time, received FROM runs WHERE run=?", (run,))
        if not rows:
            return None
        t, received = number(rows[0][0]), number(rows[0][1])
        if t is None or received is None:
            return None
        return t + max(0.0, now - received)

    def _ledger_of(self, run: str, f: Fold, box_now: Optional[float], max_age: float = 0.0) -> Ledger:
        """The run's ledger as of `box_now`: the cached one carried on when the fold did not change (or, with
        `max_age`, when it was computed less than that many seconds ago: a scrape's ledgers may lag by so much)."""
        version = (f.last_seq, len(f.contexts))
        cached = self._ledgers.get(run)
        now = self.store.now()
        if cached is not None and (cached[0] == version or now - cached[2] < max_age):
            led = cached[1].at(box_now)
            if led is not None:
                return led
        led = ledger_of(list(f.contexts), box_now)
        self._ledgers[run] = (version, led, now)
        return led

    def ledger(self, run: str, now: float, refresh: bool = True) -> Optional[Ledger]:
        """The ledger of `run` as of `now` (the tracker's clock), None for a run without beats."""
        if refresh:
            self.refresh()
        box_now = self.box_now(run, now)
        with self._lock:
            f = self.folds.get(run)
            return self._ledger_of(run, f, box_now) if f is not None and f.contexts else None

    def ledgers(self, now: float, max_age: float = 0.0) -> Dict[str, Ledger]:
        """Every run's ledger as of `now` (each computed at most `max_age` seconds ago)."""
        self.refresh()
        heads = {r: (number(t), number(rec)) for r, t, rec in self.store.query("SELECT run, time, received FROM runs")}
        out = {}
        with self._lock:
            for n, (run, f) in enumerate(self.folds.items()):
                if n % 20 == 19:
                    time.sleep(0)  # the event loop takes the agents' beats meanwhile (the lock is this book's only)
                if f.contexts:
                    t, rec = heads.get(run, (None, None))
                    box_now = t + max(0.0, now - rec) if t is not None and rec is not None else None
                    out[run] = self._ledger_of(run, f, box_now, max_age)
        return out
