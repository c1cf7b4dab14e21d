"""The 4xx answers the tracker's handlers raise (app.py turns them into `{"error": ...}`), and the one reader of
integer query values (bad or out of range: 400, never a 500)."""
from __future__ import annotations

from typing import Any

from starlette.requests import Request


class BadRequest(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


def int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
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
