"""What `onboxctl status` shows: every run as one normalized row, from the tracker or from the boxes, and the
table a person reads at a glance.

Sources:
- the tracker: `GET /api/v1/runs` (controller/tracker/API.md) -> each run with its latest heartbeat and liveness,
  read by controller/tracker/client.py (re-exported here): `read_tracker` tells "the tracker answered: these runs,
  these skipped" (one bad run never hides the others) from "the tracker could not be read: why";
  `fetch_tracker_runs` is the same read as a document, raising when it could not be read;
- without a tracker: `onbox status --json` on each box over ssh (the run's state.json and progress).

Text that arrived from outside (box names, states, alert codes, checkpoint names from beats) is printed through
onbox.untrusted.printable: it can neither drive the terminal nor forge a line of the table.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Dict, Iterable, List, Optional

from controller.goodput.atrisk import AtRisk, work_at_risk
from controller.tracker.client import (  # noqa: F401 (re-exported: status and the keeper read the tracker here)
    RUNS_MAX_BYTES,
    SkippedRun,
    TrackerView,
    check_runs,
    fetch_tracker_runs,
    read_tracker,
    view_of_answer,
)
from onbox.telemetry.alerts import recorded_alerts
from onbox.untrusted import printable
from onbox.vocab import CRITICAL, ENDED_STATES, alert_from

LIVENESS_MARK = {"late": "LATE", "silent": "SILENT"}  # tracker liveness; "ok" and "ended" need no mark


@dataclasses.dataclass
class RunRow:
    box: str
    run: str
    state: str = "?"
    attempt: Optional[int] = None
    step: Optional[int] = None
    loss: Optional[float] = None
    tokens_per_s: Optional[float] = None
    gpu_util: Optional[float] = None  # percent, mean over the box's GPUs
    gpu_mem_used: Optional[int] = None  # bytes, summed
    gpu_mem_total: Optional[int] = None  # bytes, summed
    checkpoint: Optional[str] = None  # newest durable checkpoint (name, or step); "none" when nothing is committed
    age_s: Optional[float] = None  # seconds since the newest heartbeat
    liveness: str = "ok"  # ok | late | silent | ended (tracker) | unknown (asked over ssh)
    alerts: List[str] = dataclasses.field(default_factory=list)  # the open alerts' codes (onbox.vocab)
    # each open alert in full, as the agent raised it: {code, severity, message, hint} (a WARN line in the table)
    alert_details: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    source: str = "tracker"
    phase: Optional[str] = None  # "2/3 finetune": where a [[phase]] curriculum stands (None for a plain run)
    step_time: Optional[float] = None  # when the newest step was seen (the box's clock)
    durable_step: Optional[int] = None  # the newest durable checkpoint's step: the recovery point
    durable_at: Optional[float] = None  # when it was committed (the box's clock)
    durable_step_time: Optional[float] = None  # when the trainer reported its step (the box's clock): work at risk
    at_risk: Optional[Dict[str, Any]] = None  # work at risk (controller/goodput/atrisk.py): seconds, steps, bound, alert
    keeper: Optional[Dict[str, Any]] = None  # `onboxctl keep`'s word on the run (state, recoveries, where it lives)
    interval_s: Optional[float] = None  # the agent's heartbeat interval, as its beat says (the tracker's clock)
    # the run's deadline as its beat or `onbox status` says: {at, ask_at, asked_at, source} (the box's clock)
    deadline: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def dig(doc: Any, *paths: str) -> Any:
    """The first non-None value among dotted paths (`progress.step`, `step`), tolerant of missing levels."""
    for path in paths:
        cur = doc
        for part in path.split("."):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            else:
                cur = None
                break
        if cur is not None:
            return cur
    return None


def _num(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


def _ckpt_label(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, dict):
        name = v.get("name") or v.get("path")
        step = v.get("step")
        if name and step is not None and str(step) not in os.path.basename(str(name)):
            return "%s@%s" % (os.path.basename(str(name)), step)
        return os.path.basename(str(name)) if name else ("step %s" % step if step is not None else None)
    return os.path.basename(str(v))


def _durable_label(checkpoint: Any) -> Optional[str]:
    """The DURABLE CKPT cell: the newest durable checkpoint, `none` when the agent reports that nothing is committed
    (never its durable target's path, whose last part is the run's own name), None when it reports nothing."""
    if not isinstance(checkpoint, dict):
        return None
    return _ckpt_label(checkpoint.get("latest_durable")) or "none"


def row_from_heartbeat(beat: Dict[str, Any], box: Optional[str] = None, run: Optional[str] = None,
                       liveness: Optional[str] = None, age_s: Optional[float] = None, now: Optional[float] = None,
                       source: str = "tracker") -> RunRow:
    raw_gpus = beat.get("gpus")
    if isinstance(raw_gpus, dict):  # onbox.heartbeat/1: {"available": bool, "gpus": [...], "reason": ...}
        raw_gpus = raw_gpus.get("gpus")
    gpus: List[Any] = [g for g in raw_gpus if isinstance(g, dict)] if isinstance(raw_gpus, list) else []
    utils = [_num(dig(g, "util_percent", "util", "utilization")) for g in gpus]
    utils_ok = [u for u in utils if u is not None]
    used = [_num(dig(g, "memory_used_bytes", "mem_used")) for g in gpus]
    total = [_num(dig(g, "memory_total_bytes", "mem_total")) for g in gpus]
    t = _num(dig(beat, "time", "updated_at"))
    if age_s is None and t is not None:
        age_s = max(0.0, (now if now is not None else time.time()) - t)
    raw_alerts: List[Any] = beat["alerts"] if isinstance(beat.get("alerts"), list) else []
    alerts = [a for a in (alert_from(x) for x in raw_alerts) if a is not None]
    step = _num(dig(beat, "progress.step", "step"))
    attempt = _num(dig(beat, "attempt"))
    durable = dig(beat, "checkpoint.latest_durable")
    durable_step = _num(durable.get("step")) if isinstance(durable, dict) else None
    durable_at = _num(durable.get("committed_at")) if isinstance(durable, dict) else None
    # the checkpoint's own step time (the trainer's report at its step), else its commit: up to a sync interval late
    durable_step_time = _num(durable.get("step_time")) if isinstance(durable, dict) else None
    step_time = _num(dig(beat, "progress.time")) or t
    risk = work_at_risk(int(step) if step is not None else None, step_time,
                        int(durable_step) if durable_step is not None else None,
                        durable_step_time if durable_step_time is not None else durable_at)
    return RunRow(
        box=str(box or beat.get("box") or "?"),
        run=str(run or beat.get("run") or "?"),
        state=str(dig(beat, "state") or "?"),
        attempt=int(attempt) if attempt is not None else None,
        step=int(step) if step is not None else None,
        loss=_num(dig(beat, "progress.loss", "loss")),
        tokens_per_s=_num(dig(beat, "progress.tokens_per_s", "tokens_per_s")),
        gpu_util=sum(utils_ok) / len(utils_ok) if utils_ok else None,
        gpu_mem_used=int(sum(x for x in used if x is not None)) if any(x is not None for x in used) else None,
        gpu_mem_total=int(sum(x for x in total if x is not None)) if any(x is not None for x in total) else None,
        checkpoint=_durable_label(beat.get("checkpoint")),
        age_s=age_s,
        liveness=str(liveness or "ok"),
        alerts=[a["code"] for a in alerts], alert_details=alerts,
        source=source,
        phase=_phase_label(beat.get("phase")),
        step_time=step_time, durable_step=risk.durable_step, durable_at=durable_at,
        durable_step_time=durable_step_time, at_risk=risk.to_dict(),
        interval_s=_interval(beat.get("interval_s")),
        deadline=_deadline(beat.get("deadline")),
    )


def _deadline(v: Any) -> Optional[Dict[str, Any]]:
    """The beat's deadline block, its times checked: None without one (most runs) or when `at` is no time."""
    if not isinstance(v, dict) or _num(v.get("at")) is None or not math.isfinite(_num(v.get("at")) or 0.0):
        return None
    return {"at": _num(v["at"]), "ask_at": _num(v.get("ask_at")), "asked_at": _num(v.get("asked_at")),
            "source": str(v.get("source") or "?")}


