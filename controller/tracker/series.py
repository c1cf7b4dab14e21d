"""A run's curves for the dashboard: its beats as columns (one JSON array per metric, the shape a chart draws) and
the events seen between consecutive beats (a restart, a replacement box, a preemption, a commit, a failure).

Read from the metric columns of `beats` (controller/tracker/store.py), which thinning keeps, so a curve outlives
its beats' documents. Paged by seq like `GET /api/v1/runs/<run>/heartbeats`: `after` is the last seq the page
has, and only newer beats are read (the index on (run, seq)), so a live page's poll costs what changed.

Opening a page reads up to 20,000 rows, from the covering index beats_points alone (store.py). The work is done
by SQLite, not Python: one statement builds the arrays (json_group_array), one finds the rows whose attempt, box,
state or checkpoint differ from the row before (a window), and the sqlite3 module releases the GIL while they
run, so the event loop keeps answering the agents meanwhile (a Python loop over 10,000 rows held the GIL for tens
of milliseconds). SQLite writes numbers with 15 significant
digits. Rows this store would never write (a column of the wrong type), rows of an older database (no `box`
column yet: their GPU and checkpoint come from the document) and an SQLite without JSON or window functions take
the Python path, which gives the same answer.
"""
from __future__ import annotations

import json
import math
import re
import sqlite3
from typing import Any, Dict, List, Optional, Tuple

from controller.tracker.columns import POINT_FIELDS, durable_name, gpu_numbers
from controller.tracker.store import Store, parse_doc
from onbox import vocab

COLUMNS = ("seq", "time", "attempt", "step", "loss", "eval_loss", "lr", "tokens_per_s", "gpu_util", "gpu_mem")
FAILED_STATES = vocab.FAILED_STATES
# a legacy row (stored before the box/gpu/ckpt columns existed) has box NULL: those come from its document
_SELECT = ("SELECT seq, time, attempt, step, loss, eval_loss, lr, tokens_per_s, gpu_util, gpu_mem, state, box, ckpt, "
           "CASE WHEN box IS NULL THEN doc END FROM beats WHERE run=? ")


def _num_sql(col: str) -> str:
    return "CASE WHEN typeof(%s)='integer' OR (typeof(%s)='real' AND abs(%s)<=1.7e308) THEN %s END" % ((col,) * 4)


_ARRAYS = {"seq": "seq", "time": "round(%s, 3)" % _num_sql("time"), "attempt": "attempt",
           "step": "CASE WHEN typeof(step)='integer' THEN step END"}
_ODD = ("typeof(seq)!='integer' OR typeof(attempt)!='integer' OR box IS NULL OR typeof(box)!='text' "
        "OR (state IS NOT NULL AND typeof(state)!='text') OR (ckpt IS NOT NULL AND typeof(ckpt)!='text')")
_ROWS = "FROM beats WHERE run=?1 AND seq>?2 ORDER BY seq, attempt LIMIT ?3"  # beats_points alone answers it
_POINTS_SQL = "SELECT sum(%s), count(*), max(seq), %s FROM (SELECT %s %s)" % (
    _ODD, ", ".join("json_group_array(%s)" % _ARRAYS.get(c, _num_sql(c)) for c in COLUMNS),
    ", ".join((*COLUMNS, "state", "box", "ckpt")), _ROWS)
# the rows whose attempt, box, state or checkpoint differ from the row before (the row at `after` included); the
# window's order is the index's, so SQLite needs no sort
_EVENTS_SQL = """
SELECT json_group_array(json_array(seq, attempt, %s, %s, state, box, ckpt, pa, pb, ps, pc,
                                   CASE WHEN typeof(pst)='integer' THEN pst END))
FROM (SELECT seq, attempt, time, step, state, box, ckpt, lag(attempt) OVER w AS pa, lag(box) OVER w AS pb,
             lag(state) OVER w AS ps, lag(ckpt) OVER w AS pc, lag(step) OVER w AS pst
      FROM beats WHERE run=?1 AND seq>=?2 AND seq<=?3 WINDOW w AS (ORDER BY seq, attempt))
WHERE seq>?4 AND pa IS NOT NULL AND (attempt IS NOT pa OR box IS NOT pb OR state IS NOT ps OR ckpt IS NOT pc)
""" % (_ARRAYS["time"], _ARRAYS["step"])


def _finite(v: Any) -> Optional[float]:
    if type(v) is float:  # the columns hold finite floats or NULL (store.py writes nothing else): the fast path
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _int(v: Any) -> Optional[int]:
    return v if type(v) is int else None


Key = Tuple[int, Optional[str], Optional[str], Optional[str]]  # attempt, box, state, newest durable checkpoint


