"""Who may read and who may write: the bearer token (agents, `onboxctl status`, scripts) and the dashboard's
session cookie (a browser, after the login form).

- Writes (POST /api/v1/heartbeats) take the `Authorization: Bearer` header only, never the cookie: a page on
  another site can make a browser send its cookies, never a header it does not know (no CSRF through writes).
- Reads take the header, or the session cookie, or nothing under --public-read.
- The cookie is not the token: it is `<expiry>.<HMAC-SHA256(token, expiry)>`, so it expires on its own, dies
  when the token changes, and a stolen cookie cannot push beats. It is HttpOnly (no script reads it),
  SameSite=Strict (no other site's request carries it), Secure when served over TLS, and never in a URL.
- The login and logout forms are refused when the browser says they come from another origin (Origin header).
- Browsers keep cookies per host, not per port: the cookie's name carries the port (`onbox_session_8787`), so
  two trackers on one machine do not overwrite each other's logins.
"""
from __future__ import annotations

import hashlib
import hmac
import time
from typing import Callable, Optional

from starlette.requests import Request

COOKIE = "onbox_session_"  # + the port the page was served on
MAX_AGE = 7 * 86400  # seconds a login lasts; a page in use renews it past half-life
_CONTEXT = b"onbox-dashboard-session\0"


class Auth:
    def __init__(self, token: Optional[str], public_read: bool = False, max_age: int = MAX_AGE,
                 now: Callable[[], float] = time.time) -> None:
        self.token = token.encode("utf-8") if token else None
        self.public_read = public_read
        self.max_age = max_age
        self.now = now

    @property
    def open(self) -> bool:
        """No token at all (only a tracker built without one, in tests): everything is allowed."""
        return self.token is None

    def token_ok(self, presented: str) -> bool:
        if self.token is None:
            return True
        return hmac.compare_digest(presented.strip().encode("utf-8", "replace"), self.token)

    def bearer_ok(self, request: Request) -> bool:
        if self.token is None:
            return True
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(presented)

    def _mac(self, expiry: int) -> str:
        assert self.token is not None
        return hmac.new(self.token, _CONTEXT + str(expiry).encode(), hashlib.sha256).hexdigest()

    def session_expiry(self, request: Request) -> Optional[int]:
        """The expiry of a valid session cookie, else None."""
        if self.token is None:
            return None
        expiry, _, mac = request.cookies.get(cookie_name(request), "").partition(".")
        # isascii: "²" is a digit to isdigit() but not to int() (a 500 for anyone who sends it)
        if not (expiry.isascii() and expiry.isdigit()) or len(expiry) > 12 or int(expiry) <= self.now():
            return None
        return int(expiry) if hmac.compare_digest(mac.encode("ascii", "replace"), self._mac(int(expiry)).encode()) \
            else None

    def can_read(self, request: Request) -> bool:
        return self.public_read or self.bearer_ok(request) or self.session_expiry(request) is not None

    def can_write(self, request: Request) -> bool:
        return self.bearer_ok(request)

    def needs_renewal(self, request: Request) -> bool:
        expiry = self.session_expiry(request)
        return expiry is not None and expiry - self.now() < self.max_age / 2

    def cookie(self, request: Request, clear: bool = False) -> str:
        """A Set-Cookie value: a fresh session, or one that clears it."""
        if clear or self.token is None:
            value, age = "", 0
        else:
            expiry = int(self.now() + self.max_age)
            value, age = "%d.%s" % (expiry, self._mac(expiry)), self.max_age
        flags = "; Path=/; Max-Age=%d; HttpOnly; SameSite=Strict" % age
        if request.url.scheme == "https":
            flags += "; Secure"
        return cookie_name(request) + "=" + value + flags


def cookie_name(request: Request) -> str:
    return COOKIE + str(request.url.port or (443 if request.url.scheme == "https" else 80))


def same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another origin (a form posted from another site).
    A client that sends no Origin (curl, a script) is not a browser acting for another site."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return origin == "%s://%s" % (request.url.scheme, request.headers.get("host", ""))