def _interval(v: Any) -> Optional[float]:
    f = _num(v)
    return f if f is not None and math.isfinite(f) and f > 0 else None


def _phase_label(phase: Any) -> Optional[str]:
    """"2/3 finetune" from a beat's (or state.json's) `phase`: index counted from 1, then the name."""
    if not isinstance(phase, dict) or not isinstance(phase.get("index"), int) or not isinstance(phase.get("count"), int):
        return None
    name = str(phase.get("name") or "")[:40]
    return ("%d/%d %s" % (phase["index"] + 1, phase["count"], name)).strip()


def rows_from_tracker(doc: Any, now: Optional[float] = None) -> List[RunRow]:
    """Rows from `GET /api/v1/runs` (a list, or {"runs": [...]}); each entry holds the latest beat."""
    entries = doc.get("runs", []) if isinstance(doc, dict) else doc
    rows = []
    for e in entries or []:
        if not isinstance(e, dict):
            continue
        beat = dig(e, "latest", "last_heartbeat", "heartbeat", "latest_heartbeat")
        beat = beat if isinstance(beat, dict) else e
        liveness = dig(e, "liveness.state", "liveness", "status")
        if isinstance(liveness, dict):
            liveness = None
        age = _num(dig(e, "age_s", "liveness.age_s", "age", "seconds_since"))
        rows.append(row_from_heartbeat(beat, box=dig(e, "box") or beat.get("box"), run=dig(e, "run", "name"),
                                       liveness=str(liveness) if liveness else None, age_s=age, now=now))
    return sorted(rows, key=lambda r: (r.box, r.run))


