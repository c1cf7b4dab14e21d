"""The beat's `times`: when this agent started, when the current attempt's setup began and when its child was
spawned (the agent's clock). A reader (the goodput ledger) tells from them the time before the trainer started
(restoring: the checkpoint found, fetched and verified) from the time no agent ran at all (down).

The first attempt's setup begins with the agent; a later one when a backoff ends (the `state` event into
`starting`). An attempt whose child this agent adopted (an earlier agent set it up), or whose child started before
this agent did, has no setup time here: unknown, never guessed.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional

from onbox import vocab


class AttemptTimes:
    """Fed the supervisor's events (`on_event`), asked for the block of each beat (`block`). Thread-safe."""

    def __init__(self, agent_started: float) -> None:
        self.agent_started = agent_started
        self._pending: Optional[float] = agent_started  # the setup under way, for the next child to start
        self._setup_of: Dict[Any, Optional[float]] = {}
        self._lock = threading.Lock()

    def on_event(self, event: Dict[str, Any]) -> None:
        kind, at = event.get("type"), event.get("time")
        with self._lock:
            if kind == vocab.EV_STATE and event.get("new") == vocab.STARTING and isinstance(at, (int, float)):
                self._pending = float(at)
            elif kind == vocab.EV_ADOPTED:  # a child an earlier agent set up: when that began is not known here
                self._pending = None

    def block(self, state: Dict[str, Any], attempt: Any) -> Dict[str, Any]:
        """{agent_started_at, setup_at, child_started_at} for a beat of `attempt` taken from the supervisor's
        `state` (its `attempts`: the newest one's started_at is the current child's spawn)."""
        attempts = state.get("attempts")
        last = attempts[-1] if isinstance(attempts, list) and attempts and isinstance(attempts[-1], dict) else {}
        child = last.get("started_at")
        child = float(child) if isinstance(child, (int, float)) and not isinstance(child, bool) else None
        with self._lock:
            if attempt not in self._setup_of and child is not None:  # this attempt's child is up: its setup is done
                pending = self._pending
                self._setup_of[attempt] = pending if pending is not None and pending <= child else None
                self._pending = None
            setup = self._setup_of.get(attempt)
        return {"agent_started_at": self.agent_started, "setup_at": setup, "child_started_at": child}
