"""The one stop procedure: how an attempt's child is stopped, whoever asked.

A preemption (a signal, a cloud notice, a peer node's notice), `onbox stop` and the end of a curriculum phase
(phases.py) all stop the child the same way: the checkpoint signal to its process group, a grace, SIGKILL at the
deadline (PyTorch elastic's TERM, then a monotonic deadline, then KILL). `ChildStop` is that timeline and nothing
else: it says which stage is due, the caller acts and says so in its own events (`signal_forwarded` and
`escalated` for a notice, `phase_end_escalated` for a phase end). A notice's stop also keeps time back for the
final commit (the reserve: the commit runs at deadline - reserve whatever the child is doing); a phase end commits
after the exit and keeps none back.

`NoticeIntake` turns what asks for a notice's stop into the run's one PreemptionNotice (preempt.py), its deadline
set by the grace: the first wins, a later one is recorded as ignored. `NoticeStop` acts that notice's timeline out
on the current attempt (the loop's STOPPING state); a phase end's acts are the curriculum's (phases.py).
"""
from __future__ import annotations

import enum
import os
import signal
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import fsutil
from onbox.clock import Clock
from onbox.config import check_range
from onbox.errors import UsageError
from onbox.supervisor.attempts import AttemptLauncher
from onbox.supervisor.preempt import STOP_SIGNAL, PreemptionNotice

DEFAULT_GRACE = 30.0  # seconds from notice (or phase end) to hard kill when neither --grace nor the profile says


def grace_for(configured: Optional[float], lead: Optional[float]) -> float:
    """The grace of a stop: --grace (or the profile's), else what the notice says it leaves (`lead`), else
    DEFAULT_GRACE; never more than `lead`, the time the notice says is really left."""
    grace = configured if configured is not None else (lead if lead is not None else DEFAULT_GRACE)
    return min(grace, lead) if lead is not None else grace


class StopStage(str, enum.Enum):
    """How far one stop of a child has gone. Transitions (each stage is entered at most once):

    ASKED    -> RESERVE (the reserve mark, deadline - reserve, passed: the final commit runs now, and TERM follows
                when the checkpoint signal was another; a stop without a reserve, a phase end, never enters it)
                | KILLED (the deadline passed first) | EXITED
    RESERVE  -> KILLED (the deadline passed: SIGKILL to the process group) | EXITED
    KILLED   -> EXITED
    EXITED   is the end: the child's exit was seen (or there was no child: a stop during a backoff). The final
             commit runs then, unless it already ran at the reserve mark and the deadline has passed: time still
             left goes to committing what the trainer saved after the mark.
    """

    ASKED = "asked"
    RESERVE = "reserve"
    KILLED = "killed"
    EXITED = "exited"


STOP_TRANSITIONS: Dict[StopStage, Tuple[StopStage, ...]] = {
    StopStage.ASKED: (StopStage.RESERVE, StopStage.KILLED, StopStage.EXITED),
    StopStage.RESERVE: (StopStage.KILLED, StopStage.EXITED),
    StopStage.KILLED: (StopStage.EXITED,),
    StopStage.EXITED: (),
}


class ChildStop:
    """One stop's timeline, pure: the child was asked at `since` and must be gone by `deadline` (monotonic
    seconds). `reserve`: seconds kept back for the final commit (sync_reserve), None for none."""

    def __init__(self, since: float, deadline: float, reserve: Optional[float] = None) -> None:
        self.since = since
        self.deadline = deadline
        self.reserve = reserve
        self.stages: List[StopStage] = [StopStage.ASKED]  # every stage entered, in order

    @property
    def stage(self) -> StopStage:
        return self.stages[-1]

    @property
    def reserve_mark(self) -> Optional[float]:
        """When the final commit starts: deadline - reserve, but the reserve is never more than half the grace, so
        a short grace (Slurm KillWait 5 s, RunPod ~5 s) still gives the trainer time to save before the commit."""
        if self.reserve is None:
            return None
        return self.deadline - min(self.reserve, max(0.0, (self.deadline - self.since) / 2.0))

    def due(self, now: float) -> Optional[StopStage]:
        """The stage the stop enters now, if one is due (the deadline before the reserve mark); else None."""
        if self.stage in (StopStage.ASKED, StopStage.RESERVE) and now >= self.deadline:
            return self._enter(StopStage.KILLED)
        mark = self.reserve_mark
        if self.stage == StopStage.ASKED and mark is not None and now >= mark:
            return self._enter(StopStage.RESERVE)
        return None

    def exited(self, now: float) -> bool:
        """The child's exit was seen: True when the final commit runs now (see StopStage.EXITED)."""
        committed = StopStage.RESERVE in self.stages
        self._enter(StopStage.EXITED)
        return not committed or now < self.deadline

    def _enter(self, stage: StopStage) -> StopStage:
        if stage not in STOP_TRANSITIONS[self.stage]:
            allowed = ", ".join(s.value for s in STOP_TRANSITIONS[self.stage]) or "none (the stop is over)"
            raise RuntimeError("illegal stop stage %s -> %s; allowed from %s: %s"
                               % (self.stage.value, stage.value, self.stage.value, allowed))
        self.stages.append(stage)
        return stage


