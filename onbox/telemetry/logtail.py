"""The last lines of the job's output, for the tracker's run page (`log_tail` in each heartbeat).

Bounded three ways so a chatty or binary-spewing job cannot bloat the beats or the spool: at most `lines` lines,
each cut to LINE_CHARS, and control characters (a progress bar's carriage returns, terminal colours) replaced.
Values the agent knows to be secret (the job's --secret/--env-file values, the agent's tracker and MLflow tokens)
are replaced by "[secret]" before a line is kept: trainers print their environment (U34), and the tail leaves the
box. `lines = 0` keeps the output on the box.
"""
from __future__ import annotations

import collections
import re
import threading
from typing import Any, Dict, Iterable, List, Optional

LINE_CHARS = 500
MIN_SECRET_CHARS = 6  # shorter values (a "1", a "yes") would redact ordinary words
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class LogTail:
    def __init__(self, lines: int, secrets: Iterable[str] = ()) -> None:
        self.max_lines = max(0, int(lines))
        self._lines: "collections.deque[str]" = collections.deque(maxlen=self.max_lines or 1)
        self._secrets: List[str] = []
        self._lock = threading.Lock()
        self.total = 0  # lines seen since the agent started
        self.redacted = 0  # lines in which a secret was replaced
        self.set_secrets(secrets)

    def set_secrets(self, secrets: Iterable[str]) -> None:
        """The values to redact from now on (longest first, so a value containing another is replaced whole)."""
        values = sorted({s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_CHARS}, key=len,
                        reverse=True)
        with self._lock:
            self._secrets = values

    def add(self, line: str) -> None:
        if not self.max_lines:
            return
        text = line.rstrip("\r\n")
        if "\r" in text:  # a progress bar redraws itself: keep what the terminal would show last
            text = text.rsplit("\r", 1)[-1] or text.strip("\r")
        text = _CONTROL.sub("?", _ANSI.sub("", text))
        with self._lock:
            hit = False
            for value in self._secrets:
                if value in text:
                    text, hit = text.replace(value, "[secret]"), True
            self.redacted += hit
            self.total += 1
            self._lines.append(text[:LINE_CHARS] + ("…" if len(text) > LINE_CHARS else ""))

    def snapshot(self) -> Optional[Dict[str, Any]]:
        """{"lines": [...], "lines_total": n, "redacted": k} for the beat; None when disabled or nothing printed yet."""
        if not self.max_lines:
            return None
        with self._lock:
            if not self.total:
                return None
            return {"lines": list(self._lines), "lines_total": self.total, "redacted": self.redacted}