class Point:
    """One beat's row, checked: a column this store would never write raises ValueError (the row is skipped)."""
    __slots__ = (*COLUMNS, "state", "box", "ckpt")

    def __init__(self, row: Tuple[Any, ...]) -> None:
        seq, t, attempt, step, loss, eval_loss, lr, tps, gpu_util, gpu_mem, state, box, ckpt, legacy_doc = row
        if type(seq) is not int or type(attempt) is not int:
            raise ValueError("bad beats columns")
        if legacy_doc is not None:
            doc = parse_doc(legacy_doc)
            gpu_util, gpu_mem = gpu_numbers(doc.get("gpus"))
            box, ckpt = doc.get("box"), durable_name(doc.get("checkpoint"))
        self.seq, self.attempt, self.step = seq, attempt, _int(step)
        t = _finite(t)
        self.time = round(t, 3) if t is not None else None
        self.loss, self.eval_loss, self.lr = _finite(loss), _finite(eval_loss), _finite(lr)
        self.tokens_per_s, self.gpu_util, self.gpu_mem = _finite(tps), _finite(gpu_util), _finite(gpu_mem)
        self.state = state if type(state) is str else None
        self.box = box if type(box) is str else None
        self.ckpt = ckpt if type(ckpt) is str else None

    def key(self) -> Key:
        return self.attempt, self.box, self.state, self.ckpt


def events_between(prev: Optional[Key], cur: Key) -> List[Tuple[str, str]]:
    """(kind, text) for what changed from one beat to the next: restart (a new attempt), box (the run moved to
    another box), preempted, failed, commit (a newer durable checkpoint)."""
    if prev is None:
        return []
    (attempt, box, state, ckpt), (p_attempt, p_box, p_state, p_ckpt) = cur, prev
    out = []
    moved = bool(box and p_box and box != p_box)
    if attempt > p_attempt:
        out.append(("restart", "attempt %d%s" % (attempt, " on %s" % box if moved else "")))
    if moved:
        out.append(("box", "now on %s (was %s)" % (box, p_box)))
    if state != p_state and state == vocab.PREEMPTED:
        out.append(("preempted", "preempted on %s" % (box or "its box")))
    if state != p_state and state in FAILED_STATES:
        out.append(("failed", str(state)))
    if ckpt and ckpt != p_ckpt:
        out.append(("commit", ckpt))
    return out


def _event(seq: int, t: Any, step: Any, kind: str, text: str) -> Dict[str, Any]:
    return {"seq": seq, "time": t, "step": step, "kind": kind, "text": text}


def _read_sql(store: Store, run: str, after: int, limit: int) -> Optional[Dict[str, Any]]:
    """The arrays and events built by SQLite (no GIL held), or None when this page needs the Python path."""
    try:
        odd, count, top, *arrays = store.query(_POINTS_SQL, (run, after, limit))[0]
        if odd:
            return None
        changed = "[]"
        if count:
            prev = store.query("SELECT seq, %s FROM beats WHERE run=? AND seq<=? ORDER BY seq DESC, attempt DESC "
                               "LIMIT 1" % _ODD, (run, after)) if after >= 0 else []
            if prev and prev[0][1]:
                return None
            lower = prev[0][0] if prev else after + 1  # from the row before the page, to compare the first with
            changed = store.query(_EVENTS_SQL, (run, lower, top, after))[0][0]
    except sqlite3.OperationalError:  # an SQLite without JSON or window functions
        return None
    events = []
    for seq, attempt, t, step, state, box, ckpt, pa, pb, ps, pc, pst in json.loads(changed):
        for kind, text in events_between((pa, pb, ps, pc), (attempt, box, state, ckpt)):
            events.append(_event(seq, t, step if step is not None else pst, kind, text))
    return {"run": run, "points_json": "{%s}" % ",".join('"%s":%s' % kv for kv in zip(COLUMNS, arrays)),
            "events": events, "next_after": top if count else after, "more": count >= limit, "skipped_rows": 0}


def _read_python(store: Store, run: str, after: int, limit: int) -> Dict[str, Any]:
    rows = store.query(_SELECT + "AND seq>? ORDER BY seq, attempt LIMIT ?", (run, after, limit))
    prev: Optional[Point] = None
    skipped = 0
    if after >= 0:
        before = store.query(_SELECT + "AND seq<=? ORDER BY seq DESC, attempt DESC LIMIT 1", (run, after))
        try:
            prev = Point(before[0]) if before else None
        except (ValueError, TypeError, RecursionError):
            prev = None
    cols: Dict[str, List[Any]] = {c: [] for c in COLUMNS}
    appends = [cols[c].append for c in COLUMNS]
    events: List[Dict[str, Any]] = []
    last = after
    prev_key = prev.key() if prev is not None else None
    for row in rows:
        if type(row[0]) is int and row[0] > last:
            last = row[0]
        try:
            p = Point(row)
        except (ValueError, TypeError, RecursionError) as e:
            skipped += 1
            store.note_skip("beat %s/%r" % (run, row[0]), e)
            continue
        key = p.key()
        if key != prev_key:
            step = p.step if p.step is not None else (prev.step if prev is not None else None)
            for kind, text in events_between(prev_key, key):
                events.append(_event(p.seq, p.time, step, kind, text))
            prev_key = key
        for add, c in zip(appends, COLUMNS):
            add(getattr(p, c))
        prev = p
    return {"run": run, "points_json": json.dumps(cols, separators=(",", ":")), "events": events,
            "next_after": last, "more": len(rows) >= limit, "skipped_rows": skipped}


