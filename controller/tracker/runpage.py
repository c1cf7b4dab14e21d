"""What a run page shows of a run at a glance, besides its curves (API.md, "Dashboard"): how it was launched (the
command line, the durable target: the launch records, runfacts.py), its box's profile and pool, when it started and
how long it has run (its goodput ledger: from its first agent's start, on the box's clock), its heartbeat interval,
its work at risk (the newest step and its time less the newest durable checkpoint's step and its time: the figure
`onboxctl status` shows, from the run's newest beat), its ledger (the split of its
wall time, and what each part cost where the boxes have a price) and, once it stopped without finishing, the next
step: who brings it back (the keeper, Slurm) or the command that does.
"""
from __future__ import annotations

import json
import shlex
from typing import Any, Dict, List, Optional

from controller.goodput.ledger import Ledger
from controller.tracker.ledgers import money
from controller.tracker.runfacts import RunFacts
from controller.tracker.store import Store
from onbox import vocab
from onbox.untrusted import printable

KEEPER_GAVE_UP = {vocab.KEPT_FAILED_NO_RESOURCE: "found no box",
                  vocab.KEPT_FAILED_MAX_RECOVERIES: "reached its most recoveries",
                  vocab.KEPT_FAILED_LAUNCH: "could not launch it",
                  vocab.KEPT_NEEDS_A_PERSON: "needs a person"}
# the keeper's newest event says it is not bringing the run back now
KEEPER_AT_REST = (vocab.KEPT_ENDED, vocab.KEPT_FIRST_NEW_STEP, vocab.KEPT_LAUNCHED, vocab.KEPT_SUSPECT_CLEARED)
STOPPED_SHORT = vocab.FAILED_STATES | {vocab.PREEMPTED, vocab.FENCED}


def _keeper_events(store: Store, run: str) -> List[Dict[str, Any]]:
    rows = store.query("SELECT doc FROM events WHERE run=? ORDER BY id DESC LIMIT 50", (run,))
    out = []
    for (doc,) in rows:
        try:
            ev = json.loads(doc) if isinstance(doc, str) else None
        except ValueError:
            continue
        if isinstance(ev, dict) and (ev.get("source") or "keeper") == "keeper" and isinstance(ev.get("kind"), str):
            out.append(ev)
    return out[::-1]


def _slurm_job(store: Store, run: str) -> Optional[str]:
    rows = store.query("SELECT json_extract(b.doc, '$.slurm.job_id') FROM runs r JOIN beats b ON b.run=r.run AND "
                       "b.attempt=r.attempt AND b.seq=r.seq WHERE r.run=? AND json_valid(b.doc)", (run,))
    job = rows[0][0] if rows else None
    return printable(job)[:64] if isinstance(job, str) and job else None


def next_step(run: str, state: Optional[str], liveness: Optional[str], durable_step: Optional[int],
              keeper: List[Dict[str, Any]], slurm_job: Optional[str], launch: Optional[Dict[str, Any]],
              box: Optional[str]) -> Optional[Dict[str, str]]:
    """Who brings a run back that stopped short (preempted, failed, fenced, or whose beats stopped), and how; None
    for a run that trains or ended as it should."""
    if state not in STOPPED_SHORT and liveness != "silent":
        return None
    at = " from step %d (its newest durable checkpoint)" % durable_step if durable_step is not None else ""
    if state == vocab.FENCED:
        return {"by": "none", "text": "a newer lease holds the run: another agent took it over, this box's agent "
                                      "stopped; nothing to do here"}
    if keeper:
        last = keeper[-1]
        if last["kind"] in KEEPER_GAVE_UP:
            return {"by": "you", "text": "the keeper %s (%s): relaunch it with `onboxctl run --recover pool:POOL ...`"
                                         ", which resumes it%s" % (KEEPER_GAVE_UP[last["kind"]],
                                                                   printable(last.get("text") or "")[:300], at)}
        if last["kind"] not in KEEPER_AT_REST:
            n = last.get("recovery")
            return {"by": "keeper", "text": "the keeper is bringing it back%s: %s %s" % (
                " (recovery %s)" % n if isinstance(n, int) else "", last["kind"], printable(last.get("text") or "")
                [:300])}
        return {"by": "keeper", "text": "the keeper relaunches it at its next pass (`onboxctl keep`); it resumes%s"
                                        % at}
    if slurm_job and state == vocab.PREEMPTED:
        return {"by": "slurm", "text": "Slurm requeues job %s: the run resumes%s when the job starts again (`squeue "
                                       "-j %s`)" % (slurm_job, at, slurm_job)}
    cmd = launch.get("command") if launch else None
    where = (launch or {}).get("box") or box or "BOX"
    how = "`onboxctl run %s -- %s`" % (where, " ".join(shlex.quote(w) for w in cmd)) if cmd else \
        "`onboxctl run %s -- <its command>`" % where
    return {"by": "you", "text": "relaunch it: %s resumes it%s (or launch it with --recover pool:POOL and "
                                 "`onboxctl keep` does it)" % (how, at)}


def _at_risk(summary: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    risk = summary.get("at_risk")
    if not isinstance(risk, dict):
        return None
    return {"steps": risk.get("steps"), "seconds": risk.get("seconds"), "durable_step": risk.get("durable_step"),
            "text": summary.get("at_risk_text")}


def run_page(store: Store, facts: RunFacts, run: str, summary: Optional[Dict[str, Any]], ledger: Optional[Ledger],
             ) -> Dict[str, Any]:
    """The run page's facts of `run` (summary: its row in the overview)."""
    summary = summary or {}
    box = summary.get("box")
    launch = facts.launch(run)
    entry = facts.boxes().get(box or "", {})
    heads = store.query("SELECT interval_s FROM runs WHERE run=?", (run,))
    interval = heads[0][0] if heads and isinstance(heads[0][0], (int, float)) else None
    durable: Dict[str, Any] = summary["durable"] if isinstance(summary.get("durable"), dict) else {}
    out: Dict[str, Any] = {
        "command": launch.get("command") if launch else None, "durable": launch.get("durable") if launch else None,
        "launched_at": (launch.get("first_at") or launch.get("at")) if launch else None,
        "launch_source": launch.get("source") if launch else None,
        "profile": entry.get("profile"), "pool": entry.get("pool") or (launch or {}).get("pool"),
        "price": facts.price(box), "interval_s": interval,
        "started_at": ledger.start if ledger else None, "elapsed_s": round(ledger.wall, 3) if ledger else None,
        # the figure `onboxctl status` shows (controller/goodput/atrisk.py over the newest beat: from the durable
        # checkpoint's step time), not the ledger's own (measured from its commit)
        "at_risk": _at_risk(summary),
        "ledger": dict(ledger.to_dict(segments=True), money=money(ledger, facts)) if ledger else None,
        "next_step": next_step(run, summary.get("state"), summary.get("liveness"), durable.get("step"),
                               _keeper_events(store, run), _slurm_job(store, run), launch, box),
    }
    return out