class NoticeIntake:
    """The run's one PreemptionNotice, from whatever asks first: a preemption signal (TERM, INT, the run's
    preempt_signal; under Slurm TERM's lead is KillWait), a notice from the metadata poller or a peer node, or
    `onbox stop` (its stop.request file; STOP_SIGNAL or `ask()` when the disk refused that file).
    `tell_peers(source, detail, lead)`: a multi-node group stops together."""

    def __init__(self, grace: Optional[float], preempt_signal: int, sigterm_lead: Optional[float], stop_request: str,
                 clock: Clock, emit: Callable[..., None], log: Callable[[str], None],
                 tell_peers: Callable[[str, str, float], Any]) -> None:
        self.grace = grace  # --grace or the profile's; None: the notice's own lead, or DEFAULT_GRACE
        self.preempt_signal = preempt_signal
        self.sigterm_lead = sigterm_lead
        self.stop_request = stop_request
        self.clock = clock
        self.emit = emit
        self.log = log
        self.tell_peers = tell_peers
        self.notice: Optional[PreemptionNotice] = None
        self.by_request = False  # the notice is `onbox stop`'s: the run ends STOPPED, not PREEMPTED
        self._asked: Optional[Dict[str, Any]] = None  # a stop asked without stop.request (ask)

    def on_signal(self, signum: int, now_m: float, now_w: float) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT, self.preempt_signal):
            lead = self.sigterm_lead if signum == signal.SIGTERM else None
            self._take(PreemptionNotice("signal:%s" % signal.Signals(signum).name,
                                        now_m + grace_for(self.grace, lead), now_w))
        elif signum == STOP_SIGNAL:  # `onbox stop` when it could not write stop.request (a full disk)
            self.log("stop asked by signal")
            self.ask()
        elif signum != signal.SIGCHLD:
            self.log("ignoring %s" % signal.Signals(signum).name)

    def on_notice(self, lead: Optional[float], source: str, detail: str, now_m: float, now_w: float) -> None:
        """A notice from the metadata poller or a peer node, `lead` seconds before the kill (None: unknown)."""
        self._take(PreemptionNotice(source, now_m + grace_for(self.grace, lead), now_w, detail))

    def ask(self, grace: Optional[float] = None) -> None:
        """A stop asked without a stop.request file (the disk refused to write it): acted on like one."""
        self._asked = {"grace": grace}

    def check_request(self, now_m: float, now_w: float) -> None:
        """`onbox stop`'s request, when one is there and no notice came first."""
        if self.notice is not None or (self._asked is None and not os.path.exists(self.stop_request)):
            return
        req: Any = self._asked or {}
        if os.path.exists(self.stop_request):
            try:
                req = fsutil.read_json(self.stop_request)
            except (OSError, ValueError):
                req = {}
        grace = req.get("grace") if isinstance(req, dict) else None
        try:
            check_range("grace", grace)  # `onbox stop` checks it; a hand-written request may not be sane
        except UsageError as e:
            self.emit("stop_grace_ignored", grace=repr(grace), reason=e.message)
            grace = None
        self.by_request = True
        seconds = float(grace) if grace is not None else grace_for(self.grace, None)
        self._take(PreemptionNotice("stop", now_m + seconds, now_w, "onbox stop"))

    def _take(self, notice: PreemptionNotice) -> None:
        if self.notice is not None:
            self.emit("notice_ignored", source=notice.source, reason="a stop is already under way")
            return
        self.notice = notice
        self.log("preemption notice from %s %s" % (notice.source, notice.detail))
        self.emit("preemption_notice", source=notice.source, detail=notice.detail,
                  grace=round(notice.deadline - self.clock.monotonic(), 3))
        # a multi-node group stops together: the other nodes' agents get the notice and its deadline
        self.tell_peers(notice.source, notice.detail, max(0.0, notice.deadline - self.clock.monotonic()))


class NoticeStop:
    """A notice's stop of the run, acted out on the current attempt: the checkpoint signal at once
    (`signal_forwarded`); at the reserve mark the final commit, then TERM when the checkpoint signal was another
    (`escalated`); KILL at the deadline (`escalated`). Once the child is gone (or when there was none: a stop
    during a backoff) its exit is recorded (preempted, or stopped for `onbox stop`) and the final commit runs
    again while time is left. `commit(deadline)`: the final commit."""

    def __init__(self, notice: PreemptionNotice, by_request: bool, since: float, reserve: float,
                 checkpoint_signal: signal.Signals, launcher: AttemptLauncher, commit: Callable[[float], None]) -> None:
        self.notice = notice
        self.by_request = by_request
        self.timeline = ChildStop(since, notice.deadline, reserve)
        self.checkpoint_signal = checkpoint_signal
        self.launcher = launcher
        self.commit = commit
        self.emit = launcher.journal.emit

    def begin(self) -> None:
        if self.launcher.running:
            pgid = self.launcher.signal(self.checkpoint_signal)
            self.emit("signal_forwarded", signal=self.checkpoint_signal.name, pgid=pgid)

    def step(self, now: float) -> bool:
        """Act on what is due now; True once the child is gone and the stop is over."""
        if not self.launcher.running:
            if self.launcher.child is not None:
                self.launcher.finish(preempted=not self.by_request, stopped=self.by_request)
            # When the reserve forced an early commit, the trainer may have saved since: commit again while time
            # is left (the hook skips what is already committed).
            if self.timeline.exited(now):
                self.commit(self.timeline.deadline)
            return True
        stage = self.timeline.due(now)  # each stage once: the loop comes back here every few ms until the exit
        if stage == StopStage.KILLED:
            assert self.launcher.child is not None
            self.launcher.journal.log("deadline reached: KILL to process group %d" % self.launcher.child.pgid)
            self.launcher.signal(signal.SIGKILL)
            self.emit("escalated", signal="SIGKILL")
        elif stage == StopStage.RESERVE:
            self.commit(self.timeline.deadline)  # keep the reserve for the commit, whatever the child is doing
            if self.checkpoint_signal != signal.SIGTERM:
                self.launcher.signal(signal.SIGTERM)
                self.emit("escalated", signal="SIGTERM")
        return False
