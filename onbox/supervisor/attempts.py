"""The attempt launcher: one attempt of the run from its start to its end.

Starting an attempt builds the child's argv and environment (childenv.py, with a per-attempt marker: leftovers.py),
logs the command line into output.log, spawns the child in its own session through the process seam (under its
keeper: shim.py) and records the attempt (state.json `attempts`: pid, session, start time, boot id, marker, keeper).
Its end is classified (exits.py)
from the exit status, the output's tail and the host's OOM counter, recorded (`last_exit`, an `exit` event), and
what the attempt left running is stopped. What the attempt runs (the phase's command, the checkpoint it resumes
from) and what follows its end are the loop's to decide.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Callable, Dict, List, Optional

from onbox import fsutil, paths
from onbox.config import RunConfig, agent_only_vars
from onbox.errors import UsageError
from onbox.proc import Child, ExitStatus, ProcessSeam, ProcRef, boot_id
from onbox.supervisor import exits as cls
from onbox.supervisor import shim
from onbox.supervisor.childenv import child_argv, child_env, cpu_quota_cores, secret_env
from onbox.supervisor.journal import RunJournal
from onbox.supervisor.leftovers import MARKER_VAR, AttemptProcesses, new_marker, stop_attempt
from onbox.supervisor.rundir import LogTailer, RunDir
from onbox.supervisor.stacks import STACKS_VAR


class AttemptLauncher:
    """Starts the run's attempts one at a time and keeps their records. `saved`: state.json as an earlier agent
    left it (its attempts and last exit carry on). `on_line(line)`: each line of the child's output."""

    def __init__(self, cfg: RunConfig, rd: RunDir, proc: ProcessSeam, journal: RunJournal, environ: Dict[str, str],
                 ckpt_dir: str, oom_reader: Callable[[], Optional[int]], saved: Dict[str, Any],
                 on_line: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.rd = rd
        self.proc = proc
        self.journal = journal
        self.environ = environ
        self.ckpt_dir = ckpt_dir
        self.oom_reader = oom_reader
        self.attempts: List[Dict[str, Any]] = list(saved.get("attempts") or [])
        self.last_exit: Optional[Dict[str, Any]] = saved.get("last_exit")
        self.child: Optional[Child] = None
        self.exit_status: Optional[ExitStatus] = None  # the child's, once its exit is seen
        self.resume_from: Optional[str] = None
        self.oom_before: Optional[int] = None
        self.tree: Optional[AttemptProcesses] = None  # the current attempt's processes (leftovers.py)
        self.tailer = LogTailer(rd.log_path, from_end=True)  # the child's output, as output.log has it
        self.on_line = on_line

    @property
    def number(self) -> int:
        """The current attempt's number (0 on the first)."""
        return max(0, len(self.attempts) - 1)

    def wake_fds(self) -> List[int]:
        """What the loop may wait on besides signals: the keeper's report of the child's exit."""
        fd = shim.wake_fd(self.child) if self.running else None
        return [fd] if fd is not None else []

    @property
    def running(self) -> bool:
        """A child whose exit is not seen yet."""
        return self.child is not None and self.exit_status is None

    def sessions(self) -> List[int]:
        """The session ids of every earlier attempt."""
        return [a["sid"] for a in self.attempts if a.get("sid")]

    def clear_last(self) -> None:
        """Before a new attempt: stop what the last one left running (it may be an earlier agent's)."""
        if self.attempts and self.cfg.reap_orphans:
            self._stop_leftovers(self.attempts[-1])

    def start(self, command: List[str], resume_args: List[str], extra_env: Dict[str, str],
              resume_from: Optional[str]) -> Optional[cls.Classification]:
        """Start the next attempt of `command` (resuming from `resume_from` when a checkpoint was restored).
        None once the child runs; else why it could not start, recorded as the attempt's exit."""
        self.resume_from = resume_from
        n = len(self.attempts)
        argv = child_argv(command, resume_args, resume_from)
        try:  # read now, every attempt: a relaunch and a rotated secret file get the current values
            secrets = secret_env(self.cfg.env_files, self.cfg.secrets)
            start_error = None
        except UsageError as e:
            secrets, start_error = {}, e
        env = child_env(self.environ, self.rd.name, self.ckpt_dir, resume_from, n, self.rd.metrics_file,
                        self.rd.preempt_file, {**self.cfg.env, **extra_env, **secrets}, cpu_quota_cores(),
                        agent_only=agent_only_vars(self.cfg))
        marker = env[MARKER_VAR] = new_marker(self.rd.name, n)  # what the attempt's processes inherit
        # where a trainer that opted into faulthandler dumps its stacks on a hang (stacks.py)
        env[STACKS_VAR] = self.rd.file(paths.STACKS_DIR)
        self.journal.keep(paths.STACKS_DIR, fsutil.make_private_dir, env[STACKS_VAR])
        for stale in (self.rd.preempt_file,):
            if os.path.exists(stale):
                self.journal.keep(paths.PREEMPT_FILE, os.unlink, stale)
        self.oom_before = self.oom_reader()
        self.journal.keep(paths.OUTPUT_LOG, self.rd.log_line, "attempt %d: %s%s" % (
            n, " ".join(argv), " (resuming from %s)" % resume_from if resume_from else ""))
        self.tailer.read_new()
        self.tailer.reset_tail()
        record: Dict[str, Any] = {"n": n, "pid": None, "sid": None, "pgid": None, "start_time": None,
                                  "started_at": self.journal.clock.time(), "ended_at": None, "exit": None,
                                  "argv": argv, "resume_from": resume_from, "marker": marker}
        self.attempts.append(record)
        self.exit_status = None
        try:
            if start_error is not None:
                raise start_error
            self.child = self.proc.spawn(argv, env, self.cfg.workdir, self.rd.log_path)
        except (OSError, ValueError, UsageError) as e:
            if isinstance(e, UsageError):
                result = cls.Classification(cls.FAILED, 127, None, "cannot start attempt %d: %s" % (n, e.message),
                                            e.hint or "")
            else:  # ValueError: Popen refuses an argument or variable it cannot pass (a NUL byte)
                result = cls.Classification(cls.FAILED, 127, None, "cannot start %s: %s" % (
                    argv[0], getattr(e, "strerror", None) or e), "check the command and its path (PATH is the agent's)")
            record.update(ended_at=self.journal.clock.time(), exit=result.to_dict())
            self.last_exit = result.to_dict()
            return result
        record.update(pid=self.child.pid, sid=self.child.sid, pgid=self.child.pgid,
                      start_time=self.child.start_time, boot_id=boot_id())
        if isinstance(self.child, shim.KeptChild) and self.child.keeper is not None:
            record.update(keeper=self.child.keeper.to_dict())  # an adopting agent reads the child's exit through it
        if self.cfg.reap_orphans:
            self.tree = AttemptProcesses(self.proc, ProcRef(self.child.pid, self.child.start_time)
                                         if self.child.start_time is not None else None, marker)
        return None

    def adopt(self, child: Child) -> bool:
        """The child of an earlier (dead) agent becomes the current attempt's. True when it has ended already (its
        keeper kept its exit: shim.py), its exit status then known (`exit_status`)."""
        self.child = child
        if self.cfg.reap_orphans:
            self.tree = AttemptProcesses(self.proc, ProcRef(child.pid, child.start_time)
                                         if child.start_time is not None else None,
                                         self.attempts[-1].get("marker") if self.attempts else None)
        self.poll()
        return self.exit_status is not None

    def read_output(self) -> None:
        """Hand on what the child wrote since the last call."""
        for line in self.tailer.read_new():
            self.on_line(line)

    def poll(self) -> None:
        """Hand on the child's new output and see whether it ended (`exit_status`); once it did, the rest of its
        output (a last line without a newline too) is handed on before anything acts on the exit."""
        self.read_output()
        if not self.running:
            return
        assert self.child is not None
        self.exit_status = self.proc.poll(self.child)
        if self.exit_status is not None:
            self.read_output()
            for line in self.tailer.flush_partial():
                self.on_line(line)

    def watch(self) -> None:
        """Each tick: remember what the attempt forks while its parents still live (leftovers.py)."""
        if self.tree is not None and self.running:
            self.tree.poll()

    def rotate_log(self) -> None:
        """output.log past log_max_bytes: rotated (the tailer follows it)."""
        if self.rd.rotate_log(self.cfg.log_max_bytes, self.cfg.log_backups):
            self.journal.emit("log_rotated")

    def signal(self, sig: signal.Signals) -> int:
        """`sig` to the child's process group; returns the group."""
        assert self.child is not None
        self.proc.signal_group(self.child.pgid, sig)
        return self.child.pgid

    def seconds_run(self) -> float:
        """How long the last attempt ran (infinite when its record has no start)."""
        started = self.attempts[-1].get("started_at") if self.attempts else None
        return self.journal.clock.time() - started if isinstance(started, (int, float)) else float("inf")

    def finish(self, preempted: bool = False, stopped: bool = False,
               fenced: Optional[Dict[str, Any]] = None, session_limit: bool = False,
               hung: Optional[Dict[str, Any]] = None) -> cls.Classification:
        """The child has ended (or a stop gave up on it): classify and record its exit, stop what it left.
        `fenced`: the stop was a fence's (the fenced event's fields); `session_limit`: the run's deadline's; `hung`:
        the hang watch's (the hang_detected event's fields): the child still runs, and is stopped with the rest of
        the attempt (its exit status is then what the stop made of it, or unknown once reaped)."""
        if hung is not None and self.cfg.reap_orphans is False and self.child is not None:
            self.tree = AttemptProcesses(self.proc, self._root(), None)  # the hung attempt goes, whatever the setting
        status = self.exit_status or ExitStatus()
        result = cls.classify(status, list(self.tailer.tail), self.oom_before, self.oom_reader(),
                              preempted=preempted, stopped=stopped, fenced=fenced, session_limit=session_limit,
                              hung=hung)
        rec = self.attempts[-1]
        rec.update(ended_at=self.journal.clock.time(), exit=result.to_dict())
        self.last_exit = result.to_dict()
        self.journal.keep(paths.OUTPUT_LOG, self.rd.log_line, "attempt %d ended: %s" % (rec["n"], result.message))
        self.journal.emit("exit", **result.to_dict())
        if self.cfg.reap_orphans or hung is not None:
            self._stop_leftovers(rec)
        if hung is not None and self.child is not None and self.exit_status is None:
            self.proc.poll(self.child)  # reap the stopped child (the stop's own reaping may have been first)
        shim.release(self.child)
        self.child = None
        self.exit_status = None
        return result

    def _root(self) -> Optional[ProcRef]:
        child = self.child
        return ProcRef(child.pid, child.start_time) if child is not None and child.start_time is not None else None

    def processes(self) -> List[ProcRef]:
        """Every live process of the attempt under way, each by pid and start time: its child, its session's
        members, its tracked tree and whatever carries its marker (leftovers.py). Reads every process's
        environment once: for rare calls (a hang's evidence)."""
        root = self._root()
        if root is None:
            return []
        marker = self.attempts[-1].get("marker") if self.attempts else None
        tree = self.tree if self.tree is not None else AttemptProcesses(self.proc, root, marker)
        found = [root, *tree.discover()]
        for pid in self.proc.session_members(self.child.sid) if self.child is not None else []:
            start = self.proc.start_time_of(pid)
            if start is not None and start >= root.start_time:
                found.append(ProcRef(pid, start))
        me = os.getpid()
        return sorted({r for r in found if r.pid != me and self.proc.start_time_of(r.pid) == r.start_time},
                      key=lambda r: r.pid)

    def record_session_limit(self, hint: str) -> None:
        """The run's deadline stopped it: its last exit (and the attempt's, when one ran) carries the hint that
        says how to continue (known once the final commit ran); with no child stopped (a backoff) it is made."""
        if (self.last_exit or {}).get("classification") != cls.SESSION_LIMIT:
            self.last_exit = cls.session_limit_exit(None, hint).to_dict()
            self.journal.emit("exit", **self.last_exit)
            return
        self.last_exit = dict(self.last_exit or {}, hint=hint)
        if self.attempts and (self.attempts[-1].get("exit") or {}).get("classification") == cls.SESSION_LIMIT:
            self.attempts[-1]["exit"] = dict(self.attempts[-1]["exit"], hint=hint)

    def record_fence(self, fence: Dict[str, Any]) -> None:
        """A fence while no child runs (a backoff, or before an attempt): the run's last exit says so."""
        self.last_exit = cls.fenced_exit(None, fence).to_dict()
        self.journal.emit("exit", **self.last_exit)

    def _stop_leftovers(self, attempt: Dict[str, Any]) -> None:
        """Stop what an attempt left running: its session, and what left the session (its tracked tree and the
        processes carrying its marker: leftovers.py). The current attempt's tracking is in memory; an earlier
        agent's attempt is known by its record."""
        tracked = self.tree if self.tree is not None else AttemptProcesses.of_attempt(self.proc, attempt)
        self.tree = None
        stop_attempt(self.proc, attempt, tracked, self.cfg.term_timeout, self.journal.log, self.journal.emit)
