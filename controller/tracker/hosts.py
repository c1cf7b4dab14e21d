"""Which `Host` names the tracker answers: the defence against DNS rebinding.

A page on evil.example can make its own name resolve to 127.0.0.1 (or to the tracker's LAN address) a moment after
the browser loaded it; the browser then sends that page's requests to the tracker, with `Host: evil.example`, and
lets the page read the answers (same origin, as far as the browser knows). Under --public-read that is the whole run
list: hosts, paths, errors, log tails. So every request, whoever sends it and whatever it asks, must name a host the
tracker serves; any other is answered 421 (Misdirected Request) with the flag that would allow it.

Allowed:
- an IP address, any (`127.0.0.1:40000`, `[::1]`, `10.0.0.5`): an address is no DNS name, so nothing can rebind
  it, and the agents' ssh tunnels (`Host: 127.0.0.1:<the box's port>`) and NAT'd addresses must keep working;
- the loopback names (localhost, ...): a browser resolves them itself, never through an attacker's DNS;
- the name the tracker was told to listen on (`--host tracker.lan`), and this machine's hostname when it listens
  on every address (0.0.0.0, ::);
- each `--allowed-host NAME` (a reverse proxy's public name, a DNS alias), compared without case and final dot.
The port in `Host` is not checked: a tunnel's port on the box differs from the tracker's own.
A request with no Host header at all (HTTP/1.0 from a script) is not a browser's and passes.
`X-Forwarded-Host` is never read: a proxy that rewrites Host checks its own names.
"""
from __future__ import annotations

import ipaddress
import json
import re
import socket
from typing import Any, Awaitable, Callable, Iterable, Optional

from onbox.errors import UsageError
from onbox.untrusted import printable

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
WILDCARDS = ("0.0.0.0", "::", "")
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
NAME_RE = re.compile(r"(%s)(\.%s)*" % (_LABEL, _LABEL))
HINT = "give --allowed-host with a DNS name, e.g. --allowed-host tracker.example.org (no scheme, no port)"


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def normal_name(name: str) -> str:
    """A host name as compared: lower case, without a final dot."""
    return name.strip().lower().rstrip(".")


def check_allowed_host(value: str) -> str:
    """An --allowed-host value, normalized; a UsageError (exit 2) for anything that is not a bare host name or
    address (a URL, a port, a wildcard, spaces, control characters)."""
    shown = printable(value)[:100]
    if "://" in value:
        raise UsageError("--allowed-host '%s': give the name without a scheme" % shown, hint=HINT)
    name = normal_name(value)
    if _is_address(name.strip("[]")):
        return name.strip("[]")
    if ":" in name and NAME_RE.fullmatch(name.rsplit(":", 1)[0]):
        raise UsageError("--allowed-host '%s': give the name without a port (the port is never checked)" % shown,
                         hint=HINT)
    if not NAME_RE.fullmatch(name) or len(name) > 253:
        raise UsageError("--allowed-host '%s' is not a host name" % shown, hint=HINT)
    return name


class AllowedHosts:
    """The names one tracker answers (see the module's docstring)."""

    def __init__(self, bind_host: str, allowed: Iterable[str] = (),
                 hostname: Callable[[], str] = socket.gethostname) -> None:
        bind = normal_name(bind_host.strip("[]"))
        names = set(LOOPBACK_NAMES) | {normal_name(a) for a in allowed}
        if bind in WILDCARDS:
            try:
                names.add(normal_name(hostname()))
            except OSError:  # no hostname: the addresses and --allowed-host still work
                pass
        elif not _is_address(bind):
            names.add(bind)
        names.discard("")
        self.names = frozenset(names)

    def problem(self, host: Optional[str]) -> Optional[str]:
        """Why a request naming `host` (its Host header, None when it sent none) is refused, or None. The answer
        names no allowed name: a rebinding page can read it."""
        if host is None:
            return None
        name = _name_of(host)
        if name is not None and (name in self.names or _is_address(name)):
            return None
        what = "Host '%s'" % printable(host)[:100] if host.strip() else "an empty Host"
        flag = "--allowed-host %s" % name if name and NAME_RE.fullmatch(name) else "--allowed-host NAME"
        return ("%s refused: this tracker answers only its own names and addresses, never a name another site may "
                "point at it (DNS rebinding); if you reach it by that name, restart it with %s" % (what, flag))


def _name_of(host: str) -> Optional[str]:
    """The host part of a Host header (`name:port`, `[v6]:port`, `name`), normalized; None when it is malformed."""
    host = host.strip()
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1:] and not re.fullmatch(r":[0-9]{1,5}", host[end + 1:])):
            return None
        inner = host[1:end]
        return inner.lower() if _is_address(inner) else None
    if host.count(":") == 1:
        host, port = host.split(":")
        if not re.fullmatch(r"[0-9]{1,5}", port):
            return None
    elif ":" in host:  # a bare IPv6 address without brackets is not a Host header
        return None
    name = normal_name(host)
    return name if name and (NAME_RE.fullmatch(name) or _is_address(name)) else None


Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


class HostCheck:
    """ASGI middleware: every HTTP request (and WebSocket) naming a Host that `allowed` refuses gets 421 and its
    one-line reason, before any route, auth or body is looked at."""

    def __init__(self, app: Callable[[Any, Receive, Send], Awaitable[None]], allowed: AllowedHosts) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            hosts = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"]
            if len(hosts) > 1:  # which one a proxy or the browser meant is anyone's guess
                problem: Optional[str] = "%d Host headers refused: a request names one host" % len(hosts)
            else:
                problem = self.allowed.problem(hosts[0] if hosts else None)
            if problem:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = json.dumps({"error": problem}).encode("utf-8")
                await send({"type": "http.response.start", "status": 421,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"cache-control", b"no-store")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
