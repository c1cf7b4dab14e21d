"""The queue on disk, `$ONBOX_HOME/queue/` (0700):

  journal.jsonl  append-only, one JSON object a line (0600):
                   {"op": "add", "id", "name", "config", "at"}   an entry: the RunConfig `onbox run` resolved for
                                                                  it when it was added (what runs is what was queued)
                   {"op": "state", "id", "state", "at", ...}     each change of an entry's state; the LAST wins
                   {"op": "meta", "next_id"}                      first line after a compaction
  lock           flock(2) around every read (shared) and every append or compaction (exclusive)
  runner.lock    flock(2) held by the live queue runner: one runner a box (runner.py)
  runner.json    the runner's own state, written atomically: pid, start time, mode, state, notice
  logs/<id>.log  the stdout/stderr of each entry's agent (the job's own output is in its run dir)

U2: a file a running process reads must never be rewritten in place (bash re-reads a script by offset and runs a
block twice; a queue file edited mid-run loses or repeats entries). So entries and their states are only ever
appended, each record in one write(2) under the lock, while the runner re-reads the file between entries and so
sees what `onbox queue add` appended while it ran. The file is rewritten only by a compaction, atomically (temp
file + rename, under the exclusive lock), when no entry runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from onbox import fsutil, paths, untrusted, vocab
from onbox.errors import UnfitError, UsageError

PENDING, REMOVED = "pending", "removed"  # an entry's own states; the others are the words of its run's
RUNNING, DONE, FAILED, PREEMPTED, STOPPED = vocab.RUNNING, vocab.DONE, vocab.FAILED, vocab.PREEMPTED, vocab.STOPPED
STATES = (PENDING, RUNNING, DONE, FAILED, PREEMPTED, STOPPED, REMOVED)
FINAL = (DONE, FAILED, STOPPED, REMOVED)  # never run again (a relaunch of the queue skips them)
# Every record is a line of ~1 KiB (an entry's RunConfig): 64 MiB is tens of thousands of them, and a compaction
# keeps a real queue far below; past it (or a FIFO, /dev/zero) the journal is refused, never read whole.
JOURNAL_MAX_BYTES = 64 * 1024 * 1024
LOCK_WAIT = 10.0  # seconds a command waits for the queue's lock (each holder keeps it for milliseconds)


def queue_dir() -> str:
    return os.path.join(paths.onbox_home(), "queue")


@dataclasses.dataclass
class Entry:
    id: int
    name: str
    config: Dict[str, Any]
    added_at: float
    state: str = PENDING
    updated_at: Optional[float] = None
    agent_pid: Optional[int] = None
    agent_start: Optional[int] = None
    gpu: Optional[int] = None
    exit: Optional[int] = None
    message: str = ""
    launches: int = 0  # how many times an agent was started for it (a relaunch resumes the same run)
    last: Dict[str, Any] = dataclasses.field(default_factory=dict)  # its newest state record

    @property
    def command(self) -> List[str]:
        return list(self.config.get("command") or [])

    def to_dict(self) -> Dict[str, Any]:
        return {"id": self.id, "name": self.name, "state": self.state, "command": self.command,
                "added_at": self.added_at, "updated_at": self.updated_at, "agent_pid": self.agent_pid,
                "gpu": self.gpu, "exit": self.exit, "message": self.message, "launches": self.launches,
                "run_dir": os.path.join(paths.runs_dir(), self.name)}


class Journal:
    """The queue's files. Every method that reads or appends expects the caller to hold `locked()`."""

    def __init__(self, root: Optional[str] = None) -> None:
        self.root = root or queue_dir()
        self.path = os.path.join(self.root, "journal.jsonl")
        self.lock_path = os.path.join(self.root, "lock")
        self.runner_lock_path = os.path.join(self.root, "runner.lock")
        self.runner_path = os.path.join(self.root, "runner.json")
        self.logs = os.path.join(self.root, "logs")
        self.problems: List[str] = []  # lines the last read() could not use

    def exists(self) -> bool:
        return os.path.isfile(self.path)

    def create(self) -> None:
        fsutil.make_private_dir(self.root)
        fsutil.make_private_dir(self.logs)

    @contextlib.contextmanager
    def locked(self, exclusive: bool = True, wait: float = LOCK_WAIT) -> Iterator[None]:
        """flock on `lock`, waiting at most `wait` seconds. A shared lock on a queue that does not exist yet
        creates nothing (nothing to read)."""
        if not exclusive and not os.path.exists(self.lock_path):
            yield
            return
        try:
            if exclusive:
                self.create()
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, fsutil.PRIVATE_FILE)
        except OSError as e:
            raise UnfitError("cannot use the queue %s: %s" % (self.root, e.strerror or e),
                             hint="ONBOX_HOME (or its queue/ directory) must be a directory this user can write")
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    if time.monotonic() >= deadline:
                        raise UnfitError("the queue %s stayed locked for %.0f s" % (self.root, wait),
                                         hint="another onbox holds %s; `fuser -v %s` names it" % (
                                             self.lock_path, self.lock_path))
                    time.sleep(0.02)
            yield
        finally:
            os.close(fd)  # drops the flock

    def records(self) -> List[Dict[str, Any]]:
        """Every usable record, in order. A line that is not a JSON object (a torn last line after a crash, a
        hand edit) is skipped and named in `problems`."""
        self.problems = []
        try:
            raw = untrusted.read_bytes(self.path, JOURNAL_MAX_BYTES, "queue journal")
        except FileNotFoundError:
            return []
        except untrusted.UntrustedInput as e:
            raise UsageError(str(e), hint="move it aside (`mv %s %s.bad`) and queue the entries again: the queue "
                                          "then starts empty" % (self.path, self.path))
        out = []
        for n, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                rec = untrusted.loads_json(line, "queue record")
            except ValueError:  # not UTF-8, not JSON, or nested too deep (UntrustedInput)
                rec = None
            rid = rec.get("id") if isinstance(rec, dict) else None
            if (not isinstance(rec, dict) or rec.get("op") not in ("add", "state", "meta")
                    or (rec["op"] != "meta" and (not isinstance(rid, int) or isinstance(rid, bool)))):
                self.problems.append("%s line %d is not a queue record; skipped" % (self.path, n))
                continue
            out.append(rec)
        return out

    def read(self) -> Tuple[Dict[int, Entry], int]:
        """(entries by id, the next id). The last state record of each entry wins."""
        entries: Dict[int, Entry] = {}
        next_id = 1
        for rec in self.records():
            op, rid = rec.get("op"), rec.get("id")
            if op == "meta" and isinstance(rec.get("next_id"), int):
                next_id = max(next_id, rec["next_id"])
            elif op == "add" and isinstance(rid, int) and isinstance(rec.get("config"), dict):
                entries[rid] = Entry(id=rid, name=str(rec.get("name")), config=rec["config"],
                                     added_at=rec.get("at") or 0.0, updated_at=rec.get("at"))
                next_id = max(next_id, rid + 1)
            elif op == "state" and rid in entries and rec.get("state") in STATES:
                _apply_state(entries[rid], rec)
        return entries, next_id

    def append(self, record: Dict[str, Any]) -> None:
        """One record, one write(2) on an O_APPEND fd, then fsync: whole lines only, durable once it returns."""
        line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, fsutil.PRIVATE_FILE)
            try:
                if os.write(fd, line) != len(line):
                    raise OSError(errno.EIO, "short write")
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:  # U33: never report a record as written that is not on disk
            raise UnfitError("cannot append to the queue journal %s: %s" % (self.path, e.strerror or e),
                             hint="free space (bytes and inodes) on the disk of ONBOX_HOME, then try again")

    def set_state(self, entry: Entry, state: str, **fields: Any) -> None:
        rec = {"op": "state", "id": entry.id, "state": state, "at": time.time(), "launches": entry.launches}
        rec.update(fields)
        self.append(rec)
        _apply_state(entry, rec)

    def compact(self) -> int:
        """Rewrite the journal as one add record and one state record an entry, removed entries dropped:
        atomically, under the exclusive lock. Only the runner calls it, when no entry runs. Returns the lines
        saved."""
        before = self.records()
        entries, next_id = self.read()
        lines = [{"op": "meta", "next_id": next_id}]
        for e in sorted(entries.values(), key=lambda x: x.id):
            if e.state == REMOVED:
                continue
            lines.append({"op": "add", "id": e.id, "name": e.name, "config": e.config, "at": e.added_at})
            if e.last:
                lines.append(e.last)
        if len(lines) >= len(before):
            return 0
        fsutil.atomic_write(self.path, "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n"
                                               for r in lines))
        return len(before) - len(lines)

    def find(self, entries: Dict[int, Entry], ref: str) -> Entry:
        """An entry by id or run name; a UsageError naming what exists when there is none."""
        for e in entries.values():
            if e.state != REMOVED and (str(e.id) == ref or e.name == ref):
                return e
        raise UsageError("no queue entry %r" % ref, hint="`onbox queue ls` lists the entries (by id or run name)")

    # ---- the runner's own record -------------------------------------------------------------------------
    def write_runner(self, doc: Dict[str, Any]) -> None:
        fsutil.atomic_write_json(self.runner_path, doc)

    def read_runner(self) -> Dict[str, Any]:
        try:
            doc = fsutil.read_json(self.runner_path)
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}


def _apply_state(e: Entry, rec: Dict[str, Any]) -> None:
    e.state = rec["state"]
    e.updated_at = rec.get("at")
    e.last = rec
    e.message = str(rec.get("message") or "")
    e.exit = rec.get("exit")
    if isinstance(rec.get("launches"), int):  # every runner record carries it: it survives a compaction
        e.launches = rec["launches"]
    if rec["state"] == RUNNING:
        e.agent_pid, e.agent_start, e.gpu = rec.get("agent_pid"), rec.get("agent_start"), rec.get("gpu")
    else:
        e.agent_pid = e.agent_start = None
