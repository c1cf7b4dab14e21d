"""The dashboard's run list: one summary row per run, sent again only when the run has new beats.

A row is what `onboxctl status --json` shows for the run (controller/tracker/runview.py's row_from_heartbeat over its
newest beat; liveness by controller/tracker/store.py's rules: LATE after 2 intervals, SILENT after 5, judged on
the tracker's clock), plus what the page shows beside it: the alerts with their messages and hints (every alert the
agent knows: its rules, the supervisor's and the checkpoint hook's warnings), the newest durable checkpoint (`none`
when nothing is committed), the work at risk as `onboxctl status` labels it, and what this machine knows of its
pull (controller/tracker/pulled.py).

Cheap at 100 boxes: a poll sends `after=<cursor>` (the highest beat id it has seen, `id` only grows) and gets full
rows only for the runs with a beat stored since, plus every run's liveness and age (a few bytes each: those
change with time alone). Summaries are kept per run until its newest beat changes, so 100 boxes beating cost one
document parse per new head, shared by every open page.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

from controller.tracker.pulled import PullsView
from controller.tracker.runview import LIVENESS_MARK, dig, risk_label, row_from_heartbeat
from controller.tracker.store import Store, liveness, parse_doc
from onbox.fsutil import json_safe

FULL_AFTER = 200000  # a cursor this far behind (or from another database) gets every row, not a scan of the gap
LOG_TAIL_LINES = 200
LOG_LINE_CHARS = 1000


def _text(v: Any, limit: int) -> Optional[str]:
    return str(v)[:limit] if v is not None else None


def log_tail(beat: Dict[str, Any]) -> Optional[List[str]]:
    """The tail of the job's output if the agent sent one: `log_tail` as a list of lines or {"lines": [...]}."""
    tail = beat.get("log_tail")
    if isinstance(tail, dict):
        tail = tail.get("lines")
    if isinstance(tail, str):
        tail = tail.splitlines()
    if not isinstance(tail, list):
        return None
    return [str(line)[:LOG_LINE_CHARS] for line in tail[-LOG_TAIL_LINES:]]


