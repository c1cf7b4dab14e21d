"""The tracker's HTTP API v1 (controller/tracker/API.md), a Starlette app served by uvicorn.

Never a 500 on bad input: malformed JSON, wrong shapes, bad query values and oversized bodies are answered with
a 4xx and a one-line message. Bearer tokens are compared in constant time (hmac.compare_digest).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import json
import logging
import os
import queue
import socket
import sqlite3
import threading
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from controller.tracker.store import Store
from onbox.heartbeat.schema import RUN_RE, validate

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

    async def add(self, beats: List[Dict[str, Any]]) -> Tuple[int, int]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((beats, fut, loop))
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
            try:
                results: List[Any] = list(self.store.add_many([beats for beats, _, _ in items]))
            except Exception as e:  # a database failure fails these requests (503), not the tracker
                log.exception("onbox tracker: commit failed")
                results = [e] * len(items)
            for (_, fut, loop), res in zip(items, results):
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


class BadRequest(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


def _reject_constant(name: str) -> Any:
    raise ValueError("%s is not JSON" % name)


def create_app(store: Store, token: Optional[str], public_read: bool = False, max_body: int = MAX_BODY,
               thin_every_s: float = 3600.0, thin_older_than_s: float = 7 * 86400.0,
               checkpoint_every_s: float = 1.0) -> Starlette:
    token_bytes = token.encode("utf-8") if token else None
    writer = GroupCommitter(store)

    def authorised(request: Request) -> bool:
        if token_bytes is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(presented.strip().encode("utf-8", "replace"), token_bytes)

    def require(request: Request, write: bool) -> None:
        if (write or not public_read) and not authorised(request):
            raise BadRequest(401, "missing or wrong bearer token")

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise BadRequest(400, "bad Content-Length")
            if int(length) > max_body:
                raise BadRequest(413, "body larger than %d bytes" % max_body)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise BadRequest(413, "body larger than %d bytes" % max_body)
            chunks.append(chunk)
        return b"".join(chunks)

    async def post_heartbeats(request: Request) -> JSONResponse:
        require(request, write=True)
        body = await read_body(request)
        try:
            data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise BadRequest(400, "body is not valid JSON: %s" % str(e)[:200])
        if not isinstance(data, dict) or not isinstance(data.get("heartbeats"), list):
            raise BadRequest(400, 'body must be {"heartbeats": [...]}')
        beats = data["heartbeats"]
        if len(beats) > MAX_BEATS:
            raise BadRequest(400, "at most %d heartbeats per request" % MAX_BEATS)
        for i, beat in enumerate(beats):
            errors = validate(beat)
            if errors:
                raise BadRequest(400, "heartbeats[%d]: %s" % (i, "; ".join(errors[:5])), index=i)
        if not beats:
            return JSONResponse({"accepted": 0, "duplicates": 0})
        try:
            accepted, duplicates = await writer.add(beats)
        except (sqlite3.Error, OverflowError, ValueError) as e:
            # validated beats should always store; if one does not, say so without losing the tracker
            log.error("onbox tracker: storing %d beat(s) failed: %r", len(beats), e)
            raise BadRequest(503 if isinstance(e, sqlite3.OperationalError) else 400,
                             "the tracker could not store these heartbeats: %s" % e)
        return JSONResponse({"accepted": accepted, "duplicates": duplicates})

    async def list_runs(request: Request) -> JSONResponse:
        require(request, write=False)
        return JSONResponse({"runs": store.runs()})

    def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise BadRequest(400, "%s must be an integer" % name)
        if not lo <= value <= hi:
            raise BadRequest(400, "%s must be between %d and %d" % (name, lo, hi))
        return value

    async def run_heartbeats(request: Request) -> JSONResponse:
        require(request, write=False)
        run = request.path_params["run"]
        if not RUN_RE.match(run):
            raise BadRequest(400, "bad run name")
        after = _int_param(request, "after", -1, -1, 2**53)
        limit = _int_param(request, "limit", 100, 1, MAX_LIMIT)
        beats = store.heartbeats(run, after=after, limit=limit)
        nxt = beats[-1]["seq"] if beats else after
        return JSONResponse({"run": run, "heartbeats": beats, "next_after": nxt})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

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
        routes=[
            Route("/api/v1/heartbeats", post_heartbeats, methods=["POST"]),
            Route("/api/v1/runs", list_runs, methods=["GET"]),
            Route("/api/v1/runs/{run}/heartbeats", run_heartbeats, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        exception_handlers={BadRequest: bad_request, HTTPException: http_error},
        lifespan=lifespan,
    )


def bind(host: str, port: int) -> socket.socket:
    """Our own listening socket, so port 0 works and the real port is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted tracker gets its port back at once
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def serve(db: str, host: str, port: int, token: Optional[str], public_read: bool = False,
          ready_file: Optional[str] = None, max_body: int = MAX_BODY) -> None:
    """Run the tracker until SIGTERM/SIGINT (uvicorn shuts down gracefully)."""
    import uvicorn

    from onbox.fsutil import atomic_write_json

    store = Store(db)
    app = create_app(store, token, public_read=public_read, max_body=max_body)
    sock = bind(host, port)
    actual = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http="auto",
                            timeout_keep_alive=30, limit_concurrency=2048, timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)

    # Fewer, cheaper cyclic-GC passes: the request path makes short-lived acyclic objects; everything loaded at
    # start-up is frozen out of the collector's view (p99 latency under load).
    gc.collect()
    gc.freeze()
    gc.set_threshold(50000, 20, 100)

    async def main() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started and ready_file:
            atomic_write_json(ready_file, {"pid": os.getpid(), "host": host, "port": actual})
        await task

    try:
        try:
            from uvloop import (
                run as loop_run,  # the controller extra brings it (uvicorn.run would pick it too)
            )
        except ImportError:
            loop_run = asyncio.run  # type: ignore[assignment]
        loop_run(main())
    finally:
        store.close()