def rows_from_box_status(box: str, doc: Any, now: Optional[float] = None) -> List[RunRow]:
    """Rows from `onbox status --json` run on a box (one run, a list, or {"runs": [...]})."""
    if isinstance(doc, dict) and isinstance(doc.get("runs"), list):
        entries = doc["runs"]
    elif isinstance(doc, list):
        entries = doc
    elif isinstance(doc, dict) and doc:
        entries = [doc]
    else:
        entries = []
    rows = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        merged = dict(e)
        merged.setdefault("run", e.get("name") or e.get("run"))
        if "progress" not in merged and isinstance(e.get("latest"), dict):
            merged["progress"] = e["latest"]
        if not isinstance(merged.get("alerts"), list):  # what the agent's records say, as its beats would carry it
            merged["alerts"] = [a.to_dict() for a in recorded_alerts(e, e.get("checkpoint") if isinstance(
                e.get("checkpoint"), dict) else None)]
        rows.append(row_from_heartbeat(merged, box=box, liveness="unknown", age_s=box_age(e), now=now, source="ssh"))
    return rows


def box_age(entry: Dict[str, Any]) -> Optional[float]:
    """The age of the newest news a box recorded of a run, on the box's clock: `onbox status --json`'s `read_at`
    (when the box read it) less the newest of its agent's last beat (`beat_at`), the trainer's last progress and
    the last state change. None from an agent too old to say `read_at` (the caller's clock then decides)."""
    read_at = _num(entry.get("read_at"))
    news = [t for t in (_num(entry.get("beat_at")), _num(dig(entry, "progress.time", "latest.time")),
                        _num(entry.get("updated_at"))) if t is not None and math.isfinite(t)]
    if read_at is None or not math.isfinite(read_at) or not news:
        return None
    return max(0.0, read_at - max(news))


