"""`GET /metrics`: every run and its GPUs in the OpenMetrics text format, for Prometheus (its `authorization`
scrape setting carries the tracker's bearer token). The series and the GPU names (those of NVIDIA's DCGM exporter,
so its dashboards and alerts read them as they are) are in METRICS.md.

Bounded cost: a run's lines are rendered once per newest beat and kept (the runs that beat since the last scrape
are rendered again: their newest documents are read in one query); per scrape, each run's ledger (the goodput
book's fold, fed the beats stored since) and the keeper's recoveries (one grouped query) are added. Rendering runs in
a worker thread, never on the event loop that takes the agents' beats.
"""
from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from controller.goodput.ledger import CATEGORIES
from controller.tracker.goodput import GoodputBook
from controller.tracker.runfacts import RunFacts
from controller.tracker.store import Store, parse_doc

CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# the classic text format, for a client that does not ask for OpenMetrics (curl, `promtool check metrics`): the same
# samples; an info family is a gauge named <family>_info and a counter's family carries its `_total`; no `# EOF`
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MIB = 1048576.0

# (family, type, help): the order of the exposition. Counters' samples carry `_total`, the info's `_info`.
RUN_FAMILIES: Tuple[Tuple[str, str, str], ...] = (
    ("onbox_run", "info", "A run: its box, the box's profile and pool (the inventory), its state (value 1)."),
    ("onbox_run_alert", "gauge", "An alert the agent has open on the run (value 1): its code and severity."),
    ("onbox_run_step", "gauge", "The newest step the trainer reported."),
    ("onbox_run_loss", "gauge", "The newest training loss the trainer reported."),
    ("onbox_run_tokens_per_second", "gauge", "The newest tokens/s the trainer reported."),
    ("onbox_run_last_beat_timestamp_seconds", "gauge", "When the tracker received the run's newest beat."),
    ("onbox_run_heartbeat_interval_seconds", "gauge", "The agent's heartbeat interval (late after 2, silent after 5)."),
    ("onbox_run_work_at_risk_seconds", "gauge", "Training time since the newest durable checkpoint (lost if the box "
                                                "is lost now)."),
    ("onbox_run_work_at_risk_steps", "gauge", "Steps since the newest durable checkpoint."),
    ("onbox_run_durable_checkpoint_step", "gauge", "The step of the newest durable checkpoint."),
    ("onbox_run_durable_checkpoint_timestamp_seconds", "gauge", "When the newest durable checkpoint was committed."),
    ("onbox_run_restarts", "counter", "Lives of the run after its first (a restart after a crash, a relaunch, a "
                                      "recovery, a requeue)."),
    ("onbox_run_preemptions", "counter", "Preemptions the run's agents handled."),
    ("onbox_run_recoveries", "counter", "Recoveries the keeper relaunched."),
    ("onbox_run_goodput_ratio", "gauge", "Productive training time over the run's wall time since its first launch."),
    ("onbox_run_wall_seconds", "gauge", "The run's wall time since its first launch."),
    ("onbox_run_ledger_seconds", "gauge", "The run's wall time by part: productive, recomputed, down, restoring, "
                                          "starting, stalled (they sum to onbox_run_wall_seconds)."),
)
# NVIDIA DCGM exporter's names and units (METRICS.md has the mapping to the beat's readings)
GPU_FAMILIES: Tuple[Tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Throttling reasons (NVML's bitmask)."),
    # counters in DCGM's text exposition; OpenMetrics would add `_total` to a counter's name, so gauges here
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "gauge", "Single-bit volatile ECC errors (a count that only grows)."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "gauge", "Double-bit volatile ECC errors (a count that only grows)."),
)
_SUFFIX = {"counter": "_total", "info": "_info"}
YIELD_EVERY = 10  # runs rendered between two chances for the event loop to run
MAX_AGE = 5.0  # seconds a run's ledger may lag its beats in a scrape (carried on meanwhile: GoodputBook.ledgers)


