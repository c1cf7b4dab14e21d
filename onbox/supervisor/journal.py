"""What the run says (its events, state.json, training_status.md, progress.json), kept up on a run dir that refuses
writes.

Every event goes to events.jsonl, the telemetry hook and the run's notes (notes.py); state.json and
training_status.md are rebuilt from the supervisor's state document at each write, progress.json from the progress
feed when it has news; training_status.md is rewritten when what it shows changed. All of it is written through
RunRecords (records.py), which holds it in memory while the disk refuses it; the journal says when such a fault
starts and ends (`run_dir_unwritable`, `run_dir_writable`) and retries at each tick. The subsystem hooks are called
through it too: a bug in a hook is said loudly (a traceback in agent.log, a `hook_error` event) but never ends the
supervision, and a hook's write that the run dir refused is such a fault, not a bug.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Dict

from onbox import fsutil, paths
from onbox.clock import Clock
from onbox.supervisor.hooks import NoTelemetry, TelemetryHook
from onbox.supervisor.notes import RunNotes
from onbox.supervisor.records import RunRecords
from onbox.supervisor.rundir import RunDir
from onbox.telemetry.progress import ProgressFeed

PROGRESS_WRITE_S = 1.0  # progress.json at most once a second: a trainer may report hundreds of steps a second

UNWRITABLE_HINT = ("free space on that filesystem (`df -h %s`, `df -i %s`: bytes and inodes, U7); the agent writes "
                   "the state and the events it holds as soon as the disk takes them")


class RunJournal:
    """Writes one run's events and state. `state_doc()` builds state.json as it is now; `attempt()` is the current
    attempt number every event carries."""

    def __init__(self, rd: RunDir, clock: Clock, log: Callable[[str], None], state_doc: Callable[[], Dict[str, Any]],
                 attempt: Callable[[], int]) -> None:
        self.rd = rd
        self.clock = clock
        self.log = log
        self.state_doc = state_doc
        self.attempt = attempt
        self.records = RunRecords(rd, clock.time)  # a full or failing run disk: held in memory
        self.notes = RunNotes()  # warnings, requeue outcome, summary refreshes: learned from events, any thread
        self.telemetry: TelemetryHook = NoTelemetry()  # the run's, once the hooks are built
        self._progress_written = (0, float("-inf"))  # (the feed's record count, monotonic time) of the last write

    def emit(self, event_type: str, **fields: Any) -> None:
        """One event (from any thread)."""
        ev = {"time": self.clock.time(), "type": event_type, "run": self.rd.name, "attempt": self.attempt()}
        ev.update(fields)
        started = self.records.append_event(ev)  # held in memory while the disk refuses it
        self.hook("telemetry.on_event", self.telemetry.on_event, ev)
        self.notes.on_event(ev)
        if started:
            self._say_unwritable()

    def save(self) -> None:
        """state.json (and training_status.md) as the run is now."""
        if self.records.write_state(self.state_doc()):
            self._say_unwritable()

    def hook(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a subsystem hook. A bug in a hook is recorded loudly but must not orphan the job."""
        try:
            return fn(*args)
        except Exception as e:
            if fsutil.disk_fault(e):  # a full or failing disk, not a bug: no traceback
                assert isinstance(e, OSError)
                if not e.filename or os.path.abspath(str(e.filename)).startswith(self.rd.path + os.sep):
                    self.write_failed("hook %s" % what, e)
                    return None
                self.log("hook %s: %s" % (what, e))
            else:
                self.log("hook %s failed: %r\n%s" % (what, e, traceback.format_exc()))
            if what != "telemetry.on_event":
                self.emit("hook_error", hook=what, error=repr(e))
            return None

    # ---- a run disk that refuses writes (records.py) -------------------------------------------------------
    def write_failed(self, what: str, error: OSError) -> None:
        """A write into the run dir met a disk fault (also a hook's, through RunContext.write_failed)."""
        if self.records.failed(what, error):
            self._say_unwritable()

    def keep(self, what: str, write: Callable[..., Any], *args: Any) -> None:
        """A write the supervision must outlive: a disk fault is recorded, any other error raised."""
        try:
            write(*args)
        except OSError as e:
            if fsutil.disk_fault(e) is None:
                raise
            self.write_failed(what, e)

    def _say_unwritable(self) -> None:
        fault = self.records.snapshot() or {}
        self.log("cannot write %s (%s: %s): supervising on, the state is kept in memory and written once the disk "
                 "takes it" % (fault.get("path"), fault.get("errno"), fault.get("error")))
        self.emit("run_dir_unwritable", **{k: fault.get(k) for k in ("errno", "error", "what", "path")},
                  hint=UNWRITABLE_HINT % (self.rd.path, self.rd.path))

    def recover(self) -> None:
        """During a fault (each tick): the held events, then the state; once written, say that the fault is over."""
        ended = self.records.recover(self.state_doc())
        if ended is None:
            return
        took = max(0.0, self.clock.time() - float(ended["since"]))
        self.log("the run directory takes writes again after %.1f s: the held state and events are written" % took)
        self.emit("run_dir_writable", after_s=round(took, 3), errno=ended["errno"],
                  dropped_events=ended["dropped_events"])
        self.save()  # once more, without the warning

    def record_final_state(self, state: str, timeout: float, interval: float, told_to_go: Callable[[], bool],
                           wait: Callable[[float], None]) -> None:
        """The run has ended but its final state is not on disk: the agent stays (holding the run's lock) and tries
        again until `timeout` (final_sync_timeout) passes or `told_to_go()` (a TERM/INT), so that freeing space in
        time records how the run ended."""
        if not self.records.degraded:
            return
        deadline = self.clock.monotonic() + timeout
        self.log("the run is %s but the run directory refuses writes: trying again for up to %.0f s"
                 % (state, timeout))
        while True:
            self.recover()
            now = self.clock.monotonic()
            if not self.records.degraded or now >= deadline or told_to_go():
                break
            wait(min(deadline - now, max(0.1, min(1.0, interval))))
        if self.records.degraded:
            self.log("gave up: the final state (%s) of run %s is not recorded, the run directory still refuses "
                     "writes" % (state, self.rd.name))

    def record_progress(self, feed: ProgressFeed, final: bool = False) -> None:
        """progress.json, the feed's newest values, when it took records since the last write, at most every
        PROGRESS_WRITE_S; `final` (the supervision ends): now. The summary shows it: due again. While the run dir
        refuses writes only the final one is tried (the news waits for the disk)."""
        taken, at = self._progress_written
        now = self.clock.monotonic()
        if not final and (self.records.degraded or feed.records_taken == taken or now - at < PROGRESS_WRITE_S):
            return
        try:
            fsutil.atomic_write_json(self.rd.file(paths.PROGRESS_FILE), feed.snapshot())
        except OSError as e:
            if fsutil.disk_fault(e) is None:
                raise
            return self.write_failed(paths.PROGRESS_FILE, e)
        self._progress_written = (feed.records_taken, now)
        self.notes.summary_due()

    def refresh_summary(self) -> None:
        """training_status.md again when what it shows changed without a state change: a commit, new progress, a
        hook's file beside state.json, a warning (state changes rewrite it through save())."""
        status_due, state_due = self.notes.take()
        if state_due:
            self.save()
        elif status_due and self.records.write_status(self.state_doc()):
            self._say_unwritable()

    def housekeep(self, feed: ProgressFeed, rotate_log: Callable[[], None]) -> None:
        """Each tick's records: a fault's held writes again, output.log's rotation, progress.json, the summary."""
        if self.records.degraded:
            self.recover()
        self.keep(paths.OUTPUT_LOG + " (rotation)", rotate_log)
        self.record_progress(feed)
        self.refresh_summary()
