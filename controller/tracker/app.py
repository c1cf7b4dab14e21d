"""The tracker's HTTP API v1 (controller/tracker/API.md), a Starlette app served by uvicorn, and the dashboard
beside it (controller/tracker/dashboard.py).

Never a 500 on bad input: malformed JSON, wrong shapes, bad query values and oversized bodies are answered with
a 4xx and a one-line message; a beat is refused when its readers could not read it (onbox.heartbeat.schema's
bounds: nesting, unknown keys), naming the beat. Bearer tokens are compared in constant time (hmac.compare_digest);
who may read and who may write is controller/tracker/session.py; which Host names it answers (DNS rebinding),
controller/tracker/hosts.py, in front of everything.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from controller.tracker.answers import BadRequest, int_param
from controller.tracker.events import MAX_EVENTS, add_events, check_event, ensure_table, run_events
from controller.tracker.hosts import AllowedHosts, HostCheck
from controller.tracker.session import Auth
from controller.tracker.store import Store
from onbox.heartbeat.schema import RUN_RE, loads_strict, validate_and_dump
from onbox.untrusted import printable

log = logging.getLogger("onbox.tracker")

MAX_BODY = 4 * 1024 * 1024
MAX_BEATS = 1000
MAX_LIMIT = 1000


class GroupCommitter:
    """One writer thread: requests queue their beats, the writer commits everything queued so far in ONE
    transaction and answers each request. The event loop never waits on SQLite; commits are amortised."""

    def __init__(self, store: Store, max_requests: int = 256) -> None:
        self.store = store
        self.max_requests = max_requests
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tracker-writer", daemon=True)
        self._thread.start()

    async def add(self, beats: List[Dict[str, Any]], texts: Optional[List[str]] = None) -> Tuple[int, int]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((beats, texts, fut, loop))
        return await fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            items = [item]
            while len(items) < self.max_requests:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                items.append(nxt)
            texts = [t for _, t, _, _ in items]
            try:
                results: List[Any] = list(self.store.add_many(
                    [beats for beats, _, _, _ in items], texts if all(t is not None for t in texts) else None))
            except Exception as e:  # a database failure fails these requests (503), not the tracker
                log.exception("onbox tracker: commit failed")
                results = [e] * len(items)
            for (_, _, fut, loop), res in zip(items, results):
                loop.call_soon_threadsafe(_resolve, fut, res)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(10)


def _resolve(fut: "asyncio.Future[Any]", res: Any) -> None:
    if fut.done():
        return
    if isinstance(res, Exception):
        fut.set_exception(res)
    else:
        fut.set_result(res)


def beat_label(beat: Any) -> str:
    """" (run 'x', seq 5)" for a refused beat whose run and seq can be read: which of the agent's beats it was."""
    if not isinstance(beat, dict):
        return ""
    run, seq = beat.get("run"), beat.get("seq")
    parts = (["run '%s'" % printable(run)[:130]] if isinstance(run, str) else []) + (
        ["seq %d" % seq] if isinstance(seq, int) and not isinstance(seq, bool) else [])
    return " (%s)" % ", ".join(parts) if parts else ""