def phase_of(beat: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Where the run's [[phase]] curriculum stands, as its beat says (None for a plain run)."""
    p = beat.get("phase")
    if not isinstance(p, dict) or not isinstance(p.get("index"), int) or not isinstance(p.get("count"), int):
        return None
    return {"name": _text(p.get("name"), 100), "index": p["index"], "count": p["count"],
            "status": _text(p.get("status"), 32)}


def node_of(beat: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """This box's rank in a multi-node group over SSH, as its beat says (None for a single-box run)."""
    n = beat.get("node")
    if not isinstance(n, dict) or not isinstance(n.get("rank"), int) or not isinstance(n.get("nnodes"), int):
        return None
    return {"rank": n["rank"], "nnodes": n["nnodes"], "run": _text(n.get("run"), 256)}


def _deadline_of(block: Any) -> Optional[Dict[str, Any]]:
    """A beat's `deadline` block, its numbers kept only when they are numbers."""
    if not isinstance(block, dict):
        return None
    nums = {k: block.get(k) for k in ("at", "ask_at", "left_s", "commit_estimate_s", "asked_at")}
    out: Dict[str, Any] = {k: (v if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
                           for k, v in nums.items()}
    out["source"] = _text(block.get("source"), 64)
    return out


def summarise(run: str, box: Optional[str], attempt: int, seq: int, state: Optional[str],
              doc: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The row of one run from its newest beat (None: unreadable, the run is still listed)."""
    beat: Dict[str, Any] = doc if doc is not None else {"run": run, "box": box, "state": state, "attempt": attempt}
    # the fields of `onboxctl status --json` (RunRow.to_dict), without its deep copy: every field is flat here
    row = dict(vars(row_from_heartbeat(beat, box=box, run=run)))
    alerts: List[Any] = beat["alerts"] if isinstance(beat.get("alerts"), list) else []
    ckpt: Dict[str, Any] = beat["checkpoint"] if isinstance(beat.get("checkpoint"), dict) else {}
    latest = ckpt.get("latest_durable")
    durable = None
    if isinstance(latest, dict) and latest.get("name"):
        durable = {"name": _text(latest.get("name"), 256), "step": latest.get("step"),
                   "committed_at": latest.get("committed_at"), "digest": _text(latest.get("digest"), 200)}
    elif isinstance(latest, str) and latest:
        durable = {"name": latest[:256], "step": None, "committed_at": None, "digest": None}
    sync: Optional[Dict[str, Any]] = ckpt["last_sync"] if isinstance(ckpt.get("last_sync"), dict) else None
    row.update(
        seq=seq, time=beat.get("time"), eval_loss=dig(beat, "progress.eval_loss"), lr=dig(beat, "progress.lr"),
        alerts=[{"code": _text(a.get("code"), 64), "severity": _text(a.get("severity"), 16),
                 "message": _text(a.get("message"), 500), "hint": _text(a.get("hint"), 500)}
                for a in alerts if isinstance(a, dict)],
        durable=durable, box_verified=ckpt.get("verified") if isinstance(ckpt.get("verified"), bool) else None,
        last_sync={"ok": sync.get("ok"), "error": _text(sync.get("error"), 300), "at": sync.get("at")} if sync else None,
        preemption=beat.get("preemption") if isinstance(beat.get("preemption"), dict) else None,
        # the run's deadline as the agent reported it: {at, source, ask_at, left_s, commit_estimate_s, ...}
        deadline=_deadline_of(beat.get("deadline")),
        # work at risk as `onboxctl status` shows it (AT RISK: time/steps since the durable checkpoint's step)
        at_risk_text=risk_label(row.get("at_risk")),
        unreadable=doc is None, log_tail=log_tail(beat), phase=phase_of(beat), node=node_of(beat),
        log_lines_total=dig(beat, "log_tail.lines_total") if isinstance(beat.get("log_tail"), dict) else None)
    # "NaN"/"Infinity" strings as the beat carries them (a diverged loss): the row is sent as strict JSON
    return json_safe(row)


class Overview:
    """Summaries of every run, cached per run until its newest beat changes."""

    def __init__(self, store: Store, pulls: PullsView) -> None:
        self.store = store
        self.pulls = pulls
        self._cache: Dict[str, Tuple[Tuple[int, int], Dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def _heads(self, run: Optional[str] = None) -> Tuple[List[Tuple[Any, ...]], int]:
        sql = "SELECT run, box, attempt, seq, received, interval_s, state FROM runs"
        rows = self.store.query(sql + " WHERE run=?", (run,)) if run else self.store.query(sql + " ORDER BY run")
        good, skipped = [], 0
        for r in rows:
            run_, box, attempt, seq, received, interval, state = r
            ok = (isinstance(run_, str) and isinstance(attempt, int) and isinstance(seq, int)
                  and isinstance(received, (int, float)) and received == received)
            if not ok:
                skipped += 1
                self.store.note_skip("run %r" % (run_,), ValueError("bad runs columns"))
                continue
            good.append((run_, box if isinstance(box, str) else None, attempt, seq, float(received),
                         interval if isinstance(interval, (int, float)) else None,
                         state if isinstance(state, str) else None))
        return good, skipped

    def _summary(self, head: Tuple[Any, ...]) -> Tuple[Dict[str, Any], int]:
        run, box, attempt, seq, _, _, state = head
        cached = self._cache.get(run)
        if cached is not None and cached[0] == (attempt, seq):
            return cached[1], 0
        found = self.store.query("SELECT doc FROM beats WHERE run=? AND attempt=? AND seq=?", (run, attempt, seq))
        doc, skipped = None, 0
        if found and found[0][0] is not None:
            try:
                doc = parse_doc(found[0][0])
            except (ValueError, TypeError, RecursionError) as e:
                skipped = 1
                self.store.note_skip("newest beat of run %r" % (run,), e)
        row = summarise(run, box, attempt, seq, state, doc)
        self._cache[run] = ((attempt, seq), row)
        return row, skipped

    def _live(self, head: Tuple[Any, ...], row: Dict[str, Any], now: float) -> Dict[str, Any]:
        run, box, _, _, received, interval, state = head
        lv = liveness(state, received, interval, now)
        return {"liveness": lv, "mark": LIVENESS_MARK.get(lv), "age_s": round(now - received, 3),
                "received": received, "pulled": self.pulls.verdict(box, run, row.get("durable"))}

    def overview(self, after: int) -> Dict[str, Any]:
        """Rows of the runs with beats stored after the cursor `after` (all when -1), every run's liveness."""
        with self._lock:
            now = self.store.now()
            top = self.store.query("SELECT max(id) FROM beats")[0][0] or 0
            heads, skipped = self._heads()
            full = after < 0 or after > top or top - after > FULL_AFTER
            changed = set() if full else {r for (r,) in self.store.query(
                "SELECT DISTINCT run FROM beats WHERE id>? AND id<=?", (after, top))}
            self.pulls.refresh()
            rows, live = [], {}
            for head in heads:
                row, bad = self._summary(head)
                skipped += bad
                live[head[0]] = self._live(head, row, now)
                if full or head[0] in changed:
                    rows.append(dict({k: v for k, v in row.items() if k != "log_tail"}, **live[head[0]],
                                     has_log=row.get("log_tail") is not None))
        return {"cursor": top, "now": now, "full": full, "runs": rows, "live": live,
                "pulls_note": self.pulls.caveat, "pulls_problem": self.pulls.problem, "skipped_rows": skipped}

    def run(self, run: str) -> Optional[Dict[str, Any]]:
        """One run's full row (with the log tail if the agent sends one), or None when there is no such run."""
        with self._lock:
            heads, _ = self._heads(run)
            if not heads:
                return None
            self.pulls.refresh()
            row, _ = self._summary(heads[0])
            return dict(row, **self._live(heads[0], row, self.store.now()), pulls_note=self.pulls.caveat,
                        pulls_problem=self.pulls.problem)
