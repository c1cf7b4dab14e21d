"""The dashboard: a page at `/` (every run at a glance) and `/run/<run>` (its curves), the login form, the static
files (the page's own script and the vendored uPlot, static/VENDORED.md), and the two data endpoints the page
polls (API.md, "Dashboard"):

    GET /api/v1/overview?after=<cursor>              rows of the runs that changed, every run's liveness
    GET /api/v1/runs/<run>/series?after=<seq>&limit=  new points of one run as columns, the events among them
        [&points_after=<beat id>&points_limit=]      and the trainer's own points that newer beats brought

Live updates are short polls with those cursors, not a stream: a poll is an ordinary request that ends in
milliseconds, so between polls the page's keep-alive connection is idle and controller/tracker/guard.py may time
it out or displace it like any other. A server-sent-event stream would be a request in flight for as long as the
page is open: the guard never cuts one (neither for a newcomer nor on a timeout), so every open tab would hold
one of the per-client connections that the agents' tunnels, all from 127.0.0.1, need too.
"""
from __future__ import annotations

import hashlib
import html
import os
import re
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from controller.tracker.answers import BadRequest, int_param
from controller.tracker.goodput import GoodputBook
from controller.tracker.overview import Overview
from controller.tracker.pulled import PullsView
from controller.tracker.runfacts import RunFacts
from controller.tracker.runpage import run_page
from controller.tracker.series import read_series, read_trainer, series_body
from controller.tracker.session import Auth, same_origin
from controller.tracker.store import Store
from onbox.heartbeat.schema import MAX_BEAT_POINTS, RUN_RE

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                ".html": "text/html; charset=utf-8", ".png": "image/png"}
MAX_POINTS = 20000
TRAINER_PAGE, MAX_TRAINER_PAGE = 100000, 200000  # the trainer's points per page: default, most
MAX_FORM = 8192
NEXT_RE = re.compile(r"/(run/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?")
# the page runs only its own files: no inline script or style, nothing from elsewhere, never framed
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
# (not no-referrer: under it a browser sends `Origin: null` with the page's own forms, and same_origin() refuses)
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
                "X-Frame-Options": "DENY", "Cache-Control": "no-store"}

LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>onbox tracker: log in</title><link rel="stylesheet" href="/static/dashboard.css"></head>
<body class="login"><form method="post" action="/login" class="login-form">
<h1>onbox tracker</h1>
<p>The tracker's token (the first line of its <code>--token-file</code>, or <code>tracker.token</code> beside its
database).</p>
%(error)s<input type="hidden" name="next" value="%(next)s">
<label>Token <input type="password" name="token" id="token" autocomplete="current-password" required autofocus></label>
<button type="submit" id="login">Log in</button>
</form></body></html>
"""


def load_static(directory: str = STATIC_DIR) -> Dict[str, Tuple[bytes, str, str]]:
    """Every file the page may load, read once: name -> (bytes, content type, ETag). Nothing else is served."""
    out = {}
    for name in sorted(os.listdir(directory)):
        kind = STATIC_TYPES.get(os.path.splitext(name)[1])
        if kind is None:
            continue
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        out[name] = (data, kind, '"%s"' % hashlib.sha256(data).hexdigest()[:32])
    return out


def _next_path(raw: Optional[str]) -> str:
    return raw if raw and NEXT_RE.fullmatch(raw) else "/"


def dashboard_routes(store: Store, auth: Auth, require: Callable[[Request, bool], None],
                     pulls_record: Optional[str], book: Optional[GoodputBook] = None,
                     facts: Optional[RunFacts] = None) -> List[Route]:
    static = load_static()
    overview = Overview(store, PullsView(pulls_record))
    book = book if book is not None else GoodputBook(store)
    facts = facts if facts is not None else RunFacts(None)

    def json_answer(request: Request, doc: Dict[str, Any]) -> JSONResponse:
        resp = JSONResponse(doc, headers={"Cache-Control": "no-store"})
        if auth.needs_renewal(request):  # a page left open keeps its login while it is in use
            resp.headers.append("set-cookie", auth.cookie(request))
        return resp

    async def page(request: Request) -> Response:
        if not auth.can_read(request):
            return RedirectResponse("/login?next=" + urllib.parse.quote(_next_path(request.url.path), safe="/"),
                                    status_code=303, headers={"Cache-Control": "no-store"})
        data, kind, _ = static["index.html"]
        return Response(data, media_type=kind, headers=PAGE_HEADERS)

    def login_form(next_path: str, error: str = "", status: int = 200) -> HTMLResponse:
        err = '<p class="error" id="login-error">%s</p>\n' % html.escape(error) if error else ""
        return HTMLResponse(LOGIN_PAGE % {"error": err, "next": html.escape(next_path, quote=True)},
                            status_code=status, headers=PAGE_HEADERS)

    async def login_get(request: Request) -> Response:
        nxt = _next_path(request.query_params.get("next"))
        if auth.can_read(request):
            return RedirectResponse(nxt, status_code=303, headers={"Cache-Control": "no-store"})
        return login_form(nxt)

    async def read_form(request: Request) -> Dict[str, str]:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
            raise BadRequest(400, "the login form is sent as application/x-www-form-urlencoded")
        body = b""
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_FORM:
                    raise BadRequest(413, "body larger than %d bytes" % MAX_FORM)
        except ClientDisconnect:
            raise BadRequest(408, "the body did not arrive in time")
        try:
            fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
        except ValueError:  # more fields than the form has
            raise BadRequest(400, "the login form has two fields: token and next")
        return {k: v[0] for k, v in fields.items() if v}

    async def login_post(request: Request) -> Response:
        if not same_origin(request):
            raise BadRequest(403, "a login from another site's page is refused")
        form = await read_form(request)
        nxt = _next_path(form.get("next"))
        if auth.open or not auth.token_ok(form.get("token", "")) or not form.get("token", "").strip():
            return login_form(nxt, "That is not the tracker's token.", status=401)
        resp = RedirectResponse(nxt, status_code=303, headers={"Cache-Control": "no-store"})
        resp.headers.append("set-cookie", auth.cookie(request))
        return resp

    async def logout(request: Request) -> Response:
        if not same_origin(request):
            raise BadRequest(403, "a logout from another site's page is refused")
        resp = RedirectResponse("/login", status_code=303, headers={"Cache-Control": "no-store"})
        resp.headers.append("set-cookie", auth.cookie(request, clear=True))
        return resp

    async def static_file(request: Request) -> Response:
        found = static.get(request.path_params["name"])
        if found is None:
            raise BadRequest(404, "no such file")
        data, kind, etag = found
        headers = {"ETag": etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(data, media_type=kind, headers=headers)

    async def favicon(request: Request) -> Response:
        return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})

    async def overview_get(request: Request) -> JSONResponse:
        require(request, False)
        after = int_param(request, "after", -1, -1, 2**62)
        # SQLite reads in a worker thread: the event loop keeps serving the agents meanwhile
        return json_answer(request, await run_in_threadpool(overview.overview, after))

    async def series_get(request: Request) -> Response:
        require(request, False)
        run = request.path_params["run"]
        if not RUN_RE.fullmatch(run):
            raise BadRequest(400, "bad run name")
        after = int_param(request, "after", -1, -1, 2**62)
        limit = int_param(request, "limit", 5000, 1, MAX_POINTS)
        # the trainer's own points, asked for by a page that draws them (absent: none read, as before them)
        points_after = int_param(request, "points_after", -2, -1, 2**62)
        points_limit = int_param(request, "points_limit", TRAINER_PAGE, MAX_BEAT_POINTS, MAX_TRAINER_PAGE)

        def read() -> bytes:
            series = read_series(store, run, after=after, limit=limit)
            trainer = read_trainer(store, run, points_after, points_limit) if points_after >= -1 else None
            summary = overview.run(run)
            if summary is not None and after >= 0 and series["next_after"] == after:
                summary.pop("log_tail", None)  # nothing new since the last poll: no need to send it again
            if summary is not None:  # what the run is: its launch, start, ledger, work at risk, next step
                summary["page"] = run_page(store, facts, run, summary, book.ledger(run, store.now()))
            return series_body(series, {"summary": summary}, trainer)

        resp = Response(await run_in_threadpool(read), media_type="application/json",
                        headers={"Cache-Control": "no-store"})
        if auth.needs_renewal(request):
            resp.headers.append("set-cookie", auth.cookie(request))
        return resp

    return [
        Route("/", page, methods=["GET"]),
        Route("/run/{run}", page, methods=["GET"]),
        Route("/login", login_get, methods=["GET"]),
        Route("/login", login_post, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/static/{name}", static_file, methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
        Route("/api/v1/overview", overview_get, methods=["GET"]),
        Route("/api/v1/runs/{run}/series", series_get, methods=["GET"]),
    ]