def create_app(store: Store, token: Optional[str], public_read: bool = False, max_body: int = MAX_BODY,
               thin_every_s: float = 3600.0, thin_older_than_s: float = 7 * 86400.0,
               checkpoint_every_s: float = 1.0,
               connection_stats: Optional[Callable[[], Dict[str, int]]] = None,
               pulls_record: Optional[str] = None, allowed_hosts: Optional[AllowedHosts] = None) -> Starlette:
    """The app over `store`. `allowed_hosts`: the Host names it answers (server.py always gives them; None, only
    in-process tests, answers any). The inventory and launch records (runfacts.py) are read from the onboxctl
    config dir that holds `pulls_record`."""
    from controller.tracker.dashboard import dashboard_routes
    from controller.tracker.goodput import GoodputBook
    from controller.tracker.ledgers import ledger_routes
    from controller.tracker.runfacts import RunFacts

    auth = Auth(token, public_read=public_read, now=store.now)
    writer = GroupCommitter(store)
    ensure_table(store)
    book = GoodputBook(store)
    facts = RunFacts(os.path.dirname(pulls_record) if pulls_record else None)

    def require(request: Request, write: bool) -> None:
        # a write takes the bearer header only, never the dashboard's cookie (no cross-site request can send it)
        if not (auth.can_write(request) if write else auth.can_read(request)):
            raise BadRequest(401, "missing or wrong bearer token")

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise BadRequest(400, "bad Content-Length")
            if int(length) > max_body:
                raise BadRequest(413, "body larger than %d bytes" % max_body)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body:
                    raise BadRequest(413, "body larger than %d bytes" % max_body)
                chunks.append(chunk)
        except ClientDisconnect:  # gone, or cut by the body timeout (controller/tracker/guard.py): nobody reads this
            raise BadRequest(408, "the body did not arrive in time")
        return b"".join(chunks)

    async def read_batch(request: Request, key: str, most: int, check: Callable[[Any], Tuple[List[str], str]],
                         label: Callable[[Any], str] = lambda item: "") -> Tuple[List[Any], List[str]]:
        """A write's body `{key: [...]}`: (the items, each checked and dumped by `check`); one bad item refuses
        the batch, naming its index (and what `label` says of it)."""
        require(request, write=True)
        body = await read_body(request)
        try:
            # strict: NaN/Infinity literals and numbers that overflow (1e400 -> inf) are refused here, at the door;
            # one stored inf once made every later read of /api/v1/runs fail
            data = loads_strict(body.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise BadRequest(400, "body is not valid JSON: %s" % str(e)[:200])
        if not isinstance(data, dict) or not isinstance(data.get(key), list):
            raise BadRequest(400, 'body must be {"%s": [...]}' % key)
        items = data[key]
        if len(items) > most:
            raise BadRequest(400, "at most %d %s per request" % (most, key))
        texts = []
        for i, item in enumerate(items):
            errors, text = check(item)
            if errors:
                raise BadRequest(400, "%s[%d]%s: %s" % (key, i, label(item), "; ".join(errors[:5])), index=i)
            texts.append(text)
        return items, texts

    async def post_heartbeats(request: Request) -> JSONResponse:
        # every section against heartbeat.schema.json, plus the tracker's own bounds
        beats, texts = await read_batch(request, "heartbeats", MAX_BEATS, validate_and_dump, beat_label)
        if not beats:
            return JSONResponse({"accepted": 0, "duplicates": 0})
        try:
            accepted, duplicates = await writer.add(beats, texts)
        except (sqlite3.Error, OverflowError, ValueError) as e:
            # validated beats should always store; if one does not, say so without losing the tracker
            log.error("onbox tracker: storing %d beat(s) failed: %r", len(beats), e)
            raise BadRequest(503 if isinstance(e, sqlite3.OperationalError) else 400,
                             "the tracker could not store these heartbeats: %s" % e)
        return JSONResponse({"accepted": accepted, "duplicates": duplicates})

    async def post_events(request: Request) -> JSONResponse:
        events, texts = await read_batch(request, "events", MAX_EVENTS, check_event)
        try:
            accepted, duplicates = await asyncio.get_running_loop().run_in_executor(None, add_events, store, events,
                                                                                   texts)
        except sqlite3.Error as e:
            log.error("onbox tracker: storing %d event(s) failed: %r", len(events), e)
            raise BadRequest(503, "the tracker could not store these events: %s" % e)
        return JSONResponse({"accepted": accepted, "duplicates": duplicates})

    def run_param(request: Request) -> str:
        """The run named in the path, refused (400) unless it is a run name."""
        run = request.path_params["run"]
        if not RUN_RE.fullmatch(run):
            raise BadRequest(400, "bad run name")
        return str(run)

    async def get_run_events(request: Request) -> JSONResponse:
        require(request, write=False)
        run = run_param(request)
        after = int_param(request, "after", 0, 0, 2**62)
        limit = int_param(request, "limit", 100, 1, MAX_LIMIT)
        events, skipped, nxt = run_events(store, run, after=after, limit=limit)
        return JSONResponse({"run": run, "events": events, "next_after": nxt, "skipped_rows": skipped})

    async def list_runs(request: Request) -> JSONResponse:
        require(request, write=False)
        runs, skipped = store.runs_checked()
        return JSONResponse({"runs": runs, "skipped_rows": skipped})

    async def run_heartbeats(request: Request) -> JSONResponse:
        require(request, write=False)
        run = run_param(request)
        after = int_param(request, "after", -1, -1, 2**53)
        limit = int_param(request, "limit", 100, 1, MAX_LIMIT)
        beats, skipped, nxt = store.heartbeats_checked(run, after=after, limit=limit)
        return JSONResponse({"run": run, "heartbeats": beats, "next_after": nxt, "skipped_rows": skipped})

    async def healthz(request: Request) -> JSONResponse:
        doc: Dict[str, Any] = {"ok": True, "skipped_rows": store.skipped_total}
        if connection_stats is not None and auth.can_read(request):  # counts only for readers
            doc["connections"] = connection_stats()
        return JSONResponse(doc)

    async def bad_request(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BadRequest)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"error": exc.message, **exc.extra}, status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def thinner() -> None:
            while True:
                await asyncio.sleep(thin_every_s)
                n = await asyncio.get_running_loop().run_in_executor(None, store.thin, thin_older_than_s)
                if n:
                    log.info("onbox tracker: thinned %d old beats", n)

        async def checkpointer() -> None:
            while True:
                await asyncio.sleep(checkpoint_every_s)
                await asyncio.get_running_loop().run_in_executor(None, store.checkpoint)

        tasks = [asyncio.ensure_future(checkpointer())]
        if thin_every_s > 0:
            tasks.append(asyncio.ensure_future(thinner()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            writer.close()
            store.checkpoint()

    return Starlette(
        middleware=[Middleware(HostCheck, allowed=allowed_hosts)] if allowed_hosts is not None else [],
        routes=[
            Route("/api/v1/heartbeats", post_heartbeats, methods=["POST"]),
            Route("/api/v1/runs", list_runs, methods=["GET"]),
            Route("/api/v1/runs/{run}/heartbeats", run_heartbeats, methods=["GET"]),
            Route("/api/v1/events", post_events, methods=["POST"]),
            Route("/api/v1/runs/{run}/events", get_run_events, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            *ledger_routes(store, book, facts, require),
            *dashboard_routes(store, auth, require, pulls_record, book, facts),
        ],
        exception_handlers={BadRequest: bad_request, HTTPException: http_error},
        lifespan=lifespan,
    )

