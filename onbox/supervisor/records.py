"""The run's records (state.json, training_status.md, events.jsonl) on a disk that may refuse them.

A full ONBOX_HOME (ENOSPC, EDQUOT: U6, U7), a failing disk (EIO) or one remounted read-only (EROFS) must never end
the supervision: the child would run on with nobody to forward a preemption, restart it or commit its last
checkpoint (durable storage is elsewhere and still takes writes). So the supervisor writes through `RunRecords`:
a refused write starts a fault, the newest state stays in memory (the supervisor rebuilds it at each write), the
events that could not be appended are held in order (bounded: the oldest go first, counted), and at each tick the
held events and then the state are tried again; once the disk takes them the fault is over.

The supervisor says when a fault starts and ends (events `run_dir_unwritable` and `run_dir_writable`, a critical
`run_dir_unwritable` warning in state.json while it lasts, hence an alert in every heartbeat, which leave the box
over the network). Only the fault errors (fsutil.DISK_FAULTS) are held back; any other error is a bug and raised.
"""
from __future__ import annotations

import collections
import os
import threading
from typing import Any, Deque, Dict, Optional

from onbox import fsutil, paths
from onbox.errors import UnfitError
from onbox.supervisor.rundir import RunDir

HELD_EVENTS = 10000  # events kept in memory while the disk refuses them; past that the oldest are dropped
HOME_HINT = ("free space there (`df -h %s` and `df -i %s`: bytes and inodes, U7), or set ONBOX_HOME to a "
             "directory on another disk")


class RunRecords:
    """Writes a run's records; holds them in memory while the disk refuses them. Safe from any thread."""

    def __init__(self, rd: RunDir, now: Any) -> None:
        self.rd = rd
        self._now = now  # wall clock, for the fault's `since`
        self._lock = threading.Lock()
        self._held: Deque[Dict[str, Any]] = collections.deque()
        self.dropped = 0
        self.fault: Optional[Dict[str, Any]] = None  # {errno, error, what, path, since, held_events}

    @property
    def degraded(self) -> bool:
        return self.fault is not None

    def failed(self, what: str, error: OSError) -> bool:
        """Record a write the disk refused. True when this starts a fault (the caller says so, once)."""
        with self._lock:
            return self._failed(what, error)

    def _failed(self, what: str, error: OSError) -> bool:
        if self.fault is not None:
            return False
        self.fault = {"errno": fsutil.disk_fault(error), "error": error.strerror or str(error), "what": what,
                      "path": error.filename or self.rd.path, "since": self._now()}
        return True

    def snapshot(self) -> Optional[Dict[str, Any]]:
        """The fault as state.json and the heartbeats carry it (`degraded`), or None when the disk takes writes."""
        with self._lock:
            if self.fault is None:
                return None
            return {**self.fault, "held_events": len(self._held), "dropped_events": self.dropped}

    def append_event(self, event: Dict[str, Any]) -> bool:
        """Append one event, or hold it (in order) while the disk refuses writes. True when this starts a fault."""
        with self._lock:
            if self.fault is None and not self._held:
                try:
                    self.rd.append_event(event)
                    return False
                except OSError as e:
                    if fsutil.disk_fault(e) is None:
                        raise
                    started = self._failed(paths.EVENTS_FILE, e)
            else:
                started = False
            self._held.append(event)
            if len(self._held) > HELD_EVENTS:
                self._held.popleft()
                self.dropped += 1
            return started

    def write_state(self, doc: Dict[str, Any]) -> bool:
        """Write state.json (and training_status.md). During a fault nothing is tried here (recover() does it at
        the next tick, events first). True when this write starts a fault."""
        with self._lock:
            if self.fault is not None:
                return False
            try:
                self.rd.write_state(doc)
                return False
            except OSError as e:
                if fsutil.disk_fault(e) is None:
                    raise
                return self._failed(paths.STATE_FILE, e)

    def write_status(self, doc: Dict[str, Any]) -> bool:
        """training_status.md alone (a progress or checkpoint change). True when this starts a fault."""
        with self._lock:
            if self.fault is not None:
                return False
            try:
                self.rd.write_status(doc)
                return False
            except OSError as e:
                if fsutil.disk_fault(e) is None:
                    raise
                return self._failed(paths.SUMMARY_FILE, e)

    def recover(self, doc: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """During a fault: append the held events in order, then write `doc`. Returns what the fault was (with
        how many events were held and dropped) once everything is on disk, else None (still refused)."""
        with self._lock:
            if self.fault is None:
                return None
            try:
                while self._held:
                    self.rd.append_event(self._held[0])
                    self._held.popleft()
                self.rd.write_state(doc)
            except OSError as e:
                if fsutil.disk_fault(e) is None:
                    raise
                return None
            fault, self.fault = self.fault, None
            dropped, self.dropped = self.dropped, 0
        return {**fault, "dropped_events": dropped}


def home_problem_error(home: str, problem: str, run: str) -> UnfitError:
    """The refusal of a start on an ONBOX_HOME that cannot take a run's records (exit 3)."""
    return UnfitError("ONBOX_HOME %s is %s: run %s not started, nothing was created" % (home, problem, run),
                      hint=HOME_HINT % (home, home))


def home_fault_error(home: str, error: OSError, run: str) -> Optional[UnfitError]:
    """The same refusal for a write that failed on the way (the disk filled meanwhile), or None when `error` is
    not a disk fault."""
    name = fsutil.disk_fault(error)
    if name is None:
        return None
    what = {"ENOSPC": "full", "EDQUOT": "over its quota", "EIO": "failing", "EROFS": "read-only"}[name]
    return home_problem_error(home, "%s (%s writing %s)" % (what, name, os.path.basename(error.filename or "")
                                                           or "the run directory"), run)
