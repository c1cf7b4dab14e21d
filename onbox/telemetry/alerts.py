"""Alerts: conditions a person should look at, each with a hint saying what to do. Their kinds and severities are
onbox.vocab's (one vocabulary for the agent, the tracker and onboxctl).

Three kinds of input:
- the loss stream (`observe_loss`): NaN/Inf and spikes are latched until the next heartbeat collects them, so a
  spike between two beats is not lost; the same records and the run's events feed the resume check
  (resumecheck.py: a trainer whose first step after a restore is far below the restored checkpoint's);
- readings taken at each beat (`evaluate`): stall, disks, GPUs, host OOM kills, sync failure, crash loop;
- what the agent's records say (`recorded_alerts`, also for a reader of those records, such as `onboxctl status`
  over ssh): the warnings the supervisor keeps in state.json (`thread_died`: a thread of the agent died, e.g. the
  metadata poller, so preemption notices are off; `no_metrics`: output but no metric recognised, with the flag to
  use; ...) and the checkpoint hook's in checkpoint_status.json (`no_checkpoint`: nothing in the checkpoint dir
  counts, and why; `checkpoint_dir_too_large`; the newest checkpoint unreadable; a start from scratch; a failed
  sync).

`AlertEngine.collect()` returns the alerts active now (sorted by code); the heartbeat sends at once when a code
appears that the previous beat did not carry.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence

from onbox import vocab
from onbox.telemetry import resumecheck

# U23: the clock-event reasons that steal throughput (power cap, HW slowdown, thermal, power brake); an idle GPU,
# application clocks, sync boost or the display clock are benign. Same bits as onbox.gpu.readings.SLOWDOWN_BITS.
SLOWDOWN_REASONS = {"SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"}
DEAD_GPU_XIDS = {48, 79}  # U22: double-bit ECC, fell off the bus
MAX_SEEN_XIDS = 4096


@dataclasses.dataclass
class Alert:
    code: str  # stable machine name: onbox.vocab.ALERT_KINDS (nan_loss, loss_spike, stall, low_disk, ...)
    severity: str  # onbox.vocab.SEVERITIES: "warning" | "critical"
    message: str
    hint: str
    data: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "message": self.message, "hint": self.hint,
                "data": self.data}


@dataclasses.dataclass
class AlertSettings:
    spike_window: int = 50  # losses kept for the robust baseline
    spike_min_points: int = 20  # no spike verdict before this many finite losses
    spike_z: float = 8.0  # robust z-score (0.6745 * (x - median) / MAD) above which a loss is a spike
    spike_min_rel: float = 0.25  # ...and at least this far above the median, relative (heavy-tailed batch noise)
    stall_seconds: float = 30 * 60.0
    min_free_bytes: int = 2 * 1024**3
    min_free_ratio: float = 0.02
    min_free_inode_ratio: float = 0.02
    crash_loop_threshold: int = 3


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def robust_z(value: float, history: Sequence[float]) -> float:
    """Robust z-score of `value` against `history`: 0.6745 * (value - median) / MAD (MAD floored, never 0)."""
    ordered = sorted(history)
    n = len(ordered)
    med = median(ordered)
    dev = sorted(abs(x - med) for x in ordered)
    mad = dev[n // 2] if n % 2 else 0.5 * (dev[n // 2 - 1] + dev[n // 2])
    mad = max(mad, 1e-3 * abs(med), 1e-12)  # a perfectly flat history must not turn every wiggle into a spike
    return 0.6745 * (value - med) / mad


class AlertEngine:
    def __init__(self, settings: Optional[AlertSettings] = None) -> None:
        self.settings = settings or AlertSettings()
        self._losses: Deque[float] = deque(maxlen=self.settings.spike_window)
        self._latched: Dict[str, Alert] = {}
        self._current: Dict[str, Alert] = {}
        self._oom_baseline: Optional[int] = None
        self._seen_xids: Dict[Any, None] = {}  # insertion-ordered set, bounded
        self.resume = resumecheck.ResumeCheck()
        self._resume_said: Optional[Dict[str, Any]] = None  # a verdict the caller has not emitted as an event yet

    # -- the run's events and progress records: the resume check
    def on_event(self, ev: Mapping[str, Any]) -> None:
        self.resume.on_event(ev)

    def observe_record(self, fields: Mapping[str, Any]) -> Optional[Alert]:
        """One progress record of the trainer (its step, loss, epoch): the resume check's alert when this record
        makes its verdict (take_resume_event() then has the event's fields), else None."""
        verdict = self.resume.on_record(fields)
        if verdict is None:
            return None
        self._resume_said = verdict
        return _resume_alert(verdict)

    def take_resume_event(self) -> Optional[Dict[str, Any]]:
        """The fields of the `resume_backwards` event still to be emitted (once), or None."""
        said, self._resume_said = self._resume_said, None
        return said

    # -- the loss stream
    def observe_loss(self, loss: float, step: Optional[int] = None) -> Optional[Alert]:
        """Feed one training loss; returns the alert it raised (also latched for the next beat), if any."""
        s = self.settings
        if not math.isfinite(loss):
            nan = Alert("nan_loss", "critical", "loss is %s at step %s" % (loss, step),
                          "the run diverged: lower the learning rate or enable gradient clipping, and resume from "
                          "the last good checkpoint; check the data batch at that step", {"step": step})
            self._latched[nan.code] = nan
            return nan
        alert: Optional[Alert] = None
        if len(self._losses) >= s.spike_min_points:
            window = list(self._losses)
            z = robust_z(loss, window)
            if z > s.spike_z and loss - median(window) > s.spike_min_rel * abs(median(window)):
                alert = Alert("loss_spike", "warning",
                              "loss spiked to %.4g at step %s (robust z-score %.1f over the last %d losses)"
                              % (loss, step, z, len(self._losses)),
                              "look at the batch and learning-rate schedule at that step; if the loss does not "
                              "come back, resume from the checkpoint before the spike",
                              {"step": step, "loss": loss, "z": round(z, 2)})
                self._latched[alert.code] = alert
        self._losses.append(loss)
        return alert

    # -- readings at a beat
    def evaluate(self, *, child_alive: bool, child_pid: Optional[int] = None,
                 quiet_seconds: Optional[float] = None, disks: Sequence[Mapping[str, Any]] = (),
                 gpus: Sequence[Mapping[str, Any]] = (), oom_kill: Optional[int] = None,
                 last_sync: Optional[Mapping[str, Any]] = None, state: Optional[Mapping[str, Any]] = None,
                 checkpoint: Optional[Mapping[str, Any]] = None) -> None:
        """Recompute the condition alerts from this beat's readings and the agent's records (state.json's document,
        checkpoint_status.json's: recorded_alerts).

        quiet_seconds: time since the later of the last new step and the last output line.
        """
        s = self.settings
        cur: Dict[str, Alert] = {}
        if child_alive and quiet_seconds is not None and quiet_seconds >= s.stall_seconds:
            pid = child_pid if child_pid else "<pid>"
            cur["stall"] = Alert("stall", "critical",
                                 "no new step and no output for %d min while the child (pid %s) lives"
                                 % (quiet_seconds // 60, pid),
                                 "see where it hangs, in every process of the job (pip install py-spy): `py-spy "
                                 "dump --pid %s` is only the child (torchrun, a shell); its workers and their "
                                 "DataLoader workers are its descendants (`pstree -p %s`): dump each; a NCCL hang or "
                                 "a dead DataLoader worker is typical; U43: is stdout block-buffered?" % (pid, pid),
                                 {"quiet_seconds": round(quiet_seconds, 1), "pid": child_pid})
        for disk in disks:
            self._disk(cur, disk)
        for gpu in gpus:
            self._gpu(cur, gpu)
        if oom_kill is not None:
            if self._oom_baseline is None:
                self._oom_baseline = oom_kill
            elif oom_kill > self._oom_baseline:
                cur["host_oom_kill"] = Alert(
                    "host_oom_kill", "critical",
                    "the cgroup's oom_kill counter rose by %d since the agent started" % (oom_kill - self._oom_baseline),
                    "U9/U41: a process in this container was OOM-killed: lower num_workers or free host RAM; "
                    "host `free` is not your cgroup — read memory.current/memory.max",
                    {"oom_kill": oom_kill, "baseline": self._oom_baseline})
        if last_sync is None and checkpoint is not None and isinstance(checkpoint.get("last_sync"), Mapping):
            last_sync = checkpoint["last_sync"]
        _sync_failed(cur, last_sync)
        loop = crash_loop(state, s.crash_loop_threshold)
        if loop:
            cur["crash_loop"] = loop
        _warnings(cur, (state or {}).get("warnings") or [])
        _checkpoint(cur, checkpoint)
        if self.resume.verdict is not None:
            cur[vocab.RESUME_BACKWARDS] = _resume_alert(self.resume.verdict)
        self._current = cur

    def _disk(self, cur: Dict[str, Alert], disk: Mapping[str, Any]) -> None:
        s = self.settings
        free, total = disk.get("free_bytes"), disk.get("total_bytes")
        path = disk.get("path")
        if isinstance(free, int) and isinstance(total, int) and total > 0 and (
                free < s.min_free_bytes or free < s.min_free_ratio * total):
            cur.setdefault("low_disk", Alert(
                "low_disk", "critical", "%s has %.1f GiB free of %.1f GiB" % (path, free / 1024**3, total / 1024**3),
                "U6: torch.save fails on a full disk: prune old checkpoints (keep the newest verified) or move "
                "caches (HF_HOME, pip) off this disk", {"path": path, "free_bytes": free}))
        ifree, itotal = disk.get("free_inodes"), disk.get("total_inodes")
        if isinstance(ifree, int) and isinstance(itotal, int) and itotal > 0 and ifree >= 0 and (
                ifree < s.min_free_inode_ratio * itotal):
            cur.setdefault("low_inodes", Alert(
                "low_inodes", "critical", "%s has %d free inodes of %d" % (path, ifree, itotal),
                "U7: the disk dies on inodes before bytes: find many-small-file dirs (`du --inodes`), shard "
                "them into tar (U25)", {"path": path, "free_inodes": ifree}))

    def _gpu(self, cur: Dict[str, Alert], gpu: Mapping[str, Any]) -> None:
        """One GPU of onbox.gpu.readings.gpu_readings(): throttling, dead card, pinned memory, NEW Xid events."""
        index = gpu.get("index")
        verdict = gpu.get("verdict")
        if verdict == "dead":
            prev = cur.get("gpu_dead")
            gpus = (prev.data["gpus"] if prev else []) + [index]
            cur["gpu_dead"] = Alert(
                "gpu_dead", "critical", "GPU %s is dead: %s" % (",".join(str(g) for g in gpus),
                                                                 gpu.get("verdict_reason") or "?"),
                "U22: Xid 48/79 or a lost GPU: re-rent the box, don't debug it; the run resumes from the last "
                "durable checkpoint on the new box", {"gpus": gpus})
        elif verdict == "pinned":
            cur.setdefault("gpu_pinned", Alert(
                "gpu_pinned", "warning", "GPU %s: %s" % (index, gpu.get("verdict_reason") or "memory pinned"),
                "U11: a process that is not this run holds GPU memory: `onbox reap` lists it, `--force` kills it",
                {"gpu": index}))
        reasons = [str(r) for r in (gpu.get("throttle_reasons") or [])]
        slow = [r for r in reasons if r in SLOWDOWN_REASONS]
        if slow:
            prev = cur.get("gpu_throttle")
            gpus = (prev.data["gpus"] if prev else []) + [index]
            cur["gpu_throttle"] = Alert(
                "gpu_throttle", "warning", "GPU %s throttled: %s" % (",".join(str(g) for g in gpus), ", ".join(slow)),
                "U23: thermal/power throttling steals 25-40%% of throughput: check temperature and power limit "
                "(`nvidia-smi -q -d PERFORMANCE`); ask the provider or re-rent", {"gpus": gpus, "reasons": slow})
        new = []
        for ev in gpu.get("xid_events") or []:
            if not isinstance(ev, Mapping) or not isinstance(ev.get("xid"), int):
                continue
            key = (index, ev.get("xid"), ev.get("source"), ev.get("message"), ev.get("at"))
            if key in self._seen_xids:
                continue  # gpu_readings keeps the newest events; alert on each only once
            self._seen_xids[key] = None
            if len(self._seen_xids) > MAX_SEEN_XIDS:
                del self._seen_xids[next(iter(self._seen_xids))]
            new.append(ev["xid"])
        if new:
            dead = sorted(set(new) & DEAD_GPU_XIDS)
            prev = cur.get("xid")
            cur["xid"] = Alert(
                "xid", "critical", "GPU %s reported Xid %s" % (index, ", ".join(str(x) for x in new)),
                ("U22: Xid %s means the GPU is dead: re-rent, don't debug" % dead) if dead else
                "look the Xid up in NVIDIA's Xid catalog; a repeating Xid means a hardware fault: re-rent",
                {"gpu": index, "xids": new, "earlier": prev.data if prev else None})

    def collect(self) -> List[Alert]:
        """Active alerts for this beat: the condition alerts plus the stream alerts latched since the last beat."""
        merged = dict(self._current)
        merged.update(self._latched)
        self._latched = {}
        return [merged[k] for k in sorted(merged)]


def recorded_alerts(state: Optional[Mapping[str, Any]], checkpoint: Optional[Mapping[str, Any]],
                    crash_loop_threshold: int = AlertSettings.crash_loop_threshold) -> List[Alert]:
    """The alerts the agent's records say, sorted by code: state.json's warnings and crash loop, checkpoint_status.json's
    warnings and failed sync. What a reader of those records shows (`onboxctl status` over ssh reads `onbox status
    --json`), the same as the beats carry."""
    cur: Dict[str, Alert] = {}
    _sync_failed(cur, (checkpoint or {}).get("last_sync") if isinstance((checkpoint or {}).get("last_sync"),
                                                                        Mapping) else None)
    loop = crash_loop(state, crash_loop_threshold)
    if loop:
        cur["crash_loop"] = loop
    _warnings(cur, (state or {}).get("warnings") or [])
    _checkpoint(cur, checkpoint)
    return [cur[k] for k in sorted(cur)]


def _sync_failed(cur: Dict[str, Alert], last_sync: Optional[Mapping[str, Any]]) -> None:
    if last_sync and last_sync.get("ok") is False:
        cur["sync_failed"] = Alert(
            "sync_failed", vocab.CRITICAL, "the last checkpoint sync failed: %s" % (last_sync.get("error") or "?"),
            "U33: the durable copy is NOT current; check `df -i` on the durable dir and the rclone remote; "
            "the local checkpoint is still the source of truth", {"at": last_sync.get("at")})


def _warnings(cur: Dict[str, Alert], warnings: Sequence[Any]) -> None:
    """state.json's warnings (onbox/supervisor/notes.py) as alerts, one per code (messages joined)."""
    for w in warnings:
        if not isinstance(w, Mapping) or not w.get("code"):
            continue
        code = str(w["code"])[:vocab.CODE_CHARS]
        prev = cur.get(code)
        if prev is not None:
            prev.message += "; %s" % w.get("message")
            continue
        cur[code] = Alert(code, vocab.severity_of(code, w.get("severity")), str(w.get("message") or code),
                          str(w.get("hint") or ""),
                          {k: w[k] for k in ("thread", "at", "stacks", "action") if w.get(k) is not None})


def _checkpoint(cur: Dict[str, Alert], status: Optional[Mapping[str, Any]]) -> None:
    """checkpoint_status.json's warning (onbox/checkpoints/hook/localdir.py) as an alert. (The newest checkpoint
    unreadable and a start from scratch reach state.json's warnings through the supervisor's notes.)"""
    if not isinstance(status, Mapping):
        return
    warning = status.get("warning")
    if not isinstance(warning, str) or not warning:
        return
    code = status.get("warning_code")
    if not isinstance(code, str) or not code:  # an agent before the codes: the two warnings it wrote
        code = vocab.CHECKPOINT_DIR_TOO_LARGE if "implausibly large" in warning else vocab.NO_CHECKPOINT
    hint = status.get("warning_hint")
    cur.setdefault(code, Alert(code, vocab.severity_of(code), warning, hint if isinstance(hint, str) else ""))


def _resume_alert(verdict: Mapping[str, Any]) -> Alert:
    return Alert(vocab.RESUME_BACKWARDS, vocab.CRITICAL, resumecheck.describe(verdict), resumecheck.HINT,
                 {k: verdict.get(k) for k in ("attempt", "restored_step", "first_step", "checkpoint")})


NOT_FAILURES = (vocab.EXIT_SUCCESS, vocab.EXIT_PREEMPTED, vocab.EXIT_STOPPED, vocab.EXIT_FENCED,
                vocab.EXIT_UNKNOWN)  # exit classifications


def crash_loop(state: Optional[Mapping[str, Any]], threshold: int) -> Optional[Alert]:
    """The last `threshold` FINISHED attempts (state.json attempts[].exit) failed the same way: the same
    classification, and for a plain failure the same exit code, for a signal the same signal (classify.loop_key)."""
    if not state or threshold <= 0:
        return None
    exits = [a["exit"] for a in (state.get("attempts") or [])
             if isinstance(a, Mapping) and isinstance(a.get("exit"), Mapping)]
    tail = exits[-threshold:]
    if len(tail) < threshold:
        return None
    keys = []
    for ex in tail:
        c = ex.get("classification")
        if c in NOT_FAILURES:
            return None
        if c == vocab.EXIT_FAILED:
            keys.append("failed (exit %s)" % ex.get("code"))
        elif c == vocab.EXIT_SIGNALED:
            keys.append("signal %s" % (ex.get("signal_name") or ex.get("signal")))
        else:
            keys.append(str(c))
    if len(set(keys)) == 1:
        return _crash_alert(keys[0], threshold, tail[-1].get("message"))
    return None


def _crash_alert(classification: Any, n: int, message: Any) -> Alert:
    return Alert("crash_loop", "critical",
                 "the last %d attempts failed the same way (%s)%s" % (n, classification or "?",
                                                                      ": %s" % message if message else ""),
                 "restarting will not fix it: read the tail of the log (`onbox logs RUN`), fix the cause, then "
                 "start the run again", {"classification": classification, "attempts": n})
