"""The tracker's store: SQLite in WAL mode, one writer connection.

Tables:
  beats(run, attempt, seq, time, received, state, step, loss, eval_loss, lr, tokens_per_s, samples_per_s, doc,
        box, gpu_util, gpu_mem, ckpt)
        PRIMARY KEY (run, attempt, seq): a resent beat is a no-op (at-least-once delivery, exactly-once storage).
        `doc` is the whole heartbeat; thinning sets it to NULL on old beats and keeps the metric columns. `box`,
        `gpu_util` (mean %), `gpu_mem` (bytes used, summed) and `ckpt` (newest durable checkpoint's name) are the
        dashboard's curve and event columns (controller/tracker/series.py); a database made before them gets them
        added (NULL on its old rows, read from `doc` while it is there). `id` only grows: the dashboard's change
        cursor.
  runs(run, box, attempt, seq, time, received, interval_s, state)
        the newest beat of each run (by seq, which only grows over a run's attempts and boxes; its document
        stays in `beats`, never thinned) and when the tracker last heard from the run.
  events(id, run, time, kind, source, doc)
        what happened to a run that no beat says (the keeper's decisions): controller/tracker/events.py.
  points(run, bid, attempt, seq, n, time, step, loss, eval_loss, lr, tokens_per_s, samples_per_s, epoch,
         steps_per_s)
        the trainer's own points that a beat brought (its `points` section: every metric record parsed since the
        agent's previous beat), one row per beat with its n records as JSON arrays, keyed by (run, bid = the
        beat's id); written in the beat's transaction, only when the beat is new, so a resend adds none. The
        beat's document keeps {"records": n, "thinned": t, "dropped": d} in their place
        (controller/tracker/columns.py).

Liveness is judged on the tracker's clock (received), never the box's: ok, late after 2 intervals, silent after 5
(healthchecks.io's late/down; W&B calls a run crashed after ~5 min), ended once the run reported a final state.

A read never fails on one bad row: a row whose document does not parse as strict JSON (an older tracker stored a
beat holding 1e400 as `Infinity`), is not an object, nests deeper than onbox.untrusted.MAX_DEPTH (an older tracker
took beats ~980 deep, and one made every reader refuse the whole run list), or whose columns are not what this
store writes, is skipped, counted (`skipped_rows`) and logged once; a run whose newest beat is such a row stays in
the run list without it, marked with its `problem`. The database, its WAL and SHM are created 0600 (they hold every run's
hosts, paths and errors); an existing one with wider permissions is narrowed.

Past 400 lines on purpose: every statement that touches the database sits behind its one writer connection and
its schema migrations, so no other module opens SQLite.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import queue
import sqlite3
import stat
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from controller.tracker.columns import (
    ADDED_BEATS_COLUMNS,
    POINTS_INDEX,
    POINTS_INSERT,
    POINTS_TABLE,
    durable_name,
    gpu_numbers,
    point_row,
    points_summary,
)
from onbox.errors import UnfitError, UsageError
from onbox.heartbeat.schema import loads_strict, metric_point
from onbox.untrusted import MAX_DEPTH, depth
from onbox.vocab import ENDED_STATES

log = logging.getLogger("onbox.tracker")

LATE_AFTER = 2.0  # intervals
SILENT_AFTER = 5.0
DEFAULT_INTERVAL = 30.0
READERS = 4  # read connections for the dashboard

_SCHEMA = """
CREATE TABLE IF NOT EXISTS beats (
    id INTEGER PRIMARY KEY,
    run TEXT NOT NULL, attempt INTEGER NOT NULL, seq INTEGER NOT NULL,
    time REAL, received REAL NOT NULL, state TEXT,
    step INTEGER, loss REAL, eval_loss REAL, lr REAL, tokens_per_s REAL, samples_per_s REAL,
    doc TEXT,
    box TEXT, gpu_util REAL, gpu_mem REAL, ckpt TEXT
);
-- uniqueness of (run, attempt, seq) for dedupe, and the order of a run's listing (seq, attempt)
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _doc(text: Any) -> Dict[str, Any]:
    """A stored document, parsed strictly: what parses can always be served (no NaN/Infinity), and no deeper than
    the readers read (onbox.untrusted.MAX_DEPTH: an older tracker stored beats nested ~980 deep). A ValueError
    says what is wrong in words that follow "its newest beat": "nests more than 64 levels deep"."""
    try:
        doc = loads_strict(text.decode("utf-8") if isinstance(text, bytes) else text)
    except RecursionError:
        raise ValueError("nests too deep to parse")
    except ValueError as e:
        raise ValueError("is not strict JSON (%s)" % str(e)[:160])
    if not isinstance(doc, dict):
        raise ValueError("is not a JSON object")
    if depth(doc, MAX_DEPTH) > MAX_DEPTH:
        raise ValueError("nests more than %d levels deep" % MAX_DEPTH)
    return doc


