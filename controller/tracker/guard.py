"""Connection limits for the tracker's HTTP server: stalled clients are timed out and can never crowd others out.

uvicorn (0.54) times out only an idle keep-alive connection *after* a response (`timeout_keep_alive`). A socket
that connects and sends nothing, sends half its headers, or starts a body and stops, is kept forever, and each
one counts toward `limit_concurrency`: 2,100 such sockets made the tracker answer 503 to every agent. This module
wraps uvicorn's own HTTP protocol class (httptools or h11, whichever uvicorn picks) at the asyncio-protocol level,
so it works for any ASGI app and either parser:

- header timeout: a request's headers must be complete within `header_timeout` seconds of the connection opening
  (or of the first byte of the next request on a kept-alive connection); else 408 and close;
- body timeout: the whole body within `body_timeout` + length / 16 KiB/s seconds of the headers (a slow but
  moving upload of a large backlog is fine; one byte a minute is not); else 408 and close;
- write timeout: a client that stops reading its response for `write_timeout` seconds is dropped;
- a per-client-address cap and a total cap: a new connection over either displaces a connection of that client
  (over its cap) or of anyone (over the total) that has not delivered a request: the one that has been sending
  its headers longest, else the one idle longest between requests (closed quietly, as a keep-alive timeout
  would); only when every connection has a request in flight is the new one answered 503 and closed. A request being read or served
  is never cut for a newcomer.

Counters (open connections, timeouts, displaced, refused) are served in /healthz under `connections`.
TLS handshakes that never finish are bounded by asyncio's own handshake timeout (60 s) before they reach here.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Any, Dict, Optional, Set, Type

COUNTERS = ("accepted", "header_timeouts", "body_timeouts", "write_timeouts", "displaced", "displaced_per_client",
            "refused", "refused_per_client")
MIN_BODY_RATE = 16 * 1024  # bytes/s: a body that moves at least this fast always gets the time it needs


@dataclasses.dataclass(frozen=True)
class Limits:
    header_timeout: float = 15.0
    body_timeout: float = 30.0
    write_timeout: float = 60.0
    max_per_client: int = 256
    max_connections: int = 2048


class Registry:
    """Every open connection of one server, by client address, and the counters /healthz shows."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.conns: Set[Any] = set()
        self.by_client: Dict[str, Set[Any]] = collections.defaultdict(set)
        self.counts: Dict[str, int] = collections.Counter({k: 0 for k in COUNTERS})

    def stats(self) -> Dict[str, int]:
        return dict(self.counts, open=len(self.conns), clients=len(self.by_client))

    def add(self, conn: Any) -> None:
        self.conns.add(conn)
        self.by_client[conn.guard_client].add(conn)

    def remove(self, conn: Any) -> None:
        self.conns.discard(conn)
        mine = self.by_client.get(conn.guard_client)
        if mine is not None:
            mine.discard(conn)
            if not mine:
                del self.by_client[conn.guard_client]

    @staticmethod
    def waiting_longest(pool: Set[Any], besides: Any) -> Optional[Any]:
        """The connection of `pool` to displace (None: every one has a request in flight): the one that has been
        sending its headers longest (a real client sends them in a millisecond), else the longest idle one."""
        best, best_key = None, None
        for c in pool:
            if c is besides or not c.guard_waiting():
                continue
            key = (c.guard_phase != "header", c.guard_since)
            if best_key is None or key < best_key:
                best, best_key = c, key
        return best


_RESPONSES = {
    408: b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n",
    503: b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n",
}


