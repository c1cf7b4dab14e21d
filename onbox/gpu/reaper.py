"""The VRAM-zombie reaper (U11): decide, per GPU holder, whether it may be killed, and kill only what is safe.

Owners come from onbox/gpu/ownership.py (self / current / earlier / foreign). Orphans of our earlier attempts are
reaped automatically before a restart (ReaperHook). Everything else is only reported, unless `onbox reap --force`,
and then only when invisible to NVML or idle, older than the minimum age, ours (or root with --all-users), in our
PID namespace, and never the current attempt.

A kill is TERM, a bounded wait, then KILL (onbox.proc.escalate, the elastic agent's escalation), each signal
logged. A process is re-identified by (pid, start ticks) before every signal, so a recycled PID is never hit.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from onbox.clock import Clock, SystemClock
from onbox.fsutil import append_jsonl
from onbox.gpu.holders import Holder, ScanResult
from onbox.gpu.ownership import AttemptIndex, classify
from onbox.proc import ProcessSeam, ProcRef, Stopped, escalate

log = logging.getLogger("onbox.gpu.reaper")

# Daemons that legitimately keep the driver open; never reap them, whoever asks.
SYSTEM_HOLDERS = frozenset({"nvidia-persistenced", "nv-hostengine", "nvidia-fabricmanager", "nvidia-smi",
                            "nvidia-cuda-mps-server", "nvidia-cuda-mps-control", "dcgm-exporter", "Xorg", "Xwayland"})

@dataclasses.dataclass
class Decision:
    holder: Holder
    verdict: str  # "reap" or "keep"
    reason: str
    outcome: Optional[str] = None  # what happened when acted on

    def to_dict(self) -> Dict[str, Any]:
        d = self.holder.to_dict()
        d.update(verdict=self.verdict, reason=self.reason, outcome=self.outcome)
        return d


def _exe_name(h: Holder) -> str:
    first = h.command.split(" ", 1)[0]
    return os.path.basename(first.strip("[]"))


@dataclasses.dataclass
class Activity:
    """What NVML says about GPU use in the last sample window."""

    busy_pids: Set[int] = dataclasses.field(default_factory=set)  # per-process samples with SM use > 0
    sampled_gpus: Set[int] = dataclasses.field(default_factory=set)  # GPUs that returned per-process samples
    gpu_util: Dict[int, Optional[int]] = dataclasses.field(default_factory=dict)  # index -> util %, None unknown

    def idle_gpus(self, gpus: Iterable[int]) -> bool:
        return all(self.gpu_util.get(g) == 0 for g in gpus)


def decide(h: Holder, *, min_age_s: float, all_users: bool, is_root: bool, my_uid: int,
           activity: Optional[Activity] = None, nvml_available: bool = True) -> Decision:
    """The verdict for one classified holder under `onbox reap --force` rules."""
    if h.owner == "self":
        return Decision(h, "keep", "this onbox process or its parent")
    if h.owner == "current":
        return Decision(h, "keep", "current attempt %s of run %s: never reaped" % (h.attempt, h.run))
    if _exe_name(h) in SYSTEM_HOLDERS:
        return Decision(h, "keep", "system GPU service (%s)" % _exe_name(h))
    ours = h.container is not None and h.run is not None and h.owner == "earlier"  # our earlier attempt's container
    if h.other_pid_ns and not ours:
        where = "container %s" % h.container_short if h.container else "another container (PID namespace differs)"
        return Decision(h, "keep", "lives in %s: restart that container" % where)
    if h.uid != my_uid and not (is_root and all_users):
        need = "--all-users" if is_root else "root and --all-users"
        return Decision(h, "keep", "owned by %s: needs %s" % (h.user, need))
    if h.age_s < min_age_s:
        return Decision(h, "keep", "younger than the minimum age (%.0f s < %.0f s)" % (h.age_s, min_age_s))
    if h.owner == "earlier":
        what = "run %s attempt %s" % (h.run, h.attempt) if h.run else "an earlier attempt"
        where = "container %s" % h.container_short if ours else "session %d" % h.sid
        return Decision(h, "reap", "orphan of %s (%s)" % (what, where))
    if not h.gpus:
        return Decision(h, "keep", "holds no GPU (driver control files only)")
    if h.nvml_visible is False:
        return Decision(h, "reap", "invisible to NVML (U11 zombie holder)")
    if not nvml_available:
        return Decision(h, "reap", "NVML not available: cannot tell whether it is busy")
    act = activity or Activity()
    gpus = ",".join(map(str, h.gpus))
    if h.pid in act.busy_pids:
        return Decision(h, "keep", "busy: NVML saw it using the GPU in the last sample")
    if act.idle_gpus(h.gpus):
        return Decision(h, "reap", "idle: GPU %s ran no kernel in the last sample" % gpus)
    if h.nvml_visible and all(g in act.sampled_gpus for g in h.gpus):
        return Decision(h, "reap", "idle: no GPU activity of it in the last sample")
    # U21 aside, a busy GPU whose use NVML cannot attribute (no per-process samples, or PIDs from another
    # namespace) may be this holder's: never guess in favour of a kill.
    return Decision(h, "keep", "cannot tell whether it is busy: GPU %s is in use and NVML cannot attribute it" % gpus)


def decide_all(scan: ScanResult, **kw: Any) -> List[Decision]:
    return [decide(h, nvml_available=scan.nvml_available, **kw) for h in scan.holders]


def gpu_activity(seam: Any, now: float, window_s: float = 10.0) -> Activity:
    """Per-process SM use in the last `window_s` (nvmlDeviceGetProcessUtilization: NOT_FOUND means nobody ran, as
    does an old driver without the call, so the GPU's own utilisation is read beside it)."""
    from onbox.gpu.holders import nvml_handles
    from onbox.gpu.nvml import NA

    act = Activity()
    if seam is None or not seam.available():
        return act
    nv = seam.nvml
    since_us = int(max(0.0, now - window_s) * 1e6)
    for i, h in nvml_handles(seam):
        try:
            util = seam.call("nvmlDeviceGetUtilizationRates", h)
            samples = seam.call("nvmlDeviceGetProcessUtilization", h, since_us)
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown):
            continue
        act.gpu_util[i] = None if util is NA else int(util.gpu)
        if samples is not NA and samples:
            act.sampled_gpus.add(i)
            act.busy_pids.update(x.pid for x in samples if getattr(x, "smUtil", 0))
    return act