# -- the heartbeat hint ----------------------------------------------------------------------------------------
DEFAULT_INTERVAL = 30.0  # the agent's default --heartbeat-interval (onbox/config.py), the tracker's fallback too
LONG_INTERVAL = 10.0  # seconds between beats from which the table is noticeably behind the trainer
OVERDUE = 1.5  # a beat older than this many intervals is overdue (the tracker marks LATE after 2)
SUGGESTED_INTERVAL = 5  # what the hint suggests: a beat is a few hundred bytes, 5 s costs nothing


def beat_hint(rows: Iterable[RunRow]) -> Optional[str]:
    """One line when what the table shows from the tracker lags the trainers noticeably: a live run beats every
    LONG_INTERVAL s or slower (the default 30 s does), or its newest beat is overdue (past OVERDUE intervals, not
    yet LATE). It names the run that lags most and `--heartbeat-interval`. Rows read over ssh are never behind a
    beat; LATE, SILENT and ended runs are marked in the table already."""
    live = [r for r in rows if r.source == "tracker" and r.liveness == "ok" and r.state not in ENDED_STATES]
    overdue = [r for r in live if r.age_s is not None and r.age_s > OVERDUE * (r.interval_s or DEFAULT_INTERVAL)]
    slow = [r for r in live if (r.interval_s or DEFAULT_INTERVAL) >= LONG_INTERVAL]
    if not overdue and not slow:
        return None
    fix = "`onboxctl run --heartbeat-interval %d` beats more often" % SUGGESTED_INTERVAL
    if overdue:
        r = max(overdue, key=lambda x: x.age_s or 0.0)
        return ("%s/%s's newest beat is %s old, overdue for a run that beats every %s: its row is that far behind "
                "the trainer (a busy box or a slow link?); %s" % (r.box, r.run, fmt_age(r.age_s), _every(r), fix))
    r = max(slow, key=lambda x: x.interval_s or DEFAULT_INTERVAL)
    more = " (and %d more run(s))" % (len(slow) - 1) if len(slow) > 1 else ""
    return ("the table is as old as each run's newest beat: %s/%s beats every %s%s, so its step and loss can be "
            "that far behind; %s" % (r.box, r.run, _every(r), more, fix))


def _every(r: RunRow) -> str:
    return "%g s" % r.interval_s if r.interval_s else "%g s (the default)" % DEFAULT_INTERVAL


