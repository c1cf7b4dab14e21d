"""The tracker's store: SQLite in WAL mode, one writer connection.

Tables:
  beats(run, attempt, seq, time, received, state, step, loss, eval_loss, lr, tokens_per_s, samples_per_s, doc)
        PRIMARY KEY (run, attempt, seq): a resent beat is a no-op (at-least-once delivery, exactly-once storage).
        `doc` is the whole heartbeat; thinning sets it to NULL on old beats and keeps the metric columns.
  runs(run, box, attempt, seq, time, received, interval_s, state)
        the newest beat of each run (by seq, which only grows over a run's attempts and boxes; its document
        stays in `beats`, never thinned) and when the tracker last heard from the run.

Liveness is judged on the tracker's clock (received), never the box's: ok, late after 2 intervals, silent after 5
(healthchecks.io's late/down; W&B calls a run crashed after ~5 min), ended once the run reported a final state.
"""
from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.heartbeat.schema import metric_point

ENDED_STATES = {"done", "failed", "stopped", "preempted", "crash_loop", "succeeded"}
LATE_AFTER = 2.0  # intervals
SILENT_AFTER = 5.0
DEFAULT_INTERVAL = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS beats (
    id INTEGER PRIMARY KEY,
    run TEXT NOT NULL, attempt INTEGER NOT NULL, seq INTEGER NOT NULL,
    time REAL, received REAL NOT NULL, state TEXT,
    step INTEGER, loss REAL, eval_loss REAL, lr REAL, tokens_per_s REAL, samples_per_s REAL,
    doc TEXT
);
-- ONE index: uniqueness of (run, attempt, seq) for dedupe, and the order of a run's listing (seq, attempt)
CREATE UNIQUE INDEX IF NOT EXISTS beats_key ON beats (run, seq, attempt);
CREATE TABLE IF NOT EXISTS runs (
    run TEXT PRIMARY KEY, box TEXT, attempt INTEGER, seq INTEGER, time REAL, received REAL,
    interval_s REAL, state TEXT
);
"""


def _num(v: Any) -> Optional[float]:
    """A metric column value: finite numbers only (NaN/Infinity strings stay in the document)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def liveness(state: Optional[str], received: float, interval: Optional[float], now: float) -> str:
    if state and state.lower() in ENDED_STATES:
        return "ended"
    interval = interval if interval and interval > 0 else DEFAULT_INTERVAL
    age = now - received
    if age > SILENT_AFTER * interval:
        return "silent"
    if age > LATE_AFTER * interval:
        return "late"
    return "ok"