def guarded(base: Type[asyncio.Protocol], registry: Registry) -> Type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol class `base` that enforces `registry.limits`."""

    class Guarded(base):  # type: ignore[valid-type, misc]
        guard_registry = registry

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.guard_client = (self.client or ("?", 0))[0]
            self.guard_phase = "header"  # header -> body -> app -> idle -> header ...
            self.guard_since = time.monotonic()
            self.guard_timer: Optional[asyncio.TimerHandle] = None
            self.guard_write_timer: Optional[asyncio.TimerHandle] = None
            self.guard_cycle: Any = None
            self.guard_bytes = 0
            lim = registry.limits
            registry.add(self)
            registry.counts["accepted"] += 1
            mine = registry.by_client[self.guard_client]
            if len(mine) > lim.max_per_client and not self._guard_displace(mine, "displaced_per_client"):
                self._guard_reply(503, "too many connections from %s (at most %d)" % (
                    self.guard_client, lim.max_per_client), "refused_per_client")
                return
            if len(registry.conns) > lim.max_connections and not self._guard_displace(registry.conns, "displaced"):
                self._guard_reply(503, "the tracker is at its connection limit (%d)" % lim.max_connections,
                                  "refused")
                return
            self._guard_arm(lim.header_timeout, self._guard_header_timeout)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._guard_cancel()
            if self.guard_write_timer is not None:
                self.guard_write_timer.cancel()
            registry.remove(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.guard_phase == "idle":  # the first byte of the next request on a kept-alive connection
                self.guard_phase, self.guard_since, self.guard_bytes = "header", time.monotonic(), 0
                self._guard_arm(registry.limits.header_timeout, self._guard_header_timeout)
            self.guard_bytes += len(data)
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if self.guard_phase == "header" and cycle is not None and cycle is not self.guard_cycle:
                self.guard_cycle = cycle  # the headers are complete: uvicorn made the request's cycle
                if cycle.more_body:
                    self.guard_phase = "body"
                    self._guard_arm(registry.limits.body_timeout + _length(cycle) / MIN_BODY_RATE,
                                    self._guard_body_timeout)
                else:
                    self.guard_phase = "app"
                    self._guard_cancel()
            elif self.guard_phase == "body" and cycle is not None and not cycle.more_body:
                self.guard_phase = "app"
                self._guard_cancel()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.guard_phase == "app":
                self.guard_phase, self.guard_since = "idle", time.monotonic()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.guard_write_timer is None:
                self.guard_write_timer = asyncio.get_event_loop().call_later(
                    registry.limits.write_timeout, self._guard_write_timeout)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.guard_write_timer is not None:
                self.guard_write_timer.cancel()
                self.guard_write_timer = None

        # -- the guard's own ------------------------------------------------------------------------------
        def guard_waiting(self) -> bool:
            """No request in flight: still sending headers, or idle between requests."""
            return self.guard_phase in ("header", "idle") and not self.transport.is_closing()

        def _guard_displace(self, pool: Set[Any], counter: str) -> bool:
            victim = Registry.waiting_longest(pool, besides=self)
            if victim is None:
                return False
            # an idle keep-alive connection, or one that sent nothing yet, is closed quietly (a client reconnects
            # as after a keep-alive timeout); one caught half-way through its headers is told why
            victim._guard_reply(503, "displaced by a newer connection: reconnect", counter,
                                quiet=victim.guard_phase == "idle" or victim.guard_bytes == 0)
            return True

        def _guard_arm(self, seconds: float, callback: Any) -> None:
            self._guard_cancel()
            self.guard_timer = asyncio.get_event_loop().call_later(seconds, callback)

        def _guard_cancel(self) -> None:
            if self.guard_timer is not None:
                self.guard_timer.cancel()
                self.guard_timer = None

        def _guard_header_timeout(self) -> None:
            if self.guard_phase == "header":
                self._guard_reply(408, "the request headers did not arrive within %g s"
                                  % registry.limits.header_timeout, "header_timeouts", quiet=self.guard_bytes == 0)

        def _guard_body_timeout(self) -> None:
            if self.guard_phase == "body":
                # the app is waiting for the rest of the body: closing hands it a disconnect (its 408 goes nowhere)
                self._guard_reply(408, "the request body did not arrive in time", "body_timeouts")

        def _guard_write_timeout(self) -> None:
            self.guard_write_timer = None
            registry.counts["write_timeouts"] += 1
            self.transport.abort()  # close() would wait for a buffer the client never drains

        def _guard_reply(self, status: int, message: str, counter: str, quiet: bool = False) -> None:
            """Answer `status` before any response of ours has started (the phases guarantee it) and close."""
            registry.counts[counter] += 1
            self._guard_cancel()
            self.guard_phase = "closed"
            if self.transport.is_closing():
                return
            if not quiet:  # a socket that never sent a byte gets no answer, like nginx's header timeout
                body = ('{"error": "%s"}' % message.replace('"', "'")).encode()
                self.transport.write(_RESPONSES[status] + b"content-length: %d\r\n\r\n" % len(body) + body)
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = "Guarded" + base.__name__
    return Guarded


def _length(cycle: Any) -> int:
    for name, value in cycle.scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return 0