parse_doc = _doc  # for the dashboard's readers (controller/tracker/series.py, overview.py)


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


BEATS_COLUMNS = {"id", "run", "attempt", "seq", "time", "received", "state", "step", "loss", "eval_loss", "lr",
                 "tokens_per_s", "samples_per_s", "doc"}
RUNS_COLUMNS = {"run", "box", "attempt", "seq", "time", "received", "interval_s", "state"}
_UNFIT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO}


def open_store(path: str, now: Callable[[], float] = time.time) -> "Store":
    """The tracker's database at `path` (its directory made 0700 when missing). What the user can fix in the
    path is a UsageError (exit 2), what the machine refuses an UnfitError (exit 3): one line with a hint each."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    hint = "give --db a file path in a directory you can write, e.g. ~/.onbox/tracker/tracker.db"
    if os.path.isdir(path):
        raise UsageError("--db %s is a directory, not a database file" % path, hint=hint)
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise UsageError("--db %s: %s is a file, not a directory" % (path, _first_file(parent)), hint=hint)
    except OSError as e:
        raise _path_error(path, e, hint)
    if not os.path.isdir(parent):
        raise UsageError("--db %s: %s is not a directory" % (path, parent), hint=hint)
    try:
        return Store(path, now=now)
    except OSError as e:
        raise _path_error(path, e, hint)
    except sqlite3.DatabaseError as e:
        text = str(e)
        if "not a database" in text or "malformed" in text:
            raise UsageError("--db %s is not a tracker database: %s" % (path, text),
                             hint="give --db a new file (it is created) or the tracker's own database")
        # "unable to open database file", "attempt to write a readonly database", "disk I/O error", locked ...
        raise UnfitError("cannot open the tracker database %s: %s" % (path, text), hint=hint)


def _first_file(path: str) -> str:
    """The first component of `path` that exists and is not a directory."""
    cur = ""
    for part in os.path.abspath(path).split(os.sep)[1:]:
        cur += os.sep + part
        if os.path.exists(cur) and not os.path.isdir(cur):
            return cur
    return path


def _path_error(path: str, e: OSError, hint: str) -> Exception:
    why = e.strerror or str(e)
    if e.errno in _UNFIT_ERRNOS:
        return UnfitError("cannot create the tracker database %s: %s" % (path, why), hint=hint)
    return UsageError("cannot create the tracker database %s: %s" % (path, why), hint=hint)


def _create_private(path: str) -> None:
    """A new database file is created 0600 before SQLite opens it: SQLite gives the WAL and SHM the database
    file's own mode, so they are 0600 from their first byte too."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:
        return
    os.close(fd)