class Store:
    def __init__(self, path: str, now: Callable[[], float] = time.time) -> None:
        self.path = path
        self.now = now
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process crash
        self._db.execute("PRAGMA busy_timeout=5000")
        # No checkpoint inside a commit (its fsync would stall every request queued behind it): checkpoint()
        # runs from the server's background task on the read connection, PASSIVE, beside the writer.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._db.executescript(_SCHEMA)
        # the newest (attempt, seq) of each run, kept in memory by the one writer: no SELECT per commit
        self._heads: Dict[str, Tuple[int, int]] = {
            run: (seq, attempt) for run, attempt, seq in self._db.execute("SELECT run, attempt, seq FROM runs")}
        # WAL lets readers run beside the writer: reads get their own connection and lock
        self._rlock = threading.Lock()
        self._rdb = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._rdb.execute("PRAGMA busy_timeout=5000")

    def close(self) -> None:
        with self._lock, self._rlock:
            self._db.close()
            self._rdb.close()

    def add(self, beats: List[Dict[str, Any]]) -> Tuple[int, int]:
        """Store validated beats in one transaction. Returns (accepted, duplicates)."""
        return self.add_many([beats])[0]

    def add_many(self, batches: List[List[Dict[str, Any]]]) -> List[Tuple[int, int]]:
        """Several requests' beats in ONE transaction (group commit); (accepted, duplicates) per request."""
        received = self.now()
        results: List[Tuple[int, int]] = []
        newest: Dict[str, Dict[str, Any]] = {}
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                for beats in batches:
                    accepted = 0
                    for b in beats:
                        p = metric_point(b)
                        step = p.get("step")
                        doc = json.dumps(b, separators=(",", ":"))  # as received (validated), compact
                        cur.execute(
                            "INSERT OR IGNORE INTO beats (run, attempt, seq, time, received, state, step, loss, "
                            "eval_loss, lr, tokens_per_s, samples_per_s, doc) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                            (b["run"], b["attempt"], b["seq"], float(b["time"]), received, b["state"],
                             step if isinstance(step, int) else None, _num(p.get("loss")), _num(p.get("eval_loss")),
                             _num(p.get("lr")), _num(p.get("tokens_per_s")), _num(p.get("samples_per_s")), doc))
                        if cur.rowcount == 1:
                            accepted += 1
                        prev = newest.get(b["run"])
                        if prev is None or (b["seq"], b["attempt"]) > (prev["seq"], prev["attempt"]):
                            newest[b["run"]] = b
                    results.append((accepted, len(beats) - accepted))
                heads: Dict[str, Tuple[int, int]] = {}
                for run, b in newest.items():
                    head = self._heads.get(run)
                    if head is None or (b["seq"], b["attempt"]) >= head:
                        heads[run] = (b["seq"], b["attempt"])
                        cur.execute(
                            "INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?)",
                            (run, b["box"], b["attempt"], b["seq"], float(b["time"]), received, _num(b.get("interval_s")),
                             b["state"]))
                    else:  # an old beat arrived late: the run is still alive as of now
                        cur.execute("UPDATE runs SET received=? WHERE run=?", (received, run))
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            self._heads.update(heads)  # only once committed
        return results

    def runs(self) -> List[Dict[str, Any]]:
        now = self.now()
        with self._rlock:
            rows = self._rdb.execute(
                "SELECT r.run, r.box, r.attempt, r.seq, r.received, r.interval_s, r.state, b.doc FROM runs r "
                "LEFT JOIN beats b ON b.run=r.run AND b.attempt=r.attempt AND b.seq=r.seq ORDER BY r.run").fetchall()
        out = []
        for run, box, attempt, seq, received, interval, state, latest in rows:
            out.append({"run": run, "box": box, "attempt": attempt, "seq": seq, "state": state,
                        "received": received, "age_s": round(now - received, 3),
                        "liveness": liveness(state, received, interval, now),
                        "latest": json.loads(latest) if latest else None})
        return out

    def heartbeats(self, run: str, after: int = -1, limit: int = 100) -> List[Dict[str, Any]]:
        """A run's beats with seq > after, in seq order; thinned beats come back as compact metric points."""
        with self._rlock:
            rows = self._rdb.execute(
                "SELECT attempt, seq, time, state, step, loss, eval_loss, lr, tokens_per_s, samples_per_s, doc "
                "FROM beats WHERE run=? AND seq>? ORDER BY seq, attempt LIMIT ?", (run, after, limit)).fetchall()
        out = []
        for attempt, seq, t, state, step, loss, eval_loss, lr, tps, sps, doc in rows:
            if doc is not None:
                out.append(json.loads(doc))
            else:
                out.append({"run": run, "attempt": attempt, "seq": seq, "time": t, "state": state, "thinned": True,
                            "progress": {"step": step, "loss": loss, "eval_loss": eval_loss, "lr": lr,
                                         "tokens_per_s": tps, "samples_per_s": sps}})
        return out

    def thin(self, older_than_s: float, keep_every: int = 10) -> int:
        """Drop the full document of beats received more than `older_than_s` ago, except every `keep_every`-th
        seq and the newest beat of each run; their metric columns stay. Returns how many were thinned."""
        cutoff = self.now() - older_than_s
        with self._lock:
            cur = self._db.execute(
                "UPDATE beats SET doc=NULL WHERE doc IS NOT NULL AND received < ? AND seq % ? != 0 "
                "AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.run=beats.run AND r.attempt=beats.attempt "
                "AND r.seq=beats.seq)", (cutoff, max(1, keep_every)))
            return cur.rowcount

    def checkpoint(self) -> None:
        """Copy the WAL into the database without blocking the writer (PASSIVE); keeps the WAL file bounded."""
        with self._rlock:
            self._rdb.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def count(self) -> int:
        with self._rlock:
            return int(self._rdb.execute("SELECT COUNT(*) FROM beats").fetchone()[0])
