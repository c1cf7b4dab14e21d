"""checkpoint_status.json: what the checkpoint hook tells the rest of the box (the heartbeat, training_status.md,
`onbox status`): latest_local, latest_durable, verified, last_sync, the lease, warnings. Written atomically; each
rewrite tells the supervisor (summary_due). The measured commit throughput lives here too: it is read back at the
next launch, so a relaunched agent starts from what this box measured."""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional

from onbox import fsutil, vocab

STATUS_SCHEMA = vocab.SCHEMA_CHECKPOINT_STATUS
DEFAULT_THROUGHPUT = 100 * 1024 * 1024  # bytes/s assumed before the first commit is measured


class StatusFile:
    """The hook's checkpoint_status.json and the document it holds (`doc`). `update(**fields)` from any thread."""

    def __init__(self, path: str, run: str, clock: Any, emit: Callable[..., None], durable_url: Optional[str],
                 summary_due: Optional[Callable[[], None]] = None) -> None:
        self.path = path
        self.run = run
        self.clock = clock
        self.emit = emit
        self.durable_url = durable_url
        self.summary_due = summary_due
        self._lock = threading.Lock()
        self.doc = self._load()
        self.throughput = float(self.doc.get("throughput_bytes_per_s") or DEFAULT_THROUGHPUT)

    def _load(self) -> Dict[str, Any]:
        try:
            doc = fsutil.read_json(self.path)
            if isinstance(doc, dict):
                return doc
        except (OSError, ValueError):
            pass
        return {"schema": STATUS_SCHEMA, "run": self.run, "latest_local": None, "latest_durable": None,
                "verified": False, "last_sync": None}

    def get(self, key: str) -> Any:
        return self.doc.get(key)

    def update(self, **fields: Any) -> None:
        with self._lock:
            self.doc.update(fields)
            self.doc["schema"] = STATUS_SCHEMA
            self.doc["durable"] = self.durable_url
            self.doc["updated"] = self.clock.time()
            self.doc["throughput_bytes_per_s"] = round(self.throughput)
            try:
                fsutil.atomic_write_json(self.path, self.doc)
            except OSError as e:  # a full local disk must not kill the supervisor loop
                self.emit("checkpoint_status_unwritable", error=str(e))
                return
        if self.summary_due is not None:  # training_status.md shows this file
            self.summary_due()

    def add_quarantined(self, entry: Dict[str, Any]) -> None:
        """One more checkpoint taken out of use (its name, step, reason, where it went)."""
        self.update(quarantined=[*list(self.doc.get("quarantined") or []), entry])
