"""Events: what happened to a run that no heartbeat says, each with its time: the keeper's decisions (detected,
declared_lost, box_chosen, pushed, relaunched, first_new_step, failed_no_resource, ...). An extension of API v1
(API.md, "Events"): `POST /api/v1/events` and `GET /api/v1/runs/<run>/events`.

Table `events(id, run, time, kind, source, doc)`, UNIQUE (run, time, kind, source): a sender that resends an event
whose acknowledgement it never saw gets it counted under `duplicates`, stored once (the keeper resends from its
own record after a restart). The document is the event as sent (compact, strict JSON, at most 16 KiB, nesting at
most onbox.untrusted.MAX_DEPTH levels like a beat); `id` only grows and is the reader's cursor.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Tuple

from controller.tracker.store import Store, parse_doc
from onbox.heartbeat.schema import MAX_TIME, RUN_RE
from onbox.untrusted import MAX_DEPTH, depth

TABLE = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY, run TEXT NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL, source TEXT NOT NULL,
    doc TEXT NOT NULL, UNIQUE (run, time, kind, source)
)"""
KIND_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
MAX_EVENTS = 1000  # per request
MAX_DOC = 16 * 1024  # bytes of one event


def ensure_table(store: Store) -> None:
    with store.transaction() as cur:
        cur.execute(TABLE)


def check_event(doc: Any) -> Tuple[List[str], str]:
    """(problems, the event as compact JSON): `run`, `time` and `kind` required; `source` (default "keeper") and
    `text` strings; anything else is kept as sent."""
    if not isinstance(doc, dict):
        return ["an event must be a JSON object"], ""
    if depth(doc, MAX_DEPTH) > MAX_DEPTH:  # the bound every reader of the tracker keeps (as for beats)
        deep = [k for k, v in doc.items() if 1 + depth(v, MAX_DEPTH) > MAX_DEPTH]
        return ["%s nests more than %d levels deep" % (str(deep[0])[:64] if deep else "the event", MAX_DEPTH)], ""
    errs = []
    if not isinstance(doc.get("run"), str) or not RUN_RE.fullmatch(doc["run"]):
        errs.append("run must be a run name")
    t = doc.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t < MAX_TIME:
        errs.append("time must be a number of seconds since the epoch")
    if not isinstance(doc.get("kind"), str) or not KIND_RE.fullmatch(doc["kind"]):
        errs.append("kind must be lower-case letters, digits and '_' (at most 64)")
    if doc.get("text") is not None and not isinstance(doc["text"], str):
        errs.append("text must be a string")
    src = doc.get("source")
    if src is not None and (not isinstance(src, str) or not 0 < len(src) <= 64):
        errs.append("source must be a string of 1 to 64 characters")
    if errs:
        return errs, ""
    try:
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as e:
        return ["not storable JSON: %s" % e], ""
    if len(text.encode("utf-8")) > MAX_DOC:
        return ["an event is at most %d bytes" % MAX_DOC], ""
    return [], text


def add_events(store: Store, events: List[Dict[str, Any]], texts: List[str]) -> Tuple[int, int]:
    """Checked events in one transaction: (accepted, duplicates)."""
    accepted = 0
    with store.transaction() as cur:
        for ev, text in zip(events, texts):
            cur.execute("INSERT OR IGNORE INTO events (run, time, kind, source, doc) VALUES (?,?,?,?,?)",
                        (ev["run"], float(ev["time"]), ev["kind"], ev.get("source") or "keeper", text))
            accepted += cur.rowcount == 1
    return accepted, len(events) - accepted


def run_events(store: Store, run: str, after: int = 0, limit: int = 100) -> Tuple[List[Dict[str, Any]], int, int]:
    """A run's events with id > after, in id order: (events, rows skipped as unreadable, the id to page on)."""
    rows = store.query("SELECT id, doc FROM events WHERE run=? AND id>? ORDER BY id LIMIT ?", (run, after, limit))
    out, skipped, last = [], 0, after
    for id_, doc in rows:
        last = max(last, id_) if isinstance(id_, int) else last
        try:
            ev = parse_doc(doc)
        except (ValueError, TypeError, RecursionError) as e:
            skipped += 1
            store.note_skip("event %s/%r" % (run, id_), e)
            continue
        out.append(dict(ev, id=id_))
    return out, skipped, last
