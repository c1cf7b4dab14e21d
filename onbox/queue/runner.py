"""The queue runner (`onbox queue run`): one loop that starts each entry as its own agent, `onbox run --foreground
--name <entry>` (the entry's resolved config written as the run's re-launch record, config.json, before its first
start), in id order, in as many slots as it has; it records every outcome in the journal.

A preemption of the runner (SIGTERM, SIGINT, SIGUSR1/USR2, a cloud notice through onbox.supervisor.preempt), or of
one entry's agent on its own (it exits 75), stops the queue: no new entry starts, SIGTERM goes to each running
agent (which forwards its checkpoint signal, commits and exits 75), each is recorded `preempted`, the runner exits
75. A relaunch of `onbox queue run` starts again with the lowest id that is not done: the preempted entry first,
resumed by its agent from its newest checkpoint (same run name, same run dir); a done entry never runs twice. An agent still alive from a runner that died is
watched again, not started twice (pid and start time, like a run's child).

Signal handlers only record (SignalInbox); the loop blocks in select() on their wakeup fd, the notice pipe and a
tick, reaps its agents with waitpid, and re-reads the journal when a slot is free, so entries added while the
queue runs are picked up (U2: appended, never edited in place).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox import vocab
from onbox.clock import Clock, SystemClock
from onbox.fsutil import make_private_dir
from onbox.proc import Child, ExitStatus, ProcessSeam, is_alive, start_time
from onbox.queue.journal import DONE, FAILED, FINAL, PREEMPTED, RUNNING, STOPPED, Entry, Journal
from onbox.queue.slots import Slot, agent_env
from onbox.supervisor.preempt import MetadataPoller, NoticePipe, SignalInbox
from onbox.supervisor.rundir import RunDir, tail_lines

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
STOP_MARGIN = 30.0  # seconds beyond an agent's own grace + final commit the runner waits for it after a notice
SAME_RUN = ("command", "ckpt_dir", "durable")  # a run dir holding another of these is not this entry's


@dataclasses.dataclass
class Running:
    entry: Entry
    child: Child
    slot: Optional[Slot]  # None: an agent adopted from a dead runner beyond the slots there are


class QueueRunner:
    def __init__(self, journal: Journal, slots: List[Slot], agent: List[str], runs_dir: str,
                 environ: Optional[Mapping[str, str]] = None, proc: Optional[ProcessSeam] = None,
                 clock: Optional[Clock] = None, notice_source: str = "none", metadata_url: Optional[str] = None,
                 notice_interval: float = 5.0, tick: float = 0.5, mode: str = "",
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.journal = journal
        self.slots = slots
        self.agent = agent
        self.runs_dir = runs_dir
        self.environ = dict(os.environ if environ is None else environ)
        self.proc = proc or ProcessSeam()
        self.clock = clock or SystemClock()
        self.tick = tick
        self.mode = mode or ("%d at a time" % len(slots) if len(slots) > 1 else "one at a time")
        self._log: Callable[[str], None] = log or self._stderr_log
        self.running: Dict[int, Running] = {}
        self.started: List[str] = []
        self.failed: List[str] = []
        self.notice: Optional[str] = None
        self.stop_deadline: Optional[float] = None
        self.started_at = self.clock.time()
        self.on_ready: Optional[Callable[[Dict[str, Any]], None]] = None
        self._filled_once = False  # the first fill also watches again the live agents a dead runner left
        self.inbox = SignalInbox({*NOTICE_SIGNALS, signal.SIGHUP, signal.SIGCHLD})
        self.notices = NoticePipe()
        self.poller = MetadataPoller(notice_source, metadata_url, notice_interval,
                                     lambda lead, src, detail: self.notices.put((src, detail)), log=self._log,
                                     on_death=self._poller_died)

    @staticmethod
    def _stderr_log(message: str) -> None:
        sys.stderr.write("onbox-queue[%d]: %s\n" % (os.getpid(), message))
        sys.stderr.flush()

    def _poller_died(self, error: BaseException) -> None:
        self._log("the metadata poller died: %r; cloud preemption notices are OFF (signals still stop the queue)"
                  % (error,))

    # ---- the loop ------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Run the queue until it is drained (0, or 1 when an entry failed) or preempted (75)."""
        self.inbox.install()
        try:
            self._status("running")
            self._compact_if_idle()
            self.poller.start()
            while True:
                self._observe()
                if self.notice is not None:
                    if self.stop_deadline is None:
                        self._forward()
                    if not self.running:
                        return self._end(PREEMPTED, 75)
                    if self.clock.monotonic() >= (self.stop_deadline or 0.0):
                        self._log("agents still running %s after the notice: leaving them (a relaunch of the "
                                  "queue watches them again)" % ", ".join(r.entry.name for r in self.running.values()))
                        return self._end(PREEMPTED, 75)
                else:
                    self._fill()
                    if not self.running:
                        self._compact_if_idle()
                        return self._end(DONE, 1 if self.failed else 0)
                self._ready()
                if not self.inbox.pending:
                    self.inbox.wait(self.tick, [self.notices.read_fd])
        finally:
            self.poller.stop()
            self.inbox.restore()
            self.notices.close()

    def _observe(self) -> None:
        for s in self.inbox.take():
            if s in NOTICE_SIGNALS:
                self._on_notice("signal:%s" % signal.Signals(s).name)
            elif s == signal.SIGHUP:
                self._log("ignoring SIGHUP (the queue runs on; SIGTERM stops it)")
        for src, detail in self.notices.drain():
            self._on_notice("%s %s" % (src, detail))
        for rid, r in list(self.running.items()):
            status = self.proc.poll(r.child)
            if status is not None:
                del self.running[rid]
                self._record_end(r, status)

    def _on_notice(self, source: str) -> None:
        if self.notice is None:
            self.notice = source
            self._log("preemption notice from %s: stopping the queue" % source)
            self._status("stopping")

    def _forward(self) -> None:
        """Each running agent gets SIGTERM: its own preemption (checkpoint signal to its job, commit, exit 75)."""
        longest = 0.0
        for r in self.running.values():
            self.proc.signal_pid(r.child.pid, signal.SIGTERM)
            grace = r.entry.config.get("grace")
            longest = max(longest, float(grace if isinstance(grace, (int, float)) else 30.0)
                          + float(r.entry.config.get("final_sync_timeout") or 0.0))
            self._log("SIGTERM to the agent of %s (pid %d)" % (r.entry.name, r.child.pid))
        self.stop_deadline = self.clock.monotonic() + longest + STOP_MARGIN

    def _fill(self) -> None:
        """Start the next entries (lowest id first) in the free slots; watch again a live agent a dead runner
        left. The journal is re-read under its lock: what `queue add` appended meanwhile is seen, and a `queue rm`
        cannot race a start."""
        if len(self.running) >= len(self.slots) and self._filled_once:
            return
        self._filled_once = True
        with self.journal.locked():
            entries, _ = self.journal.read()
            todo: List[Entry] = []
            for e in sorted(entries.values(), key=lambda x: x.id):
                if e.id in self.running or e.state in FINAL:
                    continue
                if e.state == RUNNING and e.agent_pid and (self._adopt(e) or self._ended_unwatched(e)):
                    continue
                todo.append(e)
            # only then the starts: a live agent keeps the slot (the GPU) it runs on, whatever its id
            for e in todo:
                free = self._free_slot(None)
                if free is None:
                    break
                self._start(e, free)

    def _adopt(self, e: Entry) -> bool:
        """A live agent of this entry, started by a runner that died: watch it (never start a second one)."""
        assert e.agent_pid is not None
        child = self.proc.adopt(e.agent_pid, e.agent_start)
        if child is None:
            return False
        self.running[e.id] = Running(e, child, self._free_slot(e.gpu))
        self._log("watching the live agent of %s again (pid %d)" % (e.name, child.pid))
        self._status("running")
        return True

    def _ended_unwatched(self, e: Entry) -> bool:
        """Its agent ended while no runner watched: a run that finished (done, failed, stopped) is recorded as
        such, never started again; one that was preempted or cut short is started again (it resumes)."""
        doc = RunDir(os.path.join(self.runs_dir, e.name)).read_state() or {}
        # fenced: another box holds the run now; starting it here again would only be refused by that lease
        state = {vocab.DONE: DONE, vocab.FAILED: FAILED, vocab.STOPPED: STOPPED, vocab.FENCED: FAILED}.get(str(doc.get("state")))
        if state is None:
            return False
        self.journal.set_state(e, state, message=str(doc.get("message") or ""))
        if state == FAILED:
            self.failed.append(e.name)
        self._log("entry %d %s ended while no runner watched it: %s" % (e.id, e.name, state))
        return True

    def _free_slot(self, gpu: Optional[int]) -> Optional[Slot]:
        used = {r.slot.index for r in self.running.values() if r.slot is not None}
        free = [s for s in self.slots if s.index not in used]
        same = [s for s in free if gpu is not None and s.gpu == gpu]
        pick = same or free
        return pick[0] if pick else None

    def _start(self, e: Entry, slot: Slot) -> None:
        rd = RunDir(os.path.join(self.runs_dir, e.name))
        problem = self._prepare_run_dir(rd, e)
        if problem:
            self.failed.append(e.name)
            self.journal.set_state(e, FAILED, message=problem)
            self._log("entry %d %s not started: %s" % (e.id, e.name, problem))
            return
        make_private_dir(self.journal.logs)
        log = os.path.join(self.journal.logs, "%d.log" % e.id)
        argv = [*self.agent, "run", "--foreground", "--name", e.name]
        try:
            child = self.proc.spawn(argv, agent_env(self.environ, slot.gpu), e.config.get("workdir") or "/", log)
        except OSError as err:
            self.failed.append(e.name)
            self.journal.set_state(e, FAILED, message="cannot start its agent %s: %s" % (argv[0], err))
            return
        self.journal.set_state(e, RUNNING, agent_pid=child.pid, agent_start=child.start_time or start_time(child.pid),
                               gpu=slot.gpu, launches=e.launches + 1, runner_pid=os.getpid())
        self.running[e.id] = Running(e, child, slot)
        self.started.append(e.name)
        self._status("running")
        self._log("entry %d %s started%s (agent pid %d%s)" % (
            e.id, e.name, " again: it resumes" if e.launches > 1 else "", child.pid,
            ", GPU %d" % slot.gpu if slot.gpu is not None else ""))

    def _prepare_run_dir(self, rd: RunDir, e: Entry) -> Optional[str]:
        """The entry's config.json (its re-launch record) in its run dir, unless the dir holds another run."""
        saved: Optional[Dict[str, Any]]
        try:
            saved = rd.load_config()
        except FileNotFoundError:
            rd.make_private()
            rd.write_config(e.config)
            return None
        except (OSError, ValueError) as err:
            return "cannot read %s: %s" % (rd.config_path, err)
        except TypeError:  # JSON, but no run's record
            saved = None
        if saved is None or any((saved.get(k) or None) != (e.config.get(k) or None) for k in SAME_RUN):
            return ("the run %s exists and is another run (its command, checkpoint dir or durable target differ); "
                    "queue this entry under another --name" % e.name)
        return None  # started before (a preemption, or a runner that died): the agent resumes it

    def _record_end(self, r: Running, status: ExitStatus) -> None:
        state, message = self._outcome(r.entry, status, r.child.pid)
        if state == FAILED:
            self.failed.append(r.entry.name)
        with self.journal.locked():
            self.journal.set_state(r.entry, state, exit=status.code, message=message)
        self._log("entry %d %s: %s%s" % (r.entry.id, r.entry.name, state, (" — " + message) if message else ""))
        if state == PREEMPTED and self.notice is None:
            # its agent got a notice the runner has not (its own cloud poller, a signal): the box is going away
            # as far as the queue knows. Restarting it here could repeat that at every tick; the queue stops and
            # a relaunch resumes it first.
            self._on_notice("entry %d %s (its agent was preempted)" % (r.entry.id, r.entry.name))
        self._status("stopping" if self.notice else "running")

    def _outcome(self, e: Entry, status: ExitStatus, agent_pid: int) -> Tuple[str, str]:
        """The entry's state from its agent's exit code (0 done or stopped, 1 failed, 2/3 refused, 75 preempted)
        and its run's state.json (an adopted agent's code cannot be known). A state.json another agent wrote (the
        entry's previous launch: an agent that refused to start writes none) says nothing about this one."""
        doc = RunDir(os.path.join(self.runs_dir, e.name)).read_state() or {}
        if doc.get("agent_pid") != agent_pid:
            doc = {}
        run_state, message = doc.get("state"), str(doc.get("message") or "")
        if status.code == 75 or run_state == vocab.PREEMPTED:
            return PREEMPTED, "stopped after its final commit; `onbox queue run` resumes it from its newest checkpoint"
        if status.code == 0 or (status.code is None and run_state in (vocab.DONE, vocab.STOPPED)):
            return (STOPPED if run_state == vocab.STOPPED else DONE), message
        if status.code in (2, 3):  # refused before its job started: the reason is the agent's last words
            said = [line for line in tail_lines(os.path.join(self.journal.logs, "%d.log" % e.id), 20)
                    if line.startswith(("onbox:", "hint:"))]
            return FAILED, " ".join(said) or "its agent refused to start (exit %d)" % status.code
        if run_state == vocab.FAILED:
            return FAILED, message
        if self.notice is not None:  # ended during the stop, before its run could say more: nothing is lost
            return PREEMPTED, "its agent ended during the queue's preemption (%s)" % _describe(status)
        return FAILED, ("its agent ended (%s) with the run %s; `onbox status %s` (a live job: `onbox adopt %s`)"
                        % (_describe(status), run_state or "not started", e.name, e.name))

    # ---- records -------------------------------------------------------------------------------------------
    def _compact_if_idle(self) -> None:
        if self.running:
            return
        with self.journal.locked():
            entries, _ = self.journal.read()
            if any(e.state == RUNNING and e.agent_pid and is_alive(e.agent_pid, e.agent_start)
                   for e in entries.values()):
                return
            saved = self.journal.compact()
        if saved:
            self._log("compacted the journal (%d lines fewer)" % saved)

    def _status(self, state: str, code: Optional[int] = None) -> None:
        self.journal.write_runner({
            "pid": os.getpid(), "start_time": start_time(os.getpid()), "state": state, "mode": self.mode,
            "slots": [s.gpu for s in self.slots], "started_at": self.started_at, "updated_at": self.clock.time(),
            "notice": self.notice, "exit": code, "running": sorted(r.entry.name for r in self.running.values())})

    def _ready(self) -> None:
        if self.on_ready is not None:
            ready, self.on_ready = self.on_ready, None
            ready({"ok": True, "runner_pid": os.getpid(), "mode": self.mode, "started": list(self.started),
                   "running": sorted(r.entry.name for r in self.running.values())})

    def _end(self, state: str, code: int) -> int:
        self._status("preempted" if state == PREEMPTED else "done", code)
        self._ready()
        self._log("queue %s (exit %d)" % ("preempted: `onbox queue run` continues it" if state == PREEMPTED
                                          else "drained", code))
        return code


def _describe(status: ExitStatus) -> str:
    if status.signal is not None:
        return "signal %s" % signal.Signals(status.signal).name
    return "exit %s" % status.code if status.code is not None else "exit status unknown"


def has_work(journal: Journal) -> bool:
    """Anything a runner would start or watch: an entry that is not done, failed, stopped or removed."""
    with journal.locked(exclusive=False):
        entries, _ = journal.read()
    return any(e.state not in FINAL for e in entries.values())

