"""Serving the tracker: the listening socket, TLS, connection limits (guard.py) and uvicorn.

Everything the user can get wrong (an address, a port, a certificate) is checked here before anything is created,
so a refused start leaves no database or token behind.
"""
from __future__ import annotations

import asyncio
import gc
import ipaddress
import os
import socket
import ssl
from typing import Callable, Optional, Tuple

from controller.tracker.guard import Limits, Registry, guarded
from controller.tracker.hosts import AllowedHosts
from controller.tracker.store import Store
from onbox.errors import UsageError

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the usual names of them: an address only this machine reaches."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """Our own listening socket, so port 0 works and the real port is known before serving."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError("cannot listen on %s: %s" % (host, getattr(e, "strerror", None) or e),
                         hint="--host takes an address of this machine, e.g. 127.0.0.1 (or 0.0.0.0 with TLS)")
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted tracker gets its port back at once
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise UsageError("cannot listen on %s:%d: %s" % (host, port, e.strerror or e),
                         hint="pick another --port, or 0 for any free one")
    sock.setblocking(False)
    return sock


def check_tls(cert: Optional[str], key: Optional[str]) -> Optional[Tuple[str, str]]:
    """(cert, key) when both are given and form a usable pair, None when neither; else a UsageError."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise UsageError("--tls-cert and --tls-key go together", hint="give both PEM files, or neither")
    cert, key = os.path.expanduser(cert), os.path.expanduser(key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except OSError as e:
        if isinstance(e, ssl.SSLError):
            raise UsageError("--tls-cert %s with --tls-key %s: not a PEM certificate and its own private key (%s)"
                             % (cert, key, e.reason or e),
                             hint="give the certificate (chain) and the unencrypted private key it was made for, "
                                  "both PEM")
        raise UsageError("cannot read %s: %s" % (e.filename or "%s or %s" % (cert, key), e.strerror or e),
                         hint="give the PEM files of the tracker's certificate and its private key")
    return cert, key


def serve(store: Store, sock: socket.socket, token: Optional[str], public_read: bool = False,
          ready_file: Optional[str] = None, max_body: int = 4 * 1024 * 1024, limits: Optional[Limits] = None,
          tls: Optional[Tuple[str, str]] = None, keep_alive: int = 30, pulls_record: Optional[str] = None,
          on_ready: Optional[Callable[[], None]] = None, allowed_hosts: Optional[AllowedHosts] = None) -> None:
    """Run the tracker on `sock` until SIGTERM/SIGINT (uvicorn shuts down gracefully); closes `store`.
    `on_ready` is called once it serves (after the ready file is written). `allowed_hosts`: the Host names it
    answers (controller/tracker/hosts.py); by default those of the address `sock` listens on."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from controller.tracker.app import create_app
    from onbox.fsutil import atomic_write_json

    registry = Registry(limits or Limits())
    if allowed_hosts is None:
        allowed_hosts = AllowedHosts(str(sock.getsockname()[0]))
    app = create_app(store, token, public_read=public_read, max_body=max_body, connection_stats=registry.stats,
                     pulls_record=pulls_record, allowed_hosts=allowed_hosts)
    # limit_concurrency stays off: uvicorn would count stalled sockets toward it and answer 503 to everyone;
    # guard.py caps connections per client and in total, displacing stalled ones first
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            http=guarded(AutoHTTPProtocol, registry), timeout_keep_alive=keep_alive,
                            limit_concurrency=None, timeout_graceful_shutdown=10,
                            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]

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
            atomic_write_json(ready_file, {"pid": os.getpid(), "host": host, "port": port,
                                           "scheme": "https" if tls else "http"})
        if server.started and on_ready is not None:
            on_ready()
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