# -- rendering -------------------------------------------------------------------------------------------------
def fmt_age(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s < 90:
        return "%ds" % s
    if s < 5400:
        return "%dm" % (s // 60)
    return "%.1fh" % (s / 3600)


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    gib = n / float(1 << 30)
    return "%.1fG" % gib if gib >= 1 else "%dM" % (n >> 20)


def fmt_num(v: Optional[float], digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if abs(v) >= 1000:
        return "%.0f" % v
    return ("%%.%dg" % digits) % v


def at_risk_label(r: RunRow) -> str:
    return risk_label(r.at_risk)


def risk_label(at_risk: Optional[Dict[str, Any]]) -> str:
    """The AT RISK cell of a row's `at_risk` (`12m/340`, ` !` past its bound): onboxctl status and the dashboard."""
    if not at_risk:
        return "-"
    risk = AtRisk(at_risk.get("seconds"), at_risk.get("steps"), at_risk.get("durable_step"), at_risk.get("bound"))
    return risk.label() + (" !" if risk.alert else "")


def keeper_label(r: RunRow) -> str:
    """`watching 1x`, `RECOVERING 2x (pushed)`, `failed_no_resource`, `moved to spare1`: the KEEP column."""
    k = r.keeper
    if not k:
        return "-"
    if k.get("moved_to"):
        return "moved to %s" % ",".join(k["moved_to"])
    state = str(k.get("state"))
    text = "%s %dx" % (state.upper() if state == "recovering" else state, int(k.get("recoveries") or 0))
    return text + (" (%s)" % k["phase"] if state == "recovering" and k.get("phase") else "")


def deadline_label(r: RunRow, now: float) -> str:
    """`4.2h` left (and `ckpt in 3m` once the ask is near), `asked` once the checkpoint was asked for, `passed`;
    `-` without a deadline or once the run ended: the DEADLINE column."""
    d = r.deadline
    if not d or r.state in ENDED_STATES:
        return "-"
    left = d["at"] - now
    if left <= 0:
        return "passed"
    if d.get("asked_at") is not None:
        return "%s, asked" % fmt_age(left)
    ask = d.get("ask_at")
    if ask is not None and ask - now < 3600:  # within the hour: when the checkpoint will be asked for matters
        return "%s, ckpt in %s" % (fmt_age(left), fmt_age(max(0.0, ask - now)))
    return fmt_age(left)


def render_table(rows: Iterable[RunRow], now: Optional[float] = None) -> str:
    """The status table: one line a run; heartbeat age with LATE/SILENT marked; alerts at the end of the line.
    AT RISK is time/steps since the newest durable checkpoint (`!` past the run's --max-at-risk); KEEP is there
    when `onboxctl keep` watches a run; DEADLINE (the time left before the session's end) when a run has one."""
    rows = list(rows)
    now = time.time() if now is None else now
    kept = any(r.keeper for r in rows)
    walled = any(r.deadline for r in rows)
    head: tuple = ("BOX", "RUN", "STATE", "ATT", "STEP", "LOSS", "TOK/S", "GPU%", "GPU MEM", "DURABLE CKPT",
                   "AT RISK") + (("KEEP",) if kept else ()) + (("DEADLINE",) if walled else ()) + ("BEAT",)
    lines = [head]
    for r in rows:
        mem = "-" if r.gpu_mem_used is None else "%s/%s" % (fmt_bytes(r.gpu_mem_used), fmt_bytes(r.gpu_mem_total))
        beat = fmt_age(r.age_s)
        mark = LIVENESS_MARK.get(r.liveness)
        if mark:
            beat = "%s %s" % (beat, mark)
        state = "%s (phase %s)" % (r.state, r.phase) if r.phase else r.state
        lines.append((r.box, r.run, state, "-" if r.attempt is None else str(r.attempt),
                      "-" if r.step is None else str(r.step), fmt_num(r.loss), fmt_num(r.tokens_per_s, 3),
                      "-" if r.gpu_util is None else "%.0f" % r.gpu_util, mem, r.checkpoint or "-",
                      at_risk_label(r)) + ((keeper_label(r),) if kept else ()) + (
                      (deadline_label(r, now),) if walled else ()) + (
                      beat + ("  ! " + ",".join(r.alerts) if r.alerts else ""),))
    lines = [tuple(printable(c) for c in line) for line in lines]  # box, state, alerts ... came in beats
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = []
    for i, line in enumerate(lines):
        cells = [c.ljust(w) for c, w in zip(line[:-1], widths)] + [line[-1]]
        out.append("  ".join(cells).rstrip())
        out += warn_lines(rows[i - 1]) if i else []
    if len(lines) == 1:
        out.append("(no runs)")
    return "\n".join(out) + "\n"


def warn_lines(r: RunRow) -> List[str]:
    """One line under the run per open alert the agent raised, what it says and what to do: `  WARN code: message
    — hint` (`CRIT` for a critical one). Text from beats, made printable."""
    out = []
    for a in r.alert_details:
        text = "%s: %s" % (a["code"], a["message"] or "(no message)") + (" — %s" % a["hint"] if a["hint"] else "")
        out.append("  %s %s" % ("CRIT" if a["severity"] == CRITICAL else "WARN", printable(" ".join(text.split()))))
    return out