def survey(*, devices: str, seam: Any, runs_dir: str, min_age_s: float, all_users: bool, proc: str = "/proc",
           clock: Optional[Clock] = None) -> Tuple[ScanResult, List[Decision]]:
    """Scan, classify and decide: what `onbox reap` shows (and acts on with --force)."""
    from onbox.gpu.holders import HolderScan

    clock = clock or SystemClock()
    scan = HolderScan(devices, proc, seam).scan()
    classify(scan, AttemptIndex.load(runs_dir), proc=proc)
    activity = gpu_activity(seam, clock.time()) if scan.nvml_available else Activity()
    decisions = decide_all(scan, min_age_s=min_age_s, all_users=all_users, is_root=os.geteuid() == 0,
                           my_uid=os.geteuid(), activity=activity)
    return scan, decisions


# -- acting ---------------------------------------------------------------------------------------------------

def reap(decisions: List[Decision], *, term_timeout_s: float = 5.0, kill_timeout_s: float = 5.0,
         poll_s: float = 0.05, procs: Optional[ProcessSeam] = None, clock: Optional[Clock] = None,
         record: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
    """TERM every "reap" decision's process, wait up to term_timeout_s, KILL survivors, wait up to kill_timeout_s:
    onbox.proc.escalate over the process seam `procs`, each holder re-identified by (pid, start ticks).
    Fills each decision's `outcome`; `record` receives one dict per signal sent or refused (the kill log)."""
    procs = procs or ProcessSeam()
    clock = clock or SystemClock()
    targets = {ProcRef(d.holder.pid, d.holder.start_ticks): d for d in decisions if d.verdict == "reap"}

    def note(d: Decision, name: str, result: str) -> None:
        log.info("onbox.gpu.reaper: %s %s to pid %d (%s): %s", result, name, d.holder.pid, d.holder.command[:80],
                 d.reason)
        if record:
            record({"event": "reap_signal", "signal": name, "result": result, "pid": d.holder.pid,
                    "sid": d.holder.sid, "user": d.holder.user, "command": d.holder.command[:200],
                    "owner": d.holder.owner, "of_run": d.holder.run, "of_attempt": d.holder.attempt,
                    "reason": d.reason, "time": clock.time()})

    def step(name: str, refs: List[ProcRef], report: Stopped) -> None:
        for r in refs:
            result = report.result(r, name)
            if result in ("sent", "denied"):
                note(targets[r], name, result)

    stopped = escalate(procs, lambda: [r for r in targets if procs.start_time_of(r.pid) == r.start_time],
                       term_timeout_s, clock, kill_timeout=kill_timeout_s, poll=poll_s, on_step=step)
    for r, d in targets.items():
        if r in stopped.denied:
            d.outcome = "permission denied (owned by %s)" % d.holder.user
        elif stopped.result(r, "SIGKILL") == "sent":
            d.outcome = ("still alive %.0f s after SIGKILL (stuck in driver teardown? state D): re-check, or reboot"
                         % kill_timeout_s) if r in stopped.survived else "killed by SIGKILL (ignored SIGTERM)"
        elif stopped.result(r, "SIGTERM") == "sent":
            d.outcome = "terminated by SIGTERM"
        else:
            d.outcome = "already gone"
    for d in decisions:
        if d.outcome is None:
            d.outcome = "not touched: " + d.reason if d.verdict == "keep" else d.outcome


def kill_log(path: str) -> Callable[[Dict[str, Any]], None]:
    """A `record` callback appending one JSON line per signal to `path`."""
    def record(entry: Dict[str, Any]) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        append_jsonl(path, entry)
    return record


# -- before a restart -----------------------------------------------------------------------------------------

def memory_settled(seam: Any, gpus: Iterable[int], *, timeout_s: float, poll_s: float, clock: Clock,
                   slack_bytes: int = 512 << 20, gone_pids: Iterable[int] = ()) -> Dict[str, Any]:
    """Wait, bounded, until each GPU's used memory is no more than what NVML attributes to processes other than
    `gone_pids` (the ones just reaped) plus `slack_bytes`: the driver frees a dead context's memory
    asynchronously (NVIDIA's resiliency launcher waits the same way). Returns {"waited_s", "released",
    "gpus": {index: used bytes}} or {"skipped": reason}."""

    gpus = sorted(set(gpus))
    if not gpus:
        return {"skipped": "no GPU was held"}
    if seam is None or not seam.available():
        return {"skipped": "NVML not available: %s" % (seam.unavailable_reason if seam else "no seam")}
    try:
        return _memory_settled(seam, gpus, timeout_s=timeout_s, poll_s=poll_s, clock=clock, slack_bytes=slack_bytes,
                               gone=set(gone_pids))
    except seam.nvml.NVMLError as e:  # e.g. the GPU fell off the bus meanwhile: the restart decides, not us
        return {"skipped": "NVML error while waiting: %s" % e}


def _memory_settled(seam: Any, gpus: List[int], *, timeout_s: float, poll_s: float, clock: Clock,
                    slack_bytes: int, gone: Set[int]) -> Dict[str, Any]:
    from onbox.gpu.nvml import NA, running_processes

    start = clock.monotonic()
    deadline = start + timeout_s
    while True:
        used: Dict[int, Any] = {}
        settled = True
        for i in gpus:
            h = seam.call("nvmlDeviceGetHandleByIndex", i, optional=False)
            mem = seam.call("nvmlDeviceGetMemoryInfo", h)
            procs = running_processes(seam, h)
            expected = sum(p.usedGpuMemory or 0 for p in ([] if procs is NA else procs) if p.pid not in gone)
            used[i] = None if mem is NA else mem.used
            if mem is not NA and mem.used > expected + slack_bytes:
                settled = False
        if settled or clock.monotonic() >= deadline:
            return {"waited_s": round(clock.monotonic() - start, 3), "released": settled, "gpus": used}
        clock.sleep(poll_s)


class ReaperHook:
    """runhooks.ReapHook: before each restart, kill what earlier attempts of this run left on the GPU (U11),
    then wait (bounded by config.reap_wait) for the memory to come back."""

    def __init__(self, ctx: Any, seam: Any = None, proc: str = "/proc", term_timeout_s: float = 5.0,
                 kill_timeout_s: float = 5.0, poll_s: float = 0.05, memory_poll_s: float = 0.5,
                 procs: Optional[ProcessSeam] = None) -> None:
        self.ctx = ctx
        self.seam = seam  # NVML
        self.proc = proc  # the procfs the holder scan reads
        self.procs = procs  # the process seam that signals (None: the real one, on the run's clock)
        self.term_timeout_s = term_timeout_s
        self.kill_timeout_s = kill_timeout_s
        self.poll_s = poll_s
        self.memory_poll_s = memory_poll_s

    def gpu_state(self) -> Dict[str, Any]:
        """Every GPU's readings now (onbox.gpu.readings: utilisation, memory, processes, Xid), for a hang's
        evidence; on a box without a driver: available False and why."""
        from onbox.gpu.readings import gpu_readings

        return gpu_readings(self.seam)

    def before_attempt(self, earlier_sessions: List[int]) -> None:
        from onbox.gpu.holders import HolderScan
        from onbox.gpu.nvml import NvmlSeam

        ctx = self.ctx
        if not ctx.config.reap_orphans:
            return
        seam = self.seam if self.seam is not None else NvmlSeam()
        scan = HolderScan(ctx.config.gpu_devices, self.proc, seam).scan()
        classify(scan, AttemptIndex.load(os.path.dirname(ctx.run_dir)), extra_earlier_sids=earlier_sessions,
                 proc=self.proc)
        mine = set(earlier_sessions)
        # a container that outlived its attempt (its client was killed, `docker stop` failed) is ours too
        orphans = [h for h in scan.holders if h.owner == "earlier" and (h.sid in mine or h.run == ctx.name)
                   and (not h.other_pid_ns or (h.container is not None and h.run == ctx.name))]
        if not orphans:
            return
        decisions = [Decision(h, "reap", "orphan of run %s attempt %s (%s)"
                              % (ctx.name, "?" if h.attempt is None else h.attempt,
                                 "container %s" % h.container_short if h.container else "session %d" % h.sid))
                     for h in orphans]
        logfile = kill_log(os.path.join(os.path.dirname(os.path.dirname(ctx.run_dir)), "reap.jsonl"))

        def record(entry: Dict[str, Any]) -> None:
            logfile(dict(entry, run=ctx.name))
            fields = {k: v for k, v in entry.items() if k not in ("event", "time")}  # emit stamps its own
            ctx.emit("reap_signal", **fields)

        reap(decisions, term_timeout_s=self.term_timeout_s, kill_timeout_s=self.kill_timeout_s,
             poll_s=self.poll_s, procs=self.procs, clock=ctx.clock, record=record)
        memory = memory_settled(seam, {g for h in orphans for g in h.gpus}, timeout_s=ctx.config.reap_wait,
                                poll_s=self.memory_poll_s, clock=ctx.clock, gone_pids=[h.pid for h in orphans])
        ctx.emit("reaped", holders=[{"pid": d.holder.pid, "sid": d.holder.sid, "outcome": d.outcome}
                                    for d in decisions], memory=memory)
