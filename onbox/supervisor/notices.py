"""A notice's stop, from what asks for it to the child gone.

`NoticeIntake` turns what asks the run to stop (a preemption signal, a cloud or peer notice, `onbox stop`, a fence:
a newer lease on durable storage, the run's deadline: a `session_limit` once `now >= ask_at`, deadline.py) into the
run's one PreemptionNotice (preempt.py), its deadline set by the grace (stop.py): the first wins, a later one is recorded as ignored (a fence is remembered all the same: the run then
ends FENCED, whatever stop was under way). `NoticeStop` acts that notice's timeline (stop.ChildStop) out on the current attempt
while the loop is in STOPPING.
"""
from __future__ import annotations

import os
import signal
from typing import Any, Callable, Dict, Optional, Tuple

from onbox import fsutil, paths
from onbox.clock import Clock
from onbox.config import RunConfig, check_range, parse_signal
from onbox.errors import UsageError
from onbox.supervisor.attempts import AttemptLauncher
from onbox.supervisor.deadline import SESSION_LIMIT, SessionDeadline
from onbox.supervisor.notes import thread_death
from onbox.supervisor.preempt import STOP_SIGNAL, MetadataPoller, PreemptionNotice
from onbox.supervisor.rundir import RunDir
from onbox.supervisor.stop import ChildStop, StopStage, grace_for


class NoticeIntake:
    """The run's one PreemptionNotice, from whatever asks first: a preemption signal (TERM, INT, the run's
    preempt_signal; under Slurm TERM's lead is KillWait), a notice from the metadata poller or a peer node, or
    `onbox stop` (its stop.request file; STOP_SIGNAL or `ask()` when the disk refused that file), or a fence
    (`look_for_fence`: the checkpoint hook's answer). `tell_peers(source, detail, lead)`: a multi-node group stops
    together."""

    def __init__(self, cfg: RunConfig, rd: RunDir, sigterm_lead: Optional[float], clock: Clock,
                 emit: Callable[..., None], log: Callable[[str], None],
                 tell_peers: Callable[[str, str, float], Any]) -> None:
        self.cfg = cfg
        self.run = rd.name
        self.grace = cfg.grace  # --grace or the profile's; None: the notice's own lead, or DEFAULT_GRACE
        self.preempt_signal = parse_signal(cfg.preempt_signal, "preempt_signal")
        self.sigterm_lead = sigterm_lead
        self.stop_request = rd.stop_request
        self.clock = clock
        self.emit = emit
        self.log = log
        self.tell_peers = tell_peers
        self.notice: Optional[PreemptionNotice] = None
        self.by_request = False  # the notice is `onbox stop`'s: the run ends STOPPED, not PREEMPTED
        self.fence: Optional[Dict[str, Any]] = None  # a newer lease holds the run: it ends FENCED
        # the run's deadline (deadline.py): a session_limit notice once its ask_at has come
        self.deadline = SessionDeadline.of(cfg, grace_for(self.grace, None))
        self._asked: Optional[Dict[str, Any]] = None  # a stop asked without stop.request (ask)

    def poller(self, put: Callable[[Tuple[Optional[float], str, str]], None]) -> MetadataPoller:
        """The cloud metadata poller (a thread; `start()` it): its notices go to `put`, and should it die, that
        is said everywhere."""
        return MetadataPoller(self.cfg.notice_source, self.cfg.metadata_url, self.cfg.notice_interval,
                              lambda lead, src, detail: put((lead, src, detail)), log=self.log,
                              on_death=self._poller_died)

    def _poller_died(self, error: BaseException) -> None:
        """The metadata poller's thread ended on an error: cloud preemption notices are off. Say so everywhere."""
        self.log("the metadata poller died: %r; cloud preemption notices are OFF" % (error,))
        self.emit("thread_died", **thread_death(
            "onbox-metadata", "cloud preemption notices (%s metadata)" % self.cfg.notice_source, error, self.run,
            os.getpid(), hint="signals (TERM, %s) still work; check --metadata-url and the metadata service"
            % self.cfg.preempt_signal))

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

    def fence_grace(self) -> float:
        """A fence's stop: the grace, at most half a sync interval."""
        return grace_for(self.grace, max(0.0, self.cfg.sync_interval / 2.0))

    def on_fence(self, fence: Dict[str, Any], now_m: float, now_w: float) -> None:
        """A newer lease holds the run (`fence`: the fenced event's fields): its trainer works for nothing, so it
        stops within half a sync interval (the fence was seen within the other half), and nothing is committed."""
        if self.fence is not None:
            return
        self.fence = fence
        self._take(PreemptionNotice("fenced", now_m + self.fence_grace(), now_w,
                                    "lease epoch %s of %s holds the run" % (fence.get("newer_epoch"),
                                                                            fence.get("newer_holder"))))

    def look_for_fence(self, fenced: Optional[Callable[[], Any]], now_m: float, now_w: float,
                       stop: Optional["NoticeStop"]) -> bool:
        """Ask `fenced` (the checkpoint hook's answer, cheap: its lease thread and every write look at durable
        storage; None: a hook that never fences) until it names a newer lease; then the run stops as for a notice
        (on_fence), and a stop already under way (a preemption) ends fenced, sooner. True when the fence is new."""
        fence = fenced() if self.fence is None and fenced is not None else None
        if not fence:
            return False
        self.log("fenced: lease epoch %s of %s holds the run" % (fence.get("newer_epoch"), fence.get("newer_holder")))
        self.on_fence(dict(fence), now_m, now_w)
        if stop is not None and self.fence is not None:
            stop.fenced(self.fence, now_m + self.fence_grace())
        return True

    @property
    def session_limit(self) -> bool:
        """The notice is the run's deadline's: the run ends PREEMPTED, its exit classified session_limit."""
        return self.notice is not None and self.notice.source == SESSION_LIMIT

    def check_deadline(self, estimate: Any, now_m: float, now_w: float) -> bool:
        """Move ask_at to the commit `estimate` now (the checkpoint hook's commit_estimate(): {"seconds": s, ...};
        None or no number: nothing to commit, 0 s) and, once it has come and no notice came first, take the
        session_limit notice: KILL at the deadline less the margin and the commit, the final commit until the
        deadline less the margin. True when the notice is new."""
        d = self.deadline
        if d is None or self.notice is not None:
            return False
        seconds = estimate.get("seconds") if isinstance(estimate, dict) else None
        d.update(seconds if isinstance(seconds, (int, float)) else None)
        if not d.due(now_w):
            return False
        d.asked_at = now_w
        left = d.at - now_w
        self.log("deadline %s (%s) in %.0f s: asking for the checkpoint (grace %.0f s, commit ~%.1f s, margin %.0f s)"
                 % (_iso(d.at), d.source, left, d.grace, d.estimate, d.margin))
        self._take(PreemptionNotice(SESSION_LIMIT, now_m + max(0.0, d.kill_at - now_w), now_w,
                                    "deadline %s (%s) in %.0f s" % (_iso(d.at), d.source, left),
                                    commit_by=now_m + max(0.0, d.commit_by - now_w)))
        return True

    def deadline_doc(self, now_w: float) -> Optional[Dict[str, Any]]:
        """state.json's `deadline` block, None without one."""
        return self.deadline.to_dict(now_w) if self.deadline is not None else None

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