def _narrow(path: str) -> None:
    """An existing database (and its -wal/-shm) that group or others may read is made 0600."""
    for p in (path, path + "-wal", path + "-shm", path + "-journal"):
        try:
            mode = stat.S_IMODE(os.stat(p).st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            os.chmod(p, mode & 0o700)


class Store:
    def __init__(self, path: str, now: Callable[[], float] = time.time) -> None:
        self.path = path
        self.now = now
        self.skipped_total = 0  # bad rows skipped by reads since start (also in /healthz)
        self._skipped_logged = False
        self._lock = threading.Lock()
        _create_private(path)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # first, only look: another program's database (or a file that is none) is refused untouched
        for table, want in (("beats", BEATS_COLUMNS), ("runs", RUNS_COLUMNS)):
            have = {row[1] for row in self._db.execute("PRAGMA table_info(%s)" % table)}
            if have and not want <= have:
                self._db.close()
                raise sqlite3.DatabaseError("not a database of this tracker: table %s lacks %s"
                                            % (table, ", ".join(sorted(want - have))))
        _narrow(path)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process crash
        self._db.execute("PRAGMA busy_timeout=5000")
        # No checkpoint inside a commit (its fsync would stall every request queued behind it): checkpoint()
        # runs from the server's background task on the read connection, PASSIVE, beside the writer.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._db.executescript(_SCHEMA)
        self._db.execute(POINTS_TABLE)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(beats)")}
        for name, kind in ADDED_BEATS_COLUMNS:
            if name not in have:
                self._db.execute("ALTER TABLE beats ADD COLUMN %s %s" % (name, kind))
        if not self._db.execute("SELECT 1 FROM sqlite_master WHERE type='index' AND name='beats_points'").fetchone():
            if self._db.execute("SELECT 1 FROM beats LIMIT 1").fetchone():
                log.warning("onbox tracker: indexing the stored beats for the dashboard's curves (once; about 10 s "
                            "per million beats)")
            self._db.execute(POINTS_INDEX)
        # the newest (attempt, seq) of each run, kept in memory by the one writer: no SELECT per commit
        self._heads: Dict[str, Tuple[int, int]] = {
            run: (seq, attempt) for run, attempt, seq in self._db.execute("SELECT run, attempt, seq FROM runs")}
        # WAL lets readers run beside the writer: reads get their own connection and lock
        self._rlock = threading.Lock()
        self._rdb = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._rdb.execute("PRAGMA busy_timeout=5000")
        # the dashboard's reads (query()): a few connections of their own, so pages read side by side and never
        # queue behind each other or behind the API's reads on _rdb
        self._readers: "queue.SimpleQueue[sqlite3.Connection]" = queue.SimpleQueue()
        self._readers_made = 0
        self._readers_lock = threading.Lock()

    def close(self) -> None:
        with self._lock, self._rlock:
            self._db.close()
            self._rdb.close()
            while True:
                try:
                    self._readers.get_nowait().close()
                except queue.Empty:
                    break

    def add(self, beats: List[Dict[str, Any]]) -> Tuple[int, int]:
        """Store validated beats in one transaction. Returns (accepted, duplicates)."""
        return self.add_many([beats])[0]

    def add_many(self, batches: List[List[Dict[str, Any]]],
                 texts: Optional[List[List[str]]] = None) -> List[Tuple[int, int]]:
        """Several requests' beats in ONE transaction (group commit); (accepted, duplicates) per request.
        `texts`: each beat already as compact JSON (the validator made it), else it is serialised here."""
        received = self.now()
        results: List[Tuple[int, int]] = []
        newest: Dict[str, Dict[str, Any]] = {}  # each run's newest beat in these requests
        for beats in batches:
            for b in beats:
                prev = newest.get(b["run"])
                if prev is None or (b["seq"], b["attempt"]) > (prev["seq"], prev["attempt"]):
                    newest[b["run"]] = b
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                for n, beats in enumerate(batches):
                    accepted = 0
                    for i, b in enumerate(beats):
                        p = metric_point(b)
                        step = p.get("step")
                        # as received (validated), compact; never NaN/Infinity (a stored inf broke every read).
                        # The log tail matters on a run's newest beat only: a backlog's older beats and a late beat
                        # are stored without it (and the head a newer beat replaces loses it below), so a run's
                        # history does not hold its log once per beat.
                        # The trainer's points go to their own table: the document keeps their count.
                        kept = b
                        if b.get("log_tail") is not None and (
                                newest[b["run"]] is not b or (b["seq"], b["attempt"]) < self._heads.get(b["run"], (-1, -1))):
                            kept = {k: v for k, v in b.items() if k != "log_tail"}
                        if isinstance(b.get("points"), dict):
                            kept = dict(kept, points=points_summary(b["points"]))
                        if kept is not b:
                            doc = json.dumps(kept, separators=(",", ":"), allow_nan=False)
                        else:
                            doc = texts[n][i] if texts else json.dumps(b, separators=(",", ":"), allow_nan=False)
                        gpu_util, gpu_mem = gpu_numbers(b.get("gpus"))
                        cur.execute(
                            "INSERT OR IGNORE INTO beats (run, attempt, seq, time, received, state, step, loss, "
                            "eval_loss, lr, tokens_per_s, samples_per_s, doc, box, gpu_util, gpu_mem, ckpt) "
                            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                            (b["run"], b["attempt"], b["seq"], float(b["time"]), received, b["state"],
                             step if isinstance(step, int) else None, _num(p.get("loss")), _num(p.get("eval_loss")),
                             _num(p.get("lr")), _num(p.get("tokens_per_s")), _num(p.get("samples_per_s")), doc,
                             b["box"], gpu_util, gpu_mem, durable_name(b.get("checkpoint"))))
                        if cur.rowcount == 1:
                            accepted += 1
                            bid = cur.lastrowid
                            assert bid is not None  # the row just inserted
                            row = point_row(b, bid)
                            if row is not None:
                                cur.execute(POINTS_INSERT, row)
                    results.append((accepted, len(beats) - accepted))
                heads: Dict[str, Tuple[int, int]] = {}
                for run, b in newest.items():
                    head = self._heads.get(run)
                    if head is None or (b["seq"], b["attempt"]) >= head:
                        heads[run] = (b["seq"], b["attempt"])
                        if head is not None and head != heads[run]:  # the head it replaces keeps no log tail
                            cur.execute("UPDATE beats SET doc=json_remove(doc, '$.log_tail') WHERE run=? AND seq=? "
                                        "AND attempt=? AND doc LIKE '%\"log_tail\":%'",
                                        (run, head[0], head[1]))
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

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Cursor]:
        """A write of another table (controller/tracker/events.py) on the one writer connection: committed, or
        rolled back on any error."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    def runs(self) -> List[Dict[str, Any]]:
        return self.runs_checked()[0]

    def runs_checked(self) -> Tuple[List[Dict[str, Any]], int]:
        """(every run with its newest beat and liveness, how many bad rows were skipped)."""
        now = self.now()
        with self._rlock:
            rows = self._rdb.execute(
                "SELECT r.run, r.box, r.attempt, r.seq, r.received, r.interval_s, r.state, b.doc FROM runs r "
                "LEFT JOIN beats b ON b.run=r.run AND b.attempt=r.attempt AND b.seq=r.seq ORDER BY r.run").fetchall()
        out, skipped = [], 0
        for run, box, attempt, seq, received, interval, state, latest in rows:
            try:
                if not (isinstance(run, str) and _is_int(attempt) and _is_int(seq) and _finite(received)):
                    raise ValueError("bad runs columns")
                if interval is not None and not _finite(interval):
                    interval = None
                doc, problem = None, None
                if latest is not None:
                    try:
                        doc = _doc(latest)
                    except (ValueError, TypeError, RecursionError) as e:  # the run stays listed, marked, without it
                        skipped += 1
                        problem = "its newest beat %s" % (str(e)[:200] if isinstance(e, ValueError) else
                                                          "is unreadable (%s)" % type(e).__name__)
                        self._note_skip("newest beat of run %r" % (run,), e)
                entry = {"run": run, "box": box if isinstance(box, str) else None, "attempt": attempt, "seq": seq,
                         "state": state if isinstance(state, str) else None, "received": received,
                         "age_s": round(now - received, 3),
                         "liveness": liveness(state if isinstance(state, str) else None, received, interval, now),
                         "latest": doc}
                if problem:
                    entry["problem"] = problem
                out.append(entry)
            except (ValueError, TypeError, RecursionError) as e:
                skipped += 1
                self._note_skip("run %r" % (run,), e)
        return out, skipped

    def heartbeats(self, run: str, after: int = -1, limit: int = 100) -> List[Dict[str, Any]]:
        return self.heartbeats_checked(run, after, limit)[0]

    def heartbeats_checked(self, run: str, after: int = -1, limit: int = 100) -> Tuple[List[Dict[str, Any]], int, int]:
        """A run's beats with seq > after, in seq order; thinned beats come back as compact metric points.
        Returns (beats, bad rows skipped, the seq to page on from): a page that ends in skipped rows still moves
        the cursor past them, so paging never loops."""
        with self._rlock:
            rows = self._rdb.execute(
                "SELECT attempt, seq, time, state, step, loss, eval_loss, lr, tokens_per_s, samples_per_s, doc "
                "FROM beats WHERE run=? AND seq>? ORDER BY seq, attempt LIMIT ?", (run, after, limit)).fetchall()
        out, skipped, last = [], 0, after
        for attempt, seq, t, state, step, loss, eval_loss, lr, tps, sps, doc in rows:
            if _is_int(seq) and seq > last:
                last = seq
            try:
                if doc is not None:
                    out.append(_doc(doc))
                    continue
                if not (_is_int(attempt) and _is_int(seq)):
                    raise ValueError("bad beats columns")
                nums = [v if _finite(v) else None for v in (t, loss, eval_loss, lr, tps, sps)]
                out.append({"run": run, "attempt": attempt, "seq": seq, "time": nums[0],
                            "state": state if isinstance(state, str) else None, "thinned": True,
                            "progress": {"step": step if _is_int(step) else None, "loss": nums[1],
                                         "eval_loss": nums[2], "lr": nums[3], "tokens_per_s": nums[4],
                                         "samples_per_s": nums[5]}})
            except (ValueError, TypeError, RecursionError) as e:
                skipped += 1
                self._note_skip("beat %s/%r" % (run, seq), e)
        return out, skipped, last

    def _note_skip(self, what: str, e: Exception) -> None:
        self.skipped_total += 1
        if not self._skipped_logged:  # once: a poisoned table must not flood the log on every read
            self._skipped_logged = True
            log.warning("onbox tracker: skipping unreadable stored %s (%s); further ones are only counted "
                        "(skipped_rows in /healthz)", what, str(e)[:200])

    note_skip = _note_skip

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

    def query(self, sql: str, params: Tuple[Any, ...] = ()) -> List[Tuple[Any, ...]]:
        """Rows of one read, on one of up to READERS read connections (WAL: beside the writer, never blocking it;
        the sqlite3 module lets go of the GIL while SQLite works)."""
        try:
            db = self._readers.get_nowait()
        except queue.Empty:
            with self._readers_lock:
                make = self._readers_made < READERS
                self._readers_made += make
            if make:
                db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                db.execute("PRAGMA busy_timeout=5000")
            else:
                db = self._readers.get()
        try:
            return db.execute(sql, params).fetchall()
        finally:
            self._readers.put(db)

    def count(self) -> int:
        with self._rlock:
            return int(self._rdb.execute("SELECT COUNT(*) FROM beats").fetchone()[0])
