"""Recording fakes for two seams: `emit` (a RunContext's event sink) and a runner (subprocess.run's signature)."""
from __future__ import annotations

import subprocess
from typing import Any, Dict, List, Optional, Tuple


class EventRecorder:
    """An `emit(event_type, **fields)` seam that records every event, in order."""

    def __init__(self) -> None:
        self.events: List[Tuple[str, Dict[str, Any]]] = []

    def __call__(self, event_type: str, **fields: Any) -> None:
        self.events.append((event_type, fields))

    def of(self, event_type: str) -> List[Dict[str, Any]]:
        """The fields of each `event_type` event, in order."""
        return [f for t, f in self.events if t == event_type]


class RunnerRecorder:
    """A runner seam: records each call, returns a scripted CompletedProcess or raises a scripted exception."""

    def __init__(self, rc: int = 0, stdout: str = "", stderr: str = "", exc: Optional[BaseException] = None) -> None:
        self.calls: List[Tuple[Any, Dict[str, Any]]] = []
        self.rc, self.stdout, self.stderr, self.exc = rc, stdout, stderr, exc

    def __call__(self, argv: Any, **kw: Any) -> subprocess.CompletedProcess:
        self.calls.append((argv, kw))
        if self.exc:
            raise self.exc
        return subprocess.CompletedProcess(argv, self.rc, self.stdout, self.stderr)
