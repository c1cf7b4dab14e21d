"""What `onboxctl status` adds from the keeper's records: each kept run's keeper state (RECOVERING, the number of
recoveries, where it lives now), the bound on its work at risk, and a row for a kept run nobody else reports (its
box is gone and there is no tracker). Read-only: status never writes a record."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from controller.goodput.atrisk import ALERT, AtRisk, work_at_risk
from controller.keeper.policy import LaunchRecord
from controller.keeper.records import RecordProblem, RecordStore, RunKeep
from controller.tracker.runview import RunRow


def _bound(row: RunRow, bound: Optional[float]) -> None:
    risk = dict(row.at_risk or {})
    if not risk:
        return
    risk["bound"] = bound
    risk["alert"] = AtRisk(risk.get("seconds"), risk.get("steps"), risk.get("durable_step"), bound).alert
    row.at_risk = risk
    if risk["alert"] and ALERT not in row.alerts:
        row.alerts.append(ALERT)


def apply_keeper(rows: List[RunRow], store: Optional[RecordStore] = None, default_bound: Optional[float] = None
                 ) -> Tuple[List[RunRow], List[Dict[str, Any]], List[str]]:
    """(the rows with keeper fields and bounds, each kept run's summary with its events, record problems)."""
    problems: List[str] = []
    docs: List[Dict[str, Any]] = []
    bounds: Dict[str, Optional[float]] = {}
    try:
        store = store or RecordStore()
        names = store.runs()
    except RecordProblem as e:
        return rows, docs, [e.message]
    for name in names:
        try:
            rec, keep = store.load(name)
        except RecordProblem as e:
            problems.append(e.message)
            continue
        doc = dict(summary(rec, keep), events=keep.events)
        docs.append(doc)
        runs = rec.node_runs() if len(rec.boxes) == len(keep.boxes) else [rec.run]
        lite = {k: doc[k] for k in ("state", "recoveries", "boxes", "phase", "pool", "message")}
        mine = [r for r in rows if r.run in runs]
        for r in mine:
            on_old_box = r.source == "ssh" and r.box not in keep.boxes
            r.keeper = {"moved_to": list(keep.boxes)} if on_old_box else lite
            bounds[r.run] = rec.policy.max_at_risk
        if not mine:
            seen = keep.last_seen
            risk = work_at_risk(seen.get("step"), None, seen.get("durable_step"), seen.get("durable_at"))
            rows.append(RunRow(box=keep.boxes[0], run=rec.run, state=str(seen.get("state") or "?"),
                               step=seen.get("step"), durable_step=risk.durable_step, at_risk=risk.to_dict(),
                               liveness="unknown", source="keeper", keeper=lite))
            bounds[rec.run] = rec.policy.max_at_risk
    for r in rows:
        own = bounds.get(r.run)
        _bound(r, own if own is not None else default_bound)
    return rows, docs, problems


def summary(rec: LaunchRecord, keep: RunKeep) -> Dict[str, Any]:
    """One run as `keep --json` and `status --json` show it."""
    from controller.keeper.recovery import open_phase, split

    cur = keep.current
    return {"run": rec.run, "state": "recovering" if keep.recovering else keep.state.value,
            "keeper_state": keep.state.value, "boxes": list(keep.boxes), "recoveries": keep.recoveries,
            "pool": rec.policy.pool, "message": keep.message, "phase": open_phase(cur) if keep.recovering else None,
            "current": dict(cur.to_dict(), split=split(cur)) if cur else None,
            "last": keep.history[-1].to_dict() if keep.history else None, "last_seen": keep.last_seen,
            "max_at_risk": rec.policy.max_at_risk}
