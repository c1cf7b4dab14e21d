"""A run's curves for the dashboard: its beats as columns (one array per metric, the shape a chart draws) and the
events seen between consecutive beats (a restart, a replacement box, a preemption, a commit, a failure).

Read from the metric columns of `beats` (controller/tracker/store.py), which thinning keeps, so a curve outlives
its beats' documents. Paged by seq like `GET /api/v1/runs/<run>/heartbeats`: `after` is the last seq the page
has, and only newer beats are read (the index on (run, seq)), so a live page's poll costs what changed.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from controller.tracker.store import Store, durable_name, gpu_numbers, parse_doc

COLUMNS = ("seq", "time", "attempt", "step", "loss", "eval_loss", "lr", "tokens_per_s", "gpu_util", "gpu_mem")
FAILED_STATES = {"failed", "crash_loop"}
# a legacy row (stored before the box/gpu/ckpt columns existed) has box NULL: those come from its document
_SELECT = ("SELECT seq, time, attempt, step, loss, eval_loss, lr, tokens_per_s, gpu_util, gpu_mem, state, box, ckpt, "
           "CASE WHEN box IS NULL THEN doc END FROM beats WHERE run=? ")


def _finite(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class Point:
    __slots__ = ("seq", "time", "attempt", "step", "loss", "eval_loss", "lr", "tokens_per_s", "gpu_util", "gpu_mem",
                 "state", "box", "ckpt")

    def __init__(self, row: Tuple[Any, ...]) -> None:
        seq, t, attempt, step, loss, eval_loss, lr, tps, gpu_util, gpu_mem, state, box, ckpt, legacy_doc = row
        if _int(seq) is None or _int(attempt) is None:
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
        self.state = state if isinstance(state, str) else None
        self.box = box if isinstance(box, str) else None
        self.ckpt = ckpt if isinstance(ckpt, str) else None


def events_between(prev: Optional[Point], cur: Point) -> List[Tuple[str, str]]:
    """(kind, text) for what changed from one beat to the next: restart (a new attempt), box (the run moved to
    another box), preempted, failed, commit (a newer durable checkpoint)."""
    if prev is None:
        return []
    out = []
    moved = bool(cur.box and prev.box and cur.box != prev.box)
    if cur.attempt > prev.attempt:
        out.append(("restart", "attempt %d%s" % (cur.attempt, " on %s" % cur.box if moved else "")))
    if moved:
        out.append(("box", "now on %s (was %s)" % (cur.box, prev.box)))
    if cur.state != prev.state and cur.state == "preempted":
        out.append(("preempted", "preempted on %s" % (cur.box or "its box")))
    if cur.state != prev.state and cur.state in FAILED_STATES:
        out.append(("failed", cur.state))
    if cur.ckpt and cur.ckpt != prev.ckpt:
        out.append(("commit", cur.ckpt))
    return out


def read_series(store: Store, run: str, after: int = -1, limit: int = 5000) -> Dict[str, Any]:
    """Beats of `run` with seq > after (at most `limit`), as columns, with the events among them (the beat at
    `after` is read too, so an event on the first new beat is seen). `next_after` pages on; `more` says a full
    page came back."""
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
    events: List[Dict[str, Any]] = []
    last = after
    for row in rows:
        if _int(row[0]) is not None and row[0] > last:
            last = row[0]
        try:
            p = Point(row)
        except (ValueError, TypeError, RecursionError) as e:
            skipped += 1
            store.note_skip("beat %s/%r" % (run, row[0]), e)
            continue
        for kind, text in events_between(prev, p):
            events.append({"seq": p.seq, "time": p.time, "step": p.step if p.step is not None else
                           (prev.step if prev is not None else None), "kind": kind, "text": text})
        for c in COLUMNS:
            cols[c].append(getattr(p, c))
        prev = p
    return {"run": run, "points": cols, "events": events, "next_after": last, "more": len(rows) >= limit,
            "skipped_rows": skipped}