def read_series(store: Store, run: str, after: int = -1, limit: int = 5000, python: bool = False) -> Dict[str, Any]:
    """Beats of `run` with seq > after (at most `limit`): `points_json` (a JSON object of one array per column),
    the events among them (the beat at `after` is compared with the first new one, so no event falls between
    two pages), `next_after` to page on, `more` when a full page came back. `python`: skip SQLite's path."""
    found = None if python else _read_sql(store, run, after, limit)
    found = found if found is not None else _read_python(store, run, after, limit)
    _commit_steps(store, run, found["events"])
    return found


def _commit_steps(store: Store, run: str, events: List[Dict[str, Any]]) -> None:
    """Each commit event's `ckpt_step`: the step of the checkpoint committed (its beat's latest_durable), which the
    page ticks the axis at, not the step the beat that saw it was at (null when the beat's document is gone)."""
    commits = [e for e in events if e["kind"] == "commit"]
    for i in range(0, len(commits), 500):
        part = commits[i:i + 500]
        try:
            rows = store.query("SELECT seq, CASE WHEN json_valid(doc) THEN json_extract(doc, "
                               "'$.checkpoint.latest_durable.step') END FROM beats WHERE run=? AND seq IN (%s)"
                               % ",".join("?" * len(part)), (run, *[e["seq"] for e in part]))
        except sqlite3.OperationalError:  # an SQLite without JSON functions: the beat's step stays the tick's
            rows = []
        steps = {seq: step for seq, step in rows if type(step) is int}
        for e in part:
            e["ckpt_step"] = steps.get(e["seq"])


# -- the trainer's own points (the `points` table: every record the agent parsed, not one per beat) ---------------
TRAINER_COLUMNS = ("seq", "attempt", "time", "step", *POINT_FIELDS)
# What the store writes in a column: a JSON array of finite numbers (as Python writes them: at most 19 digits
# before the point, else one digit and an exponent below 308) and nulls. A row that holds anything else (a
# hand-edited database, 1e999) is served as nulls and counted, never spliced into the answer.
_NUMBER = (r"-?(?:(?:0|[1-9][0-9]{0,18})(?:\.[0-9]+)?"
           r"|[1-9](?:\.[0-9]+)?[eE](?:-[0-9]{1,3}|\+?(?:[0-9]{1,2}|[12][0-9]{2}|30[0-7])))")
_ARRAY = re.compile(r"\[(?:(?:%s|null)(?:,(?:%s|null))*)?\]" % (_NUMBER, _NUMBER))


_TRAINER_ROWS = "SELECT bid, n, seq, attempt, %s FROM points WHERE run=? AND bid>? AND bid<=? ORDER BY bid" % (
    ", ".join(TRAINER_COLUMNS[2:]))


def _spliced_sql() -> str:
    """One statement that checks every stored column (SQLite's JSON parser: a JSON array of n values) and splices
    the page's arrays together, each column one string, all of it in SQLite (which runs without the GIL): a
    column no record carried, or one that fails the check, becomes n nulls; seq and attempt are repeated n times.
    Rows whose n, seq or attempt are not what the store writes are left out. Counts the rows and columns left out
    or nulled."""
    def repeat(value: str) -> str:  # value n times, comma-separated (hex(zeroblob(n)) is "00" n times)
        return "substr(replace(hex(zeroblob(n)), '00', %s || ','), 1, n * (length(%s) + 1) - 1)" % (value, value)

    def ok(c: str) -> str:  # (malformed JSON fails the statement: the Python check then reads the page)
        return f"CASE WHEN typeof({c})='text' THEN json_array_length({c})=n ELSE 0 END AS ok_{c}"

    metrics = TRAINER_COLUMNS[2:]
    inner = "SELECT n, seq, attempt, %s, %s FROM points WHERE run=?1 AND bid>?2 AND bid<=?3 ORDER BY bid" % (
        ", ".join(metrics), ", ".join(ok(c) for c in metrics))
    good = "typeof(n)='integer' AND n>0 AND typeof(seq)='integer' AND typeof(attempt)='integer'"
    pieces = ["group_concat(CASE WHEN %s THEN %s END, ',')" % (good, repeat(c)) for c in ("seq", "attempt")]
    pieces += ["group_concat(CASE WHEN %s THEN CASE WHEN ok_%s THEN substr(%s, 2, length(%s) - 2) ELSE %s END END, "
               "',')" % (good, c, c, c, repeat("'null'")) for c in metrics]
    bad = " + ".join("(%s IS NOT NULL AND NOT ok_%s)" % (c, c) for c in metrics)
    return "SELECT sum(NOT (%s)), sum(CASE WHEN %s THEN %s ELSE 0 END), %s FROM (%s)" % (
        good, good, bad, ", ".join(pieces), inner)