def _iso(wall: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


class NoticeStop:
    """A notice's stop of the run, acted out on the current attempt: the checkpoint signal at once
    (`signal_forwarded`); at the reserve mark the final commit, then TERM when the checkpoint signal was another
    (`escalated`); KILL at the deadline (`escalated`). Once the child is gone (or when there was none: a stop
    during a backoff) its exit is recorded (preempted, or stopped for `onbox stop`, whose stop.request then goes)
    and the final commit runs again while time is left. `commit(deadline)`: the final commit. `fence`: set once a
    newer lease holds the run (the loop sets it, also during another stop): the exit is recorded as fenced and
    nothing is committed. A session limit's notice (`commit_by` set) gives the final commit until then, after the
    KILL: its time was kept for it (deadline.py), and the exit is classified session_limit."""

    def __init__(self, notice: PreemptionNotice, by_request: bool, since: float, reserve: Optional[float],
                 checkpoint_signal: signal.Signals, launcher: AttemptLauncher, commit: Callable[[float], None]) -> None:
        self.by_request = by_request
        self.timeline = ChildStop(since, notice.deadline, reserve)
        self.checkpoint_signal = checkpoint_signal
        self.launcher = launcher
        self.commit = commit
        self.emit = launcher.journal.emit
        self.fence: Optional[Dict[str, Any]] = None
        self.session_limit = notice.source == SESSION_LIMIT
        self.commit_by = notice.commit_by  # the final commit's deadline when later than the KILL's (a session limit)

    @classmethod
    def of(cls, intake: NoticeIntake, now: float, reserve: float, checkpoint_signal: signal.Signals,
           launcher: AttemptLauncher, commit: Callable[[float], None]) -> "NoticeStop":
        """The stop of the intake's notice, begun at `now` (monotonic). A fence's stop keeps no reserve: nothing is
        committed after a fence."""
        assert intake.notice is not None
        stop = cls(intake.notice, intake.by_request, now, None if intake.fence is not None else reserve,
                   checkpoint_signal, launcher, commit)
        stop.fence = intake.fence
        stop.begin()
        return stop

    def _commit_deadline(self) -> float:
        if self.commit_by is None or self.fence is not None:
            return self.timeline.deadline
        return max(self.timeline.deadline, self.commit_by)

    def fenced(self, fence: Dict[str, Any], deadline: float) -> None:
        """A fence arrived while this stop was under way: it ends fenced, and no later than `deadline` (the
        trainer's checkpoint is of no use now)."""
        self.fence = fence
        self.timeline.deadline = min(self.timeline.deadline, deadline)

    def begin(self) -> None:
        if self.launcher.running:
            pgid = self.launcher.signal(self.checkpoint_signal)
            self.emit("signal_forwarded", signal=self.checkpoint_signal.name, pgid=pgid)

    def step(self, now: float) -> bool:
        """Act on what is due now; True once the child is gone and the stop is over."""
        if not self.launcher.running:
            if self.launcher.child is not None:
                self.launcher.finish(preempted=not self.by_request, stopped=self.by_request, fenced=self.fence,
                                     session_limit=self.session_limit)
            # When the reserve forced an early commit, the trainer may have saved since: commit again while time
            # is left (the hook skips what is already committed). A session limit kept the commit's time.
            if (self.timeline.exited(now) or now < self._commit_deadline()) and self.fence is None:
                self.commit(self._commit_deadline())
            if self.by_request:  # `onbox stop` is answered: its request goes
                try:
                    self.launcher.journal.keep(paths.STOP_REQUEST, os.unlink, self.launcher.rd.stop_request)
                except FileNotFoundError:
                    pass
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
