"""The tracker's routes over the goodput ledgers (API.md, "Goodput" and "Prometheus"):

    GET /api/v1/goodput?since=&until=&run=&segments=   every run's ledger (or one run's) over a window
    GET /metrics                                        every run and its GPUs, OpenMetrics text (metrics.py)

Both take the bearer token (or the dashboard's session, or nothing under --public-read) like every read. The
ledgers are computed in a worker thread from the goodput book (goodput.py); money is what the tracker's config dir
says a box costs (runfacts.py): each box's hours times its price, unpriced hours left out and counted.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controller.goodput.ledger import Ledger
from controller.tracker.answers import BadRequest
from controller.tracker.goodput import GoodputBook
from controller.tracker.metrics import CONTENT_TYPE, TEXT_CONTENT_TYPE, Exposition
from controller.tracker.runfacts import RunFacts
from controller.tracker.store import Store
from onbox.heartbeat.schema import RUN_RE

MAX_TIME = 1e11


def time_param(request: Request, name: str) -> Optional[float]:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        v = float(raw)
    except ValueError:
        raise BadRequest(400, "%s must be a time in seconds since the epoch" % name)
    if not 0 <= v < MAX_TIME:
        raise BadRequest(400, "%s must be a time in seconds since the epoch" % name)
    return v


def money(ledger: Ledger, facts: RunFacts) -> Dict[str, Any]:
    """What each part cost at its boxes' prices ({part: amount}), and the seconds no price covers."""
    cost: Dict[str, float] = {}
    unpriced = 0.0
    for box, parts in ledger.by_box().items():
        price = facts.price(box)
        for part, seconds in parts.items():
            if price is None:
                unpriced += seconds
            else:
                cost[part] = cost.get(part, 0.0) + seconds / 3600.0 * price
    overlap = sum(s / 3600.0 * p for b, s in ledger.overlap_by_box().items() for p in [facts.price(b)] if p is not None)
    return {"parts": {k: round(v, 4) for k, v in cost.items()}, "overlap": round(overlap, 4),
            "unpriced_s": round(unpriced, 3)}


def run_entry(run: str, ledger: Ledger, facts: RunFacts, segments: bool) -> Dict[str, Any]:
    boxes = facts.boxes()
    last = ledger.segments[-1].box if ledger.segments else None
    entry = {"run": run, "box": last, "profile": boxes.get(last or "", {}).get("profile"),
             "pool": boxes.get(last or "", {}).get("pool"), **ledger.to_dict(segments=segments),
             "money": money(ledger, facts)}
    entry["boxes"] = {b: {k: boxes.get(b, {}).get(k) for k in ("profile", "pool", "price")}
                      for b in entry["by_box"]}
    return entry


def ledger_routes(store: Store, book: GoodputBook, facts: RunFacts,
                  require: Callable[[Request, bool], None]) -> List[Route]:
    exposition = Exposition(store, book, facts)

    async def goodput(request: Request) -> JSONResponse:
        require(request, False)
        since, until = time_param(request, "since"), time_param(request, "until")
        run = request.query_params.get("run")
        if run is not None and not RUN_RE.fullmatch(run):
            raise BadRequest(400, "bad run name")
        segments = request.query_params.get("segments", "0") not in ("0", "", "false")

        def read() -> Dict[str, Any]:
            now = store.now()
            if run is not None:
                one = book.ledger(run, now)
                ledgers = {run: one} if one is not None else {}
            else:
                ledgers = book.ledgers(now)
            runs = [run_entry(name, led.window(since, until), facts, segments) for name, led in sorted(ledgers.items())]
            return {"now": now, "since": since, "until": until, "runs": runs, "problems": facts.problems()}

        return JSONResponse(await run_in_threadpool(read), headers={"Cache-Control": "no-store"})

    async def metrics(request: Request) -> Response:
        require(request, False)
        # Prometheus asks for OpenMetrics (Accept: application/openmetrics-text;...); curl and promtool get the
        # classic text format of the same samples
        om = "application/openmetrics-text" in request.headers.get("accept", "")
        return Response(await run_in_threadpool(exposition.render, om), media_type=CONTENT_TYPE if om else
                        TEXT_CONTENT_TYPE, headers={"Cache-Control": "no-store"})

    return [Route("/api/v1/goodput", goodput, methods=["GET"]), Route("/metrics", metrics, methods=["GET"])]