def label(v: Any) -> str:
    """A label value as OpenMetrics writes it: backslash, double quote and newline escaped."""
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def labels(**kv: Any) -> str:
    return "{%s}" % ",".join('%s="%s"' % (k, label(v)) for k, v in kv.items() if v is not None)


def value(v: Any) -> Optional[str]:
    """A sample's value (None: not a number, the sample is left out); the beats' "NaN"/"Infinity" strings too."""
    if isinstance(v, str):
        return {"NaN": "NaN", "Infinity": "+Inf", "-Infinity": "-Inf"}.get(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _dig(doc: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc


def _add(out: Dict[str, List[str]], family: str, kind: str, lab: str, v: Any) -> None:
    text = value(v)
    if text is not None:
        out.setdefault(family, []).append("%s%s%s %s" % (family, _SUFFIX.get(kind, ""), lab, text))


_KINDS = {f: k for f, k, _ in RUN_FAMILIES + GPU_FAMILIES}


def render_beat(run: str, box: Optional[str], state: Optional[str], doc: Optional[Dict[str, Any]],
                facts: Dict[str, Any]) -> Dict[str, List[str]]:
    """The lines of one run that its newest beat decides, by family."""
    out: Dict[str, List[str]] = {}
    r = labels(run=run)
    _add(out, "onbox_run", "info", labels(run=run, box=box or "", profile=facts.get("profile") or "",
                                           pool=facts.get("pool") or "", state=state or ""), 1)
    if doc is None:
        return out
    for family, path in (("onbox_run_step", ("progress", "step")), ("onbox_run_loss", ("progress", "loss")),
                         ("onbox_run_tokens_per_second", ("progress", "tokens_per_s")),
                         ("onbox_run_heartbeat_interval_seconds", ("interval_s",)),
                         ("onbox_run_durable_checkpoint_step", ("checkpoint", "latest_durable", "step")),
                         ("onbox_run_durable_checkpoint_timestamp_seconds",
                          ("checkpoint", "latest_durable", "committed_at"))):
        _add(out, family, _KINDS[family], r, _dig(doc, *path))
    alerts = doc.get("alerts")
    seen = set()
    for a in alerts if isinstance(alerts, list) else []:
        if isinstance(a, dict) and isinstance(a.get("code"), str) and a["code"] not in seen:
            seen.add(a["code"])
            _add(out, "onbox_run_alert", "gauge", labels(run=run, code=a["code"][:64], severity=str(
                a.get("severity") or "warning")[:16]), 1)
    gpus = _dig(doc, "gpus", "gpus")
    for g in gpus if isinstance(gpus, list) else []:
        if isinstance(g, dict):
            _gpu_lines(out, g, box, run)
    return out


def _gpu_lines(out: Dict[str, List[str]], g: Dict[str, Any], box: Optional[str], run: str) -> None:
    """One GPU's DCGM samples: the hot loop of a scrape (8,000 GPUs), so the values are formatted inline."""
    lab = labels(gpu=g.get("index") if isinstance(g.get("index"), int) else "", UUID=g.get("uuid"),
                 modelName=g.get("name"), Hostname=box or "", run=run)
    used: Any = g.get("memory_used_bytes")
    total: Any = g.get("memory_total_bytes")
    events = g.get("xid_events")
    xids = [e.get("xid") for e in events if isinstance(e, dict)] if isinstance(events, list) else []
    ecc: Dict[str, Any] = g["ecc"] if isinstance(g.get("ecc"), dict) else {}
    values: Tuple[Any, ...] = (g.get("util_percent"), g.get("memory_util_percent"), _mib(used),
              _mib(total - used) if _num(total) and _num(used) else None, g.get("temperature_c"), g.get("power_w"),
              g.get("sm_clock_mhz"), xids[-1] if xids else 0, g.get("throttle_mask"), ecc.get("corrected_volatile"),
              ecc.get("uncorrected_volatile"))
    for family, v in zip(_GPU_NAMES, values):
        kind = type(v)
        if kind is float:
            text = repr(v) if v - v == 0 else value(v)  # finite, else NaN/+Inf/-Inf
        elif kind is int:
            text = str(v)
        else:
            text = value(v)
        if text is not None:
            lines = out.get(family)
            if lines is None:
                lines = out[family] = []
            lines.append(family + lab + " " + text)


_GPU_NAMES = tuple(f for f, _, _ in GPU_FAMILIES)


_PATHS = ("$.progress.step", "$.progress.loss", "$.progress.tokens_per_s", "$.interval_s",
          "$.checkpoint.latest_durable.step", "$.checkpoint.latest_durable.committed_at", "$.alerts", "$.gpus.gpus")


def _picked(text: Any) -> Optional[List[Any]]:
    """The _PATHS of a stored document read whole (None: unreadable, skipped like any bad row)."""
    try:
        doc = parse_doc(text)
    except (ValueError, TypeError, RecursionError):
        return None
    return [_dig(doc, *p[2:].split(".")) for p in _PATHS]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mib(v: Any) -> Optional[float]:
    return round(v / MIB, 3) if _num(v) else None


class Exposition:
    """The /metrics text, built from the store, the goodput book and the inventory."""

    def __init__(self, store: Store, book: GoodputBook, facts: RunFacts) -> None:
        self.store, self.book, self.facts = store, book, facts
        self._cache: Dict[str, Tuple[Tuple[Any, ...], Dict[str, List[str]]]] = {}
        self._lock = threading.Lock()

    def _heads(self) -> List[Tuple[Any, ...]]:
        return self.store.query("SELECT run, box, attempt, seq, received, state FROM runs ORDER BY run")

    def _beat_lines(self, heads: List[Tuple[Any, ...]]) -> Dict[str, Dict[str, List[str]]]:
        boxes = self.facts.boxes()
        stale = [h for h in heads if isinstance(h[0], str) and self._cache.get(h[0], ((),))[0] != (
            h[1], h[2], h[3], h[5], str(boxes.get(h[1] or "", "")))]
        docs = self._newest(stale)
        for n, (run, box, attempt, seq, _received, state) in enumerate(stale):
            if n % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)  # let the event loop take the agents' beats now, not at the GIL's next switch (5 ms)
            doc = docs.get(run)
            key = (box, attempt, seq, state, str(boxes.get(box or "", "")))
            self._cache[run] = (key, render_beat(run, box if isinstance(box, str) else None,
                                                 state if isinstance(state, str) else None, doc,
                                                 boxes.get(box or "", {})))
        names = {h[0] for h in heads}
        for gone in set(self._cache) - names:
            del self._cache[gone]
        return {run: lines for run, (_, lines) in self._cache.items()}

    def _newest(self, heads: List[Tuple[Any, ...]]) -> Dict[str, Dict[str, Any]]:
        """What render_beat reads of each run's newest beat, a page of runs per query: SQLite picks the fields out of
        the documents (one parse each, in C, without the GIL); a document that is not JSON (never written here)
        makes that page read whole documents, each checked on its own."""
        out: Dict[str, Dict[str, Any]] = {}
        for i in range(0, len(heads), 500):
            part = heads[i:i + 500]
            keys = " OR ".join(["(run=? AND attempt=? AND seq=?)"] * len(part))
            params = tuple(x for h in part for x in (h[0], h[2], h[3]))
            try:
                rows = self.store.query("SELECT run, CASE WHEN doc IS NOT NULL THEN json_extract(doc, %s) END FROM "
                                        "beats WHERE %s" % (", ".join("'%s'" % p for p in _PATHS), keys), params)
            except sqlite3.OperationalError:
                rows = [(run, _picked(doc)) for run, doc in self.store.query("SELECT run, doc FROM beats WHERE " + keys,
                                                                              params)]
            for run, picked in rows:
                try:
                    got = json.loads(picked) if isinstance(picked, str) else picked
                except (ValueError, RecursionError) as e:
                    self.store.note_skip("newest beat of run %r" % (run,), e)
                    continue
                if isinstance(got, list) and len(got) == len(_PATHS):
                    step, loss, tps, interval, dstep, dat, alerts, gpus = got
                    out[run] = {"progress": {"step": step, "loss": loss, "tokens_per_s": tps}, "interval_s": interval,
                                "checkpoint": {"latest_durable": {"step": dstep, "committed_at": dat}},
                                "alerts": alerts, "gpus": {"gpus": gpus}}
        return out

    def _recoveries(self) -> Dict[str, int]:
        """run -> the keeper's recoveries that relaunched it (its events; none on a store without them)."""
        try:
            rows = self.store.query("SELECT run, count(DISTINCT json_extract(doc, '$.recovery')) FROM events WHERE "
                                    "kind='relaunched' AND json_valid(doc) GROUP BY run")
        except sqlite3.OperationalError:  # no events table (a store the app did not open), no JSON functions
            return {}
        return {r: n for r, n in rows if isinstance(r, str) and isinstance(n, int)}

    def render(self, openmetrics: bool = True) -> str:
        """The exposition: OpenMetrics (what Prometheus asks for), else the classic text format."""
        with self._lock:
            now = self.store.now()
            heads = self._heads()
            per_run = self._beat_lines(heads)
            ledgers = self.book.ledgers(now, max_age=MAX_AGE)
            recoveries = self._recoveries()
            dyn: Dict[str, List[str]] = {}
            for n, (run, _box, _attempt, _seq, received, _state) in enumerate(heads):
                if n % (YIELD_EVERY * 10) == 0:
                    time.sleep(0)
                if not isinstance(run, str):
                    continue
                r = labels(run=run)
                _add(dyn, "onbox_run_last_beat_timestamp_seconds", "gauge", r, received)
                _add(dyn, "onbox_run_recoveries", "counter", r, recoveries.get(run, 0))
                led = ledgers.get(run)
                if led is None:
                    continue
                _add(dyn, "onbox_run_work_at_risk_seconds", "gauge", r, led.at_risk_s)
                _add(dyn, "onbox_run_work_at_risk_steps", "gauge", r, led.at_risk_steps)
                _add(dyn, "onbox_run_restarts", "counter", r, led.restarts)
                _add(dyn, "onbox_run_preemptions", "counter", r, led.preemptions)
                _add(dyn, "onbox_run_goodput_ratio", "gauge", r, led.goodput)
                _add(dyn, "onbox_run_wall_seconds", "gauge", r, round(led.wall, 3))
                parts = led.parts
                for part in CATEGORIES:
                    _add(dyn, "onbox_run_ledger_seconds", "gauge", labels(run=run, part=part), round(parts[part], 3))
            out: List[str] = []
            order = [per_run[run] for run in sorted(per_run)]
            for family, kind, text in RUN_FAMILIES + GPU_FAMILIES:
                time.sleep(0)
                lines = [line for lines_of in order for line in lines_of.get(family, ())]
                lines += dyn.get(family, [])
                out.append(_head(family, kind, text, openmetrics))
                if lines:
                    out.append("\n".join(lines) + "\n")
            tracker = [("onbox_tracker_runs", "gauge", "Runs the tracker knows.", len(heads)),
                       ("onbox_tracker_skipped_rows", "counter", "Stored rows a read skipped as unreadable.",
                        self.store.skipped_total)]
            for family, kind, text, v in tracker:
                out.append(_head(family, kind, text, openmetrics) + "%s%s %s\n" % (family, _SUFFIX.get(kind, ""), v))
            if openmetrics:
                out.append("# EOF\n")
            return "".join(out)


def _head(family: str, kind: str, text: str, openmetrics: bool) -> str:
    if not openmetrics:  # the classic format names the family as its samples are named
        family, kind = family + _SUFFIX.get(kind, ""), "gauge" if kind == "info" else kind
    return "# TYPE %s %s\n# HELP %s %s\n" % (family, kind, family, text)
