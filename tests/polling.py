"""The one bounded poll the tests use instead of sleep-then-assert."""
from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition", interval: float = 0.05) -> Any:
    """Call `cond` every `interval` s until it returns something truthy (returned); AssertionError naming `what`
    after `timeout` s. The condition is always tried once more at the deadline, so a slow machine fails late,
    never early."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(interval)
