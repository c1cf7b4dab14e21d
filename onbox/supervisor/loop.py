"""The run lifecycle: one RunState enum and one loop, observe -> decide -> act (the shape of
PyTorch's elastic agent's `_invoke_run`).

Each step observes (signals, notices, stop.request, a fence, the run's deadline, the child's output and exit, the
trainer's progress) and acts on the state: start an attempt (attempts.py), decide what follows its exit (phases.py,
then restarts.py), begin or step a notice's stop (notices.py), end the run (`_end`: the final commit, then the
transition; what each end records and says: endings.py). A fence (the checkpoint hook's `fenced()`: a newer lease
holds the run on durable storage) is a stop like a notice's and ends FENCED. The run's deadline (deadline.py) is a
notice too, taken once its ask_at has come (the checkpoint hook's `commit_estimate()` moves it); it ends PREEMPTED
with the exit classified session_limit and how to continue. The trainer's progress is parsed once, into the
ProgressFeed (onbox/telemetry/progress.py) that the hooks read through RunContext; the output route (output.py)
takes each line and record to the telemetry hook and the curriculum. Events, state and progress writes go through
the journal (journal.py); shutdown happens in `finally`.

Signal handlers only record the signal number; the loop blocks in select() on the signal wakeup fd and the
metadata poller's pipe, so a signal is acted on within milliseconds while an idle loop costs almost nothing.

Past 400 lines on purpose: the loop and its acts are one state machine, read top to bottom like the elastic agent's
`_invoke_run`; every decision it acts on lives in its own module (restarts, stop, notices, deadline, endings,
attempts, phases, journal, output). The Supervisor class is under 300 lines of code (the rest is its docstrings).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
from typing import Any, Callable, Dict, List, Optional

from onbox import paths
from onbox.clock import Clock, SystemClock
from onbox.config import RunConfig, parse_signal
from onbox.proc import Child, ProcessSeam, set_child_subreaper, start_time
from onbox.slurm import job as slurm
from onbox.supervisor import exits as cls
from onbox.supervisor.attempts import AttemptLauncher
from onbox.supervisor.endings import Ending, RunEndings
from onbox.supervisor.hang import HangWatch
from onbox.supervisor.hooks import PEER_RESTART, Hooks, RunContext, no_hooks
from onbox.supervisor.journal import RunJournal
from onbox.supervisor.notices import NoticeIntake, NoticeStop
from onbox.supervisor.output import OutputRoute
from onbox.supervisor.phases import Verdict, curriculum_for
from onbox.supervisor.preempt import STOP_SIGNAL, NoticePipe, PreemptionNotice, SignalInbox
from onbox.supervisor.restarts import RestartPolicy
from onbox.supervisor.rundir import RunDir
from onbox.supervisor.shim import KeptProcessSeam
from onbox.supervisor.state import (
    TRANSITIONS,
    IllegalTransition,
    RunState,
    check_transition,
    exit_code_for,
    wait_for,
)
from onbox.telemetry.progress import ProgressFeed

__all__ = ["TRANSITIONS", "IllegalTransition", "RunState", "Seams", "Supervisor", "check_transition",
           "exit_code_for"]


@dataclasses.dataclass
class Seams:
    """What the supervisor touches of the box besides the process seam and the clock; tests replace any part."""

    environ: Optional[Dict[str, str]] = None  # the agent's environment; None: os.environ (copied)
    oom_reader: Callable[[], Optional[int]] = cls.oom_kill_count  # the host's oom_kill counter (exits.py)
    log: Optional[Callable[[str], None]] = None  # agent.log lines; None: stderr
    # how the loop blocks between steps; None: select() on the signal fd and the notice pipe. Tests with a
    # FakeClock pass clock.sleep to move time instead.
    waiter: Optional[Callable[[float], None]] = None
    requeue: Optional[Callable[[str], bool]] = None  # Slurm only; None: `scontrol requeue` (onbox/slurm/job.py)
    slurm_runner: Optional[Callable[..., Any]] = None  # Slurm only: runs scontrol; None: subprocess.run
    stacks: Optional[Callable[[List[Any]], List[Any]]] = None  # a hung attempt's stacks; None: stacks.capture


def stderr_log(message: str) -> None:
    """A line of agent.log (the detached agent's stderr)."""
    try:
        sys.stderr.write("onbox[%d]: %s\n" % (os.getpid(), message))
        sys.stderr.flush()
    except OSError:  # agent.log on a full disk: the line is lost (or comes out later), never the agent
        pass


class Supervisor:
    """Supervises one run: attempts, restarts, preemption, stop. `run()` returns the terminal RunState."""

    def __init__(self, cfg: RunConfig, rundir: RunDir, proc: Optional[ProcessSeam] = None,
                 clock: Optional[Clock] = None, hooks_factory: Callable[[RunContext], Hooks] = no_hooks,
                 seams: Optional[Seams] = None) -> None:
        self.cfg = cfg
        self.rd = rundir
        self.seams = seams = seams or Seams()
        # every attempt's child under its keeper, whose record of the child's exit outlives this agent (shim.py)
        self.proc = proc or KeptProcessSeam(rundir.file(paths.CHILD_EXIT_FILE))
        self.clock = clock or SystemClock()
        self.waiter = seams.waiter or self._select_wait
        self.environ = dict(os.environ if seams.environ is None else seams.environ)
        self._log: Callable[[str], None] = seams.log or stderr_log
        self.ckpt_dir = os.path.abspath(paths.ckpt_dir(cfg.ckpt_dir, rundir.path))
        prev = rundir.read_state() or {}  # an earlier agent's: its attempts, restarts and phase carry on
        self.state = RunState.STARTING
        self.message = ""
        self.restarts = int(prev.get("restarts") or 0)
        self.started_at = prev.get("started_at") or self.clock.time()
        self.backoff_until = 0.0
        self.next_tick = 0.0
        self._chld = False  # a SIGCHLD came: reap the orphans that ended
        self._agent_start = start_time(os.getpid())
        self.on_ready: Optional[Callable[["Supervisor"], None]] = None  # once RUNNING or terminal (detach.py)
        # the parts, each its own module: what the run says, its attempts, its phases, what follows an exit
        self.journal = RunJournal(rundir, self.clock, self._log, self.state_doc, lambda: self.launcher.number)
        self.emit, self._hook = self.journal.emit, self.journal.hook  # every event and hook call goes through it
        # the trainer's progress, parsed once (the only MetricsParser and metrics file reader of the run), going on
        # from what an earlier agent recorded; its output and records routed to the hooks and the curriculum
        self.progress = ProgressFeed(rundir.metrics_file, cfg.metrics_regex, self.clock,
                                     saved=rundir.side_doc(paths.PROGRESS_FILE))
        # the trainer's cadence and what a hang does (hang.py); it hears the output and the records first-hand
        self.hang = HangWatch(cfg, rundir, self.ckpt_dir, self.clock, self.emit, self._log, self.proc, self.progress,
                              self.environ, lambda: self.launcher.number, seams.stacks)
        self.output = OutputRoute(self.progress, self._hook, lambda: self.hooks.telemetry, lambda: self.phases,
                                  lambda: self.launcher.child is not None, self.hang)
        self.launcher = AttemptLauncher(cfg, rundir, self.proc, self.journal, self.environ, self.ckpt_dir,
                                        seams.oom_reader, prev, self.output.on_line)
        self.phases = curriculum_for(cfg, prev.get("phase"), self.clock, self.emit)
        self.policy = RestartPolicy(cfg)
        self.hooks: Hooks = hooks_factory(RunContext(
            name=rundir.name, run_dir=rundir.path, ckpt_dir=self.ckpt_dir, config=cfg, clock=self.clock,
            emit=self.emit, attempt=lambda: self.launcher.number, write_failed=self.journal.write_failed,
            progress=self.progress, summary_due=self.journal.notes.summary_due, environ=self.environ))
        self.journal.telemetry = self.hooks.telemetry
        # what asks the run to stop, and the stop under way in STOPPING (notices.py)
        # Under Slurm a SIGTERM (time limit, scancel) is followed by SIGKILL after KillWait: its real grace.
        sigterm_lead = slurm.sigterm_grace(self.environ, runner=seams.slurm_runner)
        self.intake = NoticeIntake(cfg, rundir, sigterm_lead, self.clock, self.emit, self._log, lambda *notice:
                                   self._hook("nodes.on_notice", self.hooks.nodes.on_notice, *notice))
        self.checkpoint_signal = parse_signal(cfg.checkpoint_signal, "checkpoint_signal")
        self.stop: Optional[NoticeStop] = None
        # the final commit, and what each end records and says (endings.py)
        self.endings = RunEndings(rundir.name, self.intake, self.launcher, self._hook, lambda: self.hooks.checkpoints,
                                  self.emit)
        self.notices = NoticePipe()  # cloud and peer notices, from their threads
        # every signal the agent must see, PID 1 included (a PID 1 ignores default-action signals it has no
        # handler for): the preemption ones, both USR signals, HUP (an SSH drop in --foreground), CHLD (reaping)
        self.inbox = SignalInbox({signal.SIGTERM, signal.SIGINT, self.intake.preempt_signal, signal.SIGUSR1,
                                  signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD, STOP_SIGNAL})

    # ---- records -------------------------------------------------------------------------------------------
    @property
    def attempts(self) -> List[Dict[str, Any]]:
        """state.json's `attempts` (the launcher's records)."""
        return self.launcher.attempts

    @property
    def notice(self) -> Optional[PreemptionNotice]:
        return self.intake.notice

    @property
    def fence(self) -> Optional[Dict[str, Any]]:
        """The fenced event's fields once a newer lease holds the run (the intake's)."""
        return self.intake.fence

    @property
    def child(self) -> Optional[Child]:
        return self.launcher.child

    @property
    def last_exit(self) -> Optional[Dict[str, Any]]:
        return self.launcher.last_exit

    def state_doc(self) -> Dict[str, Any]:
        cur = self.attempts[-1] if self.attempts else {}
        now_m, now_w = self.clock.monotonic(), self.clock.time()
        return {
            "run": self.rd.name, "state": self.state.value, "attempt": self.launcher.number,
            "child_pid": self.child.pid if self.child else None,
            "child_start_time": self.child.start_time if self.child else None,
            "agent_pid": os.getpid(), "agent_start_time": self._agent_start,
            "started_at": self.started_at, "updated_at": now_w,
            "restarts": self.restarts, "attempts": self.attempts, "last_exit": self.last_exit,
            "preemption": self.notice.to_dict(now_m, now_w) if self.notice else None,
            "ckpt_dir": self.ckpt_dir, "run_dir": self.rd.path, "resume_from": self.launcher.resume_from,
            "message": self.message, "log": self.rd.log_path, "current_sid": cur.get("sid") if self.child else None,
            "backoff_until": now_w + (self.backoff_until - now_m) if self.state == RunState.BACKOFF else None,
            "degraded": self.journal.records.snapshot(),  # None, or why the run dir refuses writes (records.py)
            "fenced": self.fence,
            "deadline": self.intake.deadline_doc(now_w),  # None without one (deadline.py)
            **self.journal.notes.to_state(),
            **self.phases.state_fields(),
        }

    def transition(self, new: RunState, **fields: Any) -> None:
        check_transition(self.state, new)
        old, self.state = self.state, new
        self._log("%s -> %s%s" % (old.value, new.value, (" (%s)" % fields["reason"]) if "reason" in fields else ""))
        self.journal.save()
        self.emit("state", old=old.value, new=new.value, **fields)
        if new == RunState.RUNNING or new.terminal:
            self._ready()

    def _ready(self) -> None:
        """Tell on_ready (the detaching parent: detach.py) once."""
        if self.on_ready is not None:
            ready, self.on_ready = self.on_ready, None
            ready(self)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.inbox.record(signum, frame)  # what the real handler does (tests call it to inject a signal)

    # ---- the loop ------------------------------------------------------------------------------------------
    def run(self, adopt: Optional[Child] = None) -> RunState:
        """Supervise until a terminal state. `adopt`: a live child of an earlier (dead) agent."""
        self.inbox.install()
        was_subreaper = set_child_subreaper()  # orphans of the job reparent to us: we reap them, see them go
        poller = self.intake.poller(self.notices.put)
        try:
            os.makedirs(self.ckpt_dir, exist_ok=True)
            if adopt is None:
                self.restarts = 0  # a fresh supervision (a relaunch) gets the full restart budget again
            else:
                self._adopt(adopt)
            poller.start()
            self._hook("nodes.start", self.hooks.nodes.start, self.notices.put)  # peers' notices: like the poller's
            while not self.state.terminal:
                self._step()
                if not self.state.terminal and not self.inbox.pending:
                    self.waiter(wait_for(self.state, self.clock.monotonic(), self.next_tick, self.backoff_until))
            return self.state
        finally:
            poller.stop()
            self._shutdown()
            self._hook("nodes.close", self.hooks.nodes.close)
            self.inbox.restore()
            self.notices.close()
            if was_subreaper is False:  # leave an embedding process (a test runner) as it was
                set_child_subreaper(False)

    def _adopt(self, child: Child) -> None:
        """An earlier (dead) agent's child becomes this agent's attempt: alive, or ended while no agent watched it
        with its exit kept by its keeper (shim.py), which is then recorded at once (before any stop asked meanwhile):
        a finished run ends done, a failure goes to the restart policy; nothing is started again on a guess."""
        ended = self.launcher.adopt(child)
        self.state = RunState.RUNNING
        self.message = "adopted the %s child %d after an agent restart" % ("ended" if ended else "live", child.pid)
        self.journal.save()
        self.emit("adopted", pid=child.pid, start_time=child.start_time, ended=ended,
                  keeper=getattr(getattr(child, "keeper", None), "pid", None))
        self._ready()
        if ended:
            self._after_exit()

    def _step(self) -> None:
        """observe -> decide -> act, once."""
        self._observe()
        now = self.clock.monotonic()
        if self.state == RunState.STARTING:
            self._start_attempt()
        elif self.state in (RunState.RUNNING, RunState.BACKOFF) and self.notice is not None:
            self._begin_stopping()
        elif self.state == RunState.RUNNING and self.launcher.exit_status is not None:
            self._after_exit()
        elif self.state == RunState.RUNNING:
            self._phase_tick(now)
            self._watch_hang(now)
        elif self.state == RunState.BACKOFF and now >= self.backoff_until:
            self.transition(RunState.STARTING, reason="backoff over")
        if self.state == RunState.STOPPING and self.stop is not None and self.stop.step(now):
            self._end_stopping()
        if now >= self.next_tick and not self.state.terminal:
            self.next_tick = now + self.cfg.tick_interval
            self._tick()

    def _select_wait(self, timeout: float) -> None:
        self.inbox.wait(timeout, [self.notices.read_fd, *self.launcher.wake_fds()])

    def _idle(self, timeout: float) -> None:
        """The wait for a disk to take the final state: nothing acts on a late notice now, but a notice left in
        the pipe must not keep the wait from blocking."""
        self.notices.drain()
        self.waiter(timeout)

    def _observe(self) -> None:
        now_m, now_w = self.clock.monotonic(), self.clock.time()
        signals = self.inbox.take()
        self._chld = self._chld or signal.SIGCHLD in signals
        for s in signals:
            self.intake.on_signal(s, now_m, now_w)
        for lead, src, detail in self.notices.drain():
            if src.startswith(PEER_RESTART):  # the attempt under way, if one runs, is stopped at the next check
                self.hang.peer_word(src[len(PEER_RESTART):], detail, self.launcher, self.state.value)
            else:
                self.intake.on_notice(lead, src, detail, now_m, now_w)
        self.intake.check_request(now_m, now_w)
        self._check_deadline(now_m, now_w)
        self._look_for_fence(now_m, now_w)
        self.launcher.poll()  # the output: each line to the route
        self.output.read_metrics_file()
        if self._chld:  # scanning /proc costs: only after a SIGCHLD (orphans reparented to us that ended)
            self._chld = False
            self.proc.reap_zombies(keep=(self.child.pid,) if self.child else ())

    def _ask_checkpoints(self, name: str) -> Optional[Callable[[], Any]]:
        """The checkpoint hook's optional `name`, called through the journal; None for a hook without it (a test
        double): it never fences, its commit estimate is 0 s."""
        method = getattr(self.hooks.checkpoints, name, None)
        return (lambda: self._hook("checkpoints." + name, method)) if method is not None else None

    def _look_for_fence(self, now_m: float, now_w: float) -> None:
        """Once a newer lease holds the run, it stops and ends FENCED (the intake's look_for_fence)."""
        if self.intake.look_for_fence(self._ask_checkpoints("fenced"), now_m, now_w, self.stop):
            self.journal.save()

    def _check_deadline(self, now_m: float, now_w: float) -> None:
        """The run's deadline: ask_at moved to the commit estimate now (the checkpoint hook's, from the newest
        complete checkpoint's size and the measured throughput), and its notice once ask_at has come. state.json
        is rewritten when ask_at moves by a second or more (`onbox status` shows it)."""
        if self.intake.deadline is None or self.notice is not None:
            return
        ask = self._ask_checkpoints("commit_estimate")
        self.intake.check_deadline(ask() if ask is not None else None, now_m, now_w)
        if self.state in (RunState.RUNNING, RunState.BACKOFF) and self.intake.deadline.ask_at_moved():
            self.journal.save()

    def _tick(self) -> None:
        """The periodic housekeeping, step by step. A signal that lands meanwhile ends it early and the next tick is
        due at once: a preemption notice is acted on before the beat, the rotation or the summary are done."""
        for step in (self.launcher.watch,
                     lambda: self._hook("checkpoints.periodic", self.hooks.checkpoints.periodic),
                     lambda: self._hook("telemetry.tick", self.hooks.telemetry.tick, self.state_doc()),
                     lambda: self.journal.housekeep(self.progress, self.launcher.rotate_log)):
            if self.inbox.pending:
                self.next_tick = self.clock.monotonic()
                return
            step()

    # ---- acts ----------------------------------------------------------------------------------------------
    def _start_attempt(self) -> None:
        earlier = self.launcher.sessions()
        self.launcher.clear_last()
        self._hook("reaper.before_attempt", self.hooks.reaper.before_attempt, earlier)
        resume_from = self._hook("checkpoints.restore", self.hooks.checkpoints.restore) or None
        self._look_for_fence(self.clock.monotonic(), self.clock.time())
        if self.fence is not None:  # the restore found a newer lease: no attempt starts
            return self._end(RunState.FENCED, "fenced")
        command, resume_args, phase_env = self.phases.attempt(self.cfg.command, self.cfg.resume_args, resume_from)
        failure = self.launcher.start(command, resume_args, phase_env, resume_from)
        if failure is not None:
            return self._end(RunState.FAILED, failure.message)
        child = self.launcher.child
        assert child is not None
        self.transition(RunState.RUNNING, reason="attempt %d pid %d" % (self.launcher.number, child.pid),
                        pid=child.pid)

    def _after_exit(self, result: Optional[cls.Classification] = None) -> None:
        """`result`: an exit already recorded (a hung attempt the hang watch stopped), else the child's, now."""
        result = result or self.launcher.finish()
        verdict = self.phases.after_exit(result.failed)
        if verdict is not None:
            return self._phase_ended(verdict)
        # a hang says nothing against the checkpoint the attempt resumed from: it is not taken out of use
        fell_back = result.failed and result.classification != cls.HUNG and bool(self._hook(
            "checkpoints.after_failure", self.hooks.checkpoints.after_failure, self.launcher.seconds_run()))
        decision = self.policy.decide(result, self.restarts, fell_back)
        if decision.state == RunState.BACKOFF:
            return self._backoff(decision.delay, decision.reason)
        self._end(decision.state, decision.message, decision.reason, **decision.fields)

    def _phase_tick(self, now: float) -> None:
        """A phase's target reached: ask the child to stop as for a preemption (SIGKILL a grace later)."""
        sig = self.phases.signal_due(now)
        if sig is not None:
            pgid = self.launcher.signal(sig)
            self.emit("signal_forwarded", signal=sig.name, pgid=pgid, reason="phase end")
            self.journal.save()  # `ending` is on disk: an adopting agent keeps the deadline

    def _watch_hang(self, now: float) -> None:
        """A hung trainer (hang.py): its evidence first, then --on-hang: alert only; restart (the attempt stopped,
        its `hung` exit handed to the restart policy); stop (the run ends FAILED). A peer's group restart is a
        restart."""
        verdict = self.hang.check(now, self.launcher, ending=getattr(self.phases, "stop", None) is not None)
        result = self.hang.respond(verdict, self.launcher, self.hooks, self._hook) if verdict is not None else None
        if result is None:
            return
        if self.hang.action == "stop":
            self._end(RunState.FAILED, result.message, cls.HUNG, classification=cls.HUNG)
        else:
            self._after_exit(result)
        self.hang.acted(self.state.value, self.message, restarts=self.restarts, max_restarts=self.cfg.max_restarts,
                        restart_in_s=round(self.backoff_until - now, 3) if self.state == RunState.BACKOFF else None)

    def _phase_ended(self, verdict: Verdict) -> None:
        """The next phase starts at once from this one's final checkpoint, committed first; or the run ends."""
        self.policy.reset()
        if verdict.next_phase is None:
            return self._end(RunState.DONE if verdict.ok else RunState.FAILED, verdict.message)
        self.message = verdict.message
        self.journal.save()  # the new phase is recorded before the commit: a relaunch resumes in it
        self.endings.final(self.clock.monotonic() + self.cfg.final_sync_timeout, phase=verdict.ended)
        self.transition(RunState.STARTING, reason=verdict.message)

    def _backoff(self, delay: float, why: str) -> None:
        self.restarts += 1
        self.backoff_until = self.clock.monotonic() + delay
        self.message = "restarting in %.1f s after: %s" % (delay, why)
        self.transition(RunState.BACKOFF, reason=self.message, delay=delay)

    def _begin_stopping(self) -> None:
        self.journal.keep(paths.PREEMPT_FILE, lambda: open(self.rd.preempt_file, "a").close())  # for trainers that poll
        self.stop = NoticeStop.of(self.intake, self.clock.monotonic(), self.cfg.sync_reserve, self.checkpoint_signal,
                                  self.launcher, self.endings.final)
        self.transition(RunState.STOPPING, reason="notice from %s" % getattr(self.notice, "source", "?"))

    def _end_stopping(self) -> None:
        if self.fence is not None:
            return self._end_fenced()
        self._conclude(self.endings.after_stop())

    def _end(self, state: RunState, message: str, reason: Optional[str] = None, **fields: Any) -> None:
        """The run ends without a notice (DONE, or FAILED for good): the newest complete checkpoint must still
        become durable. The periodic commit runs on an interval in a background thread; without this final one,
        the checkpoint written just before the exit (or a commit still in flight) would never be committed."""
        self.message = message
        self.endings.final(self.clock.monotonic() + self.cfg.final_sync_timeout)
        self._look_for_fence(self.clock.monotonic(), self.clock.time())
        if self.fence is not None:  # the final commit found a newer lease: the run is another box's now
            return self._end_fenced(final_done=True)
        self._conclude(Ending(state, message, message if reason is None else reason, fields))

    def _end_fenced(self, final_done: bool = False) -> None:
        """FENCED. The commit in flight is waited for (bounded): it ends refused at its next lease check, or its
        manifest was written before (a race-window orphan the new holder quarantines); the hook commits nothing new."""
        if not final_done:
            self.endings.final(self.clock.monotonic() + self.cfg.final_sync_timeout)
        self._conclude(self.endings.fenced())

    def _conclude(self, ending: Ending) -> None:
        self.message = ending.message
        self.transition(ending.state, reason=ending.reason, **ending.fields)

    def _shutdown(self) -> None:
        """Always runs (finally): flush the output and the progress, final state, telemetry close."""
        try:
            self.launcher.read_output()
            self.output.read_metrics_file()
            self.journal.record_progress(self.progress, final=True)
            if not self.state.terminal:
                self.message = "agent exited in state %s; the child may still run: `onbox adopt %s`" % (
                    self.state.value, self.rd.name)
            else:  # under Slurm: requeue after the Slurm signal, or say why not (onbox/slurm/job.py)
                slurm.on_run_end(self.state.value, self.notice.source if self.notice else None,
                                 self.cfg.preempt_signal, self.cfg.requeue, self.environ, self._log, self.emit,
                                 runner=self.seams.slurm_runner, requeue_fn=self.seams.requeue)
                if self.state == RunState.PREEMPTED:
                    self.message = self.endings.preempted_message(self.message, self.journal.notes.requeue)
            self.journal.save()
        finally:
            self._hook("telemetry.close", self.hooks.telemetry.close, self.state_doc())
            self.journal.record_final_state(
                self.state.value, self.cfg.final_sync_timeout, self.cfg.tick_interval,
                lambda: bool({signal.SIGTERM, signal.SIGINT} & set(self.inbox.take())), self._idle)