_TRAINER_SPLICED = _spliced_sql()


def read_trainer(store: Store, run: str, after: int = -1, limit: int = 100000, python: bool = False) -> Dict[str, Any]:
    """The trainer's points of `run` that beats with id > after brought, in the order they arrived (a beat at a
    time, its records in their order), at most `limit` records and never part of a beat's (a beat larger than
    `limit`, which the API's least limit rules out, comes whole): `points_json` (one array per TRAINER_COLUMNS),
    `next_after` (the id of the last beat read), `more`, `skipped_rows`. The stored arrays are spliced together as
    they are, by SQLite (no work per point in Python, and no GIL held while it works). Each is checked first (a row
    this store would never write is served as nulls and counted): by SQLite's JSON parser; else (an SQLite without
    JSON functions, or `python`) by a regular expression of what the store writes, in Python."""
    sizes = store.query("SELECT bid, n FROM points WHERE run=? AND bid>? ORDER BY bid LIMIT ?", (run, after, limit + 1))
    upto, total, more = after, 0, False
    for bid, n in sizes:
        if type(bid) is not int:
            continue
        n = n if type(n) is int and n > 0 else 0  # a bad row: read below (skipped and counted), the cursor past it
        if total + n > limit and total > 0:
            more = True
            break
        upto, total = bid, total + n
    if len(sizes) > limit and not more:  # the page ended on the row count: beats with no records (never written)
        more = True
    cols: Dict[str, List[str]] = {c: [] for c in TRAINER_COLUMNS}
    skipped = 0
    spliced = False
    if upto > after and not python:
        try:
            bad_rows, bad_cols, *joined = store.query(_TRAINER_SPLICED, (run, after, upto))[0]
        except sqlite3.OperationalError:  # an SQLite without JSON functions, or a column that is not JSON (never
            # written by this store): the Python check below
            pass
        else:
            skipped = int(bad_rows or 0) + int(bad_cols or 0)
            if skipped:
                store.note_skip("points of a beat of %s" % run, ValueError("%d bad rows or columns" % skipped))
            for c, text in zip(TRAINER_COLUMNS, joined):
                if text:
                    cols[c].append(text)
            spliced = True
    rows = store.query(_TRAINER_ROWS, (run, after, upto)) if upto > after and not spliced else []
    for row in rows:
        bid, n, seq, attempt, *texts = row
        if not (type(n) is int and n > 0 and type(seq) is int and type(attempt) is int):
            skipped += 1
            store.note_skip("points of beat %s/%r" % (run, bid), ValueError("bad points columns"))
            continue
        cols["seq"].append(("%d," % seq * n)[:-1])
        cols["attempt"].append(("%d," % attempt * n)[:-1])
        for c, text in zip(TRAINER_COLUMNS[2:], texts):
            if text is None:
                cols[c].append(("null," * n)[:-1])
            elif type(text) is str and _ARRAY.fullmatch(text) and text.count(",") + 1 == n:
                cols[c].append(text[1:-1])
            else:
                skipped += 1
                store.note_skip("points of beat %s/%r" % (run, bid), ValueError("bad %s column" % c))
                cols[c].append(("null," * n)[:-1])
    points_json = "{%s}" % ",".join('"%s":[%s]' % (c, ",".join(parts)) for c, parts in cols.items())
    return {"points_json": points_json, "next_after": upto, "more": more, "skipped_rows": skipped}


def series_body(series: Dict[str, Any], extra: Dict[str, Any], trainer: Optional[Dict[str, Any]] = None) -> bytes:
    """The response: the points as SQLite wrote them (never parsed and re-encoded here), the rest as JSON; with
    `trainer`, its block: {"points": {...}, "next_after": <beat id>, "more": ...}."""
    rest = {k: v for k, v in series.items() if k != "points_json"}
    rest.update(extra)
    tail = json.dumps(rest, separators=(",", ":"), allow_nan=False)
    head = '{"points":' + series["points_json"] + ","
    if trainer is not None:
        head += '"trainer":{"points":%s,"next_after":%d,"more":%s,"skipped_rows":%d},' % (
            trainer["points_json"], trainer["next_after"], "true" if trainer["more"] else "false",
            trainer.get("skipped_rows", 0))
    return (head + tail[1:]).encode("utf-8")
