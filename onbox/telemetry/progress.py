"""The trainer's progress, parsed once: the ProgressFeed the supervisor loop fills from the child's output and
ONBOX_METRICS_FILE (`<run dir>/metrics.jsonl`), its newest values (Progress: progress.json, the heartbeat's progress
section), the incremental reader of that file and the metric records the curve-drawing sinks take."""
from __future__ import annotations

import collections
import math
import os
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple

from onbox.telemetry.metrics import FIELDS, Fields, MetricsParser, canonical, parse_json_line


class MetricsFileTail:
    """Reads the lines a trainer appends to ONBOX_METRICS_FILE, incrementally (offset kept between reads).

    A partial last line waits for its newline. A file that shrank or was replaced starts over from its top.
    """

    def __init__(self, path: str, max_bytes_per_read: int = 1 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes_per_read
        self.offset = 0
        self._inode: Optional[int] = None
        self._partial = b""

    def read_new(self) -> List[Fields]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if self._inode is not None and (st.st_ino != self._inode or st.st_size < self.offset):
            self.offset, self._partial = 0, b""
        self._inode = st.st_ino
        if st.st_size <= self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.max_bytes)
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > self.max_bytes:  # a runaway line without newline: drop it
            self._partial = b""
        out = []
        for raw in lines:
            found = parse_json_line(raw.decode("utf-8", "replace"))
            if found:
                out.append(found)
        return out


    def position(self) -> Dict[str, Any]:
        """Where the next read starts (a partial last line is read again): to resume after an agent restart."""
        return {"inode": self._inode, "offset": self.offset - len(self._partial)}

    def resume(self, position: Any) -> None:
        """Start at a saved position(), if it is still this file (same inode, not shorter); else from the top."""
        try:
            st = os.stat(self.path)
            inode, offset = position["inode"], int(position["offset"])
        except (OSError, TypeError, KeyError, ValueError):
            return
        if inode == st.st_ino and 0 <= offset <= st.st_size:
            self._inode, self.offset, self._partial = inode, offset, b""


class PointLog:
    """Every metric record since the last take(), for the sinks that draw curves (MLflow): [time_ms, step,
    {field: value}], values JSON-safe, step the newest known. Bounded: past `limit` the oldest go, counted."""

    def __init__(self, limit: int = 10000) -> None:
        self.limit = limit
        self._points: Deque[List[Any]] = collections.deque()
        self._dropped = 0

    def add(self, fields: Fields, step: Any, wall: float) -> None:
        values = {k: _json_number(v) for k, v in fields.items() if k != "step" and v is not None}
        if not values:
            return
        known = isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
        self._points.append([int(wall * 1000), int(step) if known else None, values])
        if len(self._points) > self.limit:
            self._points.popleft()
            self._dropped += 1

    def take(self) -> Tuple[List[List[Any]], int]:
        """The points since the last take, and how many were dropped on the way."""
        out, dropped = list(self._points), self._dropped
        self._points.clear()
        self._dropped = 0
        return out, dropped


class Progress:
    """The newest value of each field, when it last changed, and when the step last advanced."""

    def __init__(self, saved: Optional[Dict[str, Any]] = None) -> None:
        """`saved`: a to_dict() document (progress.json) to go on from; its step has not advanced here."""
        saved = saved or {}
        self.values: Dict[str, float] = canonical(saved.items())
        at = saved.get("time")
        self.updated_at: Optional[float] = None  # wall time of the newest metric
        if isinstance(at, (int, float)) and not isinstance(at, bool):
            self.updated_at = float(at)
        self.step_advanced_mono: Optional[float] = None

    def update(self, fields: Fields, wall: float, mono: float) -> None:
        step = fields.get("step")
        if step is not None and step != self.values.get("step"):
            self.step_advanced_mono = mono
        self.values.update(fields)
        self.updated_at = wall

    def to_dict(self) -> Dict[str, Any]:
        """progress.json / the heartbeat's progress section: every field present, null when unknown."""
        out: Dict[str, Any] = {k: _json_number(self.values.get(k)) for k in FIELDS}
        out["time"] = self.updated_at
        return out


def _json_number(v: Any) -> Any:
    """JSON has no NaN/Infinity: they travel as the strings "NaN", "Infinity", "-Infinity"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


class Clock(Protocol):
    """onbox.clock's Clock, by its shape (telemetry imports nothing of onbox but its errors)."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...


class ProgressFeed:
    """The trainer's progress, parsed once. The supervisor loop fills it with each line of the child's output
    (`on_output`) and each record the trainer appends to ONBOX_METRICS_FILE (`read_metrics_file`), and hands every
    record it returns to the telemetry hook and the curriculum; the feed keeps the newest value of each field for
    every other reader (`progress`, `snapshot()`: the heartbeat's beats, the checkpoint hook's step fallback,
    progress.json).

    `saved` (progress.json as an earlier agent left it) is where it starts: a relaunch knows the run's last step
    before the trainer reports again. The loop's thread only.
    """

    def __init__(self, metrics_file: str, metrics_regex: Iterable[str], clock: Clock,
                 saved: Optional[Dict[str, Any]] = None) -> None:
        self.parser = MetricsParser(metrics_regex)  # a bad --metrics-regex is refused here (UsageError)
        self.metrics_file = MetricsFileTail(metrics_file)
        self.clock = clock
        self.progress = Progress(saved)
        self.records_taken = 0  # a reader that keeps the count it saw knows when there is news

    def on_output(self, line: str) -> Optional[Fields]:
        """The fields in one line of the child's output (taken), or None."""
        fields = self.parser.parse(line)
        if fields:
            self._take(fields)
        return fields

    def read_metrics_file(self) -> Iterator[Fields]:
        """The records appended to ONBOX_METRICS_FILE since the last call, every one of them (an attempt's records
        are all heard before the next attempt starts: the curriculum counts none of them there). Each is taken as
        it is handed on: the newest values a reader sees then are those of that record."""
        while True:
            before = self.metrics_file.offset
            for fields in self.metrics_file.read_new():
                self._take(fields)
                yield fields
            if self.metrics_file.offset - before < self.metrics_file.max_bytes:  # not a full read: the end
                return

    def snapshot(self) -> Dict[str, Any]:
        """progress.json's document: every field, null when unknown, and the wall time of the newest record."""
        return self.progress.to_dict()

    def _take(self, fields: Fields) -> None:
        self.progress.update(fields, self.clock.time(), self.clock.monotonic())
        self.records_taken += 1
