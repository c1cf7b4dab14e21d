"""The on-disk spool: every heartbeat is written here first, pushed in order, removed only on acknowledgement.

One file per beat, `<seq:020d>.json`, written with the atomic-write recipe (fsynced), so a crash of the agent or
the box between "taken" and "delivered" loses nothing. The spool is bounded: past `max_entries` the OLDEST beats
are dropped (the newest say more about a live run) and the dropped count is kept in `state.json` and reported in
every later beat. `SeqCounter` hands out seqs that survive restarts of the agent: seq only increases in a run.

A disk that refuses the spool (full, failing, read-only: fsutil.disk_fault) must not stop the beats, which leave the
box over the network and then are the only news of the run: a beat the disk refused is held in memory (bounded,
oldest first out) and sent like any other; `on_fault` is told. Such a beat does not survive an agent restart.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import untrusted
from onbox.fsutil import atomic_write, atomic_write_json, disk_fault, read_json

SUFFIX = ".json"
HELD_MAX = 1000  # beats kept in memory while the disk refuses them
OnFault = Optional[Callable[[OSError], None]]


class Spool:
    def __init__(self, directory: str, max_entries: int = 20000) -> None:
        self.directory = directory
        self.max_entries = max_entries
        os.makedirs(directory, mode=0o700, exist_ok=True)  # beats carry the run's state: its owner's only
        self._lock = threading.Lock()
        self._state_path = os.path.join(directory, "state.json")
        state = self._read_state()
        self._seqs: List[int] = sorted(self._scan())
        self._held: Dict[int, Dict[str, Any]] = {}  # beats the disk refused, by seq
        self.dropped: int = int(state.get("dropped", 0))

    def _read_state(self) -> Dict[str, Any]:
        try:
            data = read_json(self._state_path, untrusted.CONFIG_MAX_BYTES)  # a FIFO or /dev/zero reads as none
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _scan(self) -> List[int]:
        out = []
        for name in os.listdir(self.directory):
            if name.endswith(SUFFIX) and name[: -len(SUFFIX)].isdigit():
                out.append(int(name[: -len(SUFFIX)]))
        return out

    def _path(self, seq: int) -> str:
        return os.path.join(self.directory, "%020d%s" % (seq, SUFFIX))

    def _save_state(self) -> None:
        atomic_write_json(self._state_path, {"dropped": self.dropped})

    def put(self, seq: int, doc: Dict[str, Any], on_fault: OnFault = None) -> None:
        """Persist one beat (fsynced) before anyone tries to send it; drop the oldest past the bound. With
        `on_fault`, a disk fault keeps the beat in memory instead of raising (and is passed to on_fault)."""
        data = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
        fault: Optional[OSError] = None
        with self._lock:
            try:
                atomic_write(self._path(seq), data)
                self._held.pop(seq, None)
            except OSError as e:
                if on_fault is None or disk_fault(e) is None:
                    raise
                fault = e
                self._held[seq] = doc
            if seq not in self._seqs:
                self._seqs.append(seq)
                self._seqs.sort()
            over = max(len(self._seqs) - self.max_entries, 0)
            old = self._seqs[:over] + sorted(self._held)[:max(len(self._held) - HELD_MAX, 0)]
            if old:
                for dropped in set(old):
                    self._unlink(dropped)
                    self._held.pop(dropped, None)
                self._seqs = [s for s in self._seqs if s not in set(old)]
                self.dropped += len(set(old))
                try:
                    self._save_state()
                except OSError as e:
                    if on_fault is None or disk_fault(e) is None:
                        raise
                    fault = fault or e
        if fault is not None and on_fault is not None:
            on_fault(fault)

    def pending(self, limit: int) -> List[Tuple[int, Dict[str, Any]]]:
        """The oldest `limit` beats, in seq order."""
        with self._lock:
            seqs = list(self._seqs[:limit])
        out = []
        for seq in seqs:
            held = self._held.get(seq)
            if held is not None:
                out.append((seq, held))
                continue
            try:
                out.append((seq, read_json(self._path(seq))))
            except FileNotFoundError:
                continue
            except ValueError:  # torn (atomic writes prevent it), not a regular file, too deep: unsendable
                self.ack([seq])
        return out

    def ack(self, seqs: List[int]) -> None:
        """The sink has the beats: remove them."""
        with self._lock:
            gone = set(seqs)
            for seq in gone:
                self._unlink(seq)
                self._held.pop(seq, None)
            self._seqs = [s for s in self._seqs if s not in gone]

    def backlog(self) -> int:
        with self._lock:
            return len(self._seqs)

    def _unlink(self, seq: int) -> None:
        try:
            os.unlink(self._path(seq))
        except FileNotFoundError:
            pass


class SeqCounter:
    """The run's heartbeat sequence number, persisted (atomic write) so that a restarted agent continues it.

    A fresh counter starts at `first` (the hook passes the wall clock in milliseconds), not at 0: a replacement
    box that runs the same run name with a fresh run dir must not reuse the seqs (and attempt numbers) of the
    box it replaces, or the tracker would drop its beats as duplicates of (run, attempt, seq).
    """

    def __init__(self, path: str, first: int = 0) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            data = read_json(path, untrusted.CONFIG_MAX_BYTES)
            self._next = int(data["next_seq"])
            self.first = int(data.get("first_seq", 0))
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            self._next = self.first = int(first)

    def next(self, on_fault: OnFault = None) -> int:
        """The next seq, persisted first. With `on_fault`, a disk fault is passed to it and the seq is still
        handed out (counted in memory; the next call persists it)."""
        with self._lock:
            seq = self._next
            self._next += 1
            try:
                atomic_write_json(self.path, {"first_seq": self.first, "next_seq": self._next})
            except OSError as e:
                if on_fault is None or disk_fault(e) is None:
                    raise
                fault: Optional[OSError] = e
            else:
                fault = None
        if fault is not None and on_fault is not None:
            on_fault(fault)
        return seq
