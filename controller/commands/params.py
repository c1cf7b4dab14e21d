"""click parameter types of onboxctl: numbers that are finite and in range (click's FloatRange lets NaN through:
every comparison with NaN is false)."""
from __future__ import annotations

import math
from typing import Any, Optional

import click


class Seconds(click.ParamType):
    """A finite number of seconds in [lo, hi]; `nan`, `inf` and out-of-range values are a usage error (exit 2)."""

    name = "seconds"

    def __init__(self, lo: float = 0.0, hi: float = 86400.0, open_lo: bool = False) -> None:
        self.lo, self.hi, self.open_lo = lo, hi, open_lo

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        if isinstance(value, float) and math.isfinite(value):
            v = value
        else:
            try:
                v = float(value)
            except (TypeError, ValueError):
                self.fail("%r is not a number of seconds" % (value,), param, ctx)
        low_ok = v > self.lo if self.open_lo else v >= self.lo
        if not math.isfinite(v) or not low_ok or v > self.hi:
            self.fail("%r is not a number of seconds %s %g and <= %g" % (
                value, ">" if self.open_lo else ">=", self.lo, self.hi), param, ctx)
        return v


class Duration(click.ParamType):
    """A duration: 45, 90s, 30m, 2h, 1d, 500ms (controller/keeper/policy.py); anything else is exit 2."""

    name = "duration"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        if isinstance(value, float):
            return value
        from controller.keeper.policy import parse_duration
        from onbox.errors import UsageError

        try:
            return parse_duration(value, "")
        except UsageError:
            self.fail("%r is not a duration (45, 90s, 30m, 2h, 1d)" % (value,), param, ctx)


class HangAfter(click.ParamType):
    """--hang-after as `onbox run` takes it: seconds, a duration (90s, 5m) or off; anything else is exit 2, here,
    before any ssh."""

    name = "duration"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> str:
        from onbox.config import check_range, hang_after_seconds
        from onbox.errors import UsageError

        try:
            check_range("hang_after", hang_after_seconds(value))
        except (ValueError, UsageError) as e:
            self.fail("%r: %s" % (value, getattr(e, "message", None) or e), param, ctx)
        return str(value)
