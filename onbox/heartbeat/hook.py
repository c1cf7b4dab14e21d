"""HeartbeatHook: the TelemetryHook the supervisor calls (onbox/supervisor/hooks.py).

- on_output(line): keep the line in the log tail each beat carries (bounded, secrets redacted:
  onbox/telemetry/logtail.py); it tells the stall alert that the child is not silent.
- on_progress(fields): a record of the run's progress feed (RunContext.progress: parsed once, by the supervisor
  loop, from the output and ONBOX_METRICS_FILE): its loss and step to the alert engine (spikes, and a resume that
  went backwards: the event `resume_backwards`, onbox/telemetry/resumecheck.py), all of it to the sinks that draw
  curves. Each beat carries the feed's newest values (`progress`) and every record since the previous beat
  (`points`, bounded: onbox/heartbeat/points.py).
- on_event(event): a lifecycle event makes the next tick send a beat at once; the events that say when an
  attempt's setup began go to the beat's `times` (times.py).
- tick(state): send a beat when one is due (every `heartbeat_interval`, on a state change or event, on a new
  alert); once the child has printed for `metrics_hint_minutes` without a metric recognised, emit
  `metrics_unrecognised` with the flag to use (and `metrics_recognised` when one finally is: metricshint.py).
- close(state): the final beat, then flush the spools within a short bound.

Nothing here blocks on the network: beats are spooled (fsynced) and pushed by one sender thread per sink.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from onbox import paths, vocab
from onbox.environment import Environment
from onbox.fsutil import atomic_write_json, disk_fault, json_safe, read_json
from onbox.heartbeat.collect import BoxReaders, default_readers
from onbox.heartbeat.metricshint import MetricsHint
from onbox.heartbeat.points import beat_points
from onbox.heartbeat.schema import SCHEMA
from onbox.heartbeat.sinks import Backoff, FileSink, PingSink, Sender, TrackerSink
from onbox.heartbeat.spool import SeqCounter, Spool
from onbox.heartbeat.times import AttemptTimes
from onbox.multinode.role import recorded_role
from onbox.proc import env_pid_alive
from onbox.slurm.job import heartbeat_fields
from onbox.supervisor.childenv import secret_values
from onbox.telemetry.alerts import AlertEngine, AlertSettings
from onbox.telemetry.logtail import LogTail
from onbox.telemetry.progress import PointLog, ProgressFeed

if TYPE_CHECKING:
    from onbox.supervisor.hooks import RunContext

log = logging.getLogger("onbox.heartbeat")

ENDED_STATES = vocab.ENDED_STATES
FAILED_STATES = vocab.FAILED_STATES


def box_name(environ: Optional[Mapping[str, str]] = None) -> str:
    """ONBOX_BOX (the name onboxctl knows the box by), else the hostname."""
    return Environment.read(environ).box or socket.gethostname() or "box"


def phase_fields(phase: Any) -> Optional[Dict[str, Any]]:
    """The beat's `phase`: where a [[phase]] curriculum stands (None for a plain run)."""
    if not isinstance(phase, dict):
        return None
    return {k: phase.get(k) for k in ("name", "index", "count", "status", "target_steps", "target_tokens",
                                      "start_step")}


def _pid_alive(pid: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and env_pid_alive(pid)


class HeartbeatHook:
    def __init__(self, ctx: "RunContext", readers: Optional[BoxReaders] = None, sinks: Optional[List[Any]] = None,
                 ping: Optional[PingSink] = None, alert_settings: Optional[AlertSettings] = None,
                 request_timeout: float = 10.0, close_timeout: float = 5.0, backoff: Optional[Backoff] = None,
                 spool_max: int = 20000, batch_size: int = 100) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self.clock = ctx.clock
        self.interval = float(cfg.heartbeat_interval)
        self.close_timeout = close_timeout
        self.readers = readers or default_readers()
        # the run's progress: the supervisor's feed; a hook built outside one has a feed of its own, which whoever
        # drives the hook fills as the loop does (feed.on_output / read_metrics_file, then on_progress)
        self.feed = ctx.progress if ctx.progress is not None else ProgressFeed(
            os.path.join(ctx.run_dir, paths.METRICS_FILE), cfg.metrics_regex, ctx.clock)
        self.alerts = AlertEngine(alert_settings or AlertSettings(
            stall_seconds=cfg.stall_minutes * 60.0, crash_loop_threshold=cfg.crash_loop_threshold))
        self.box = box_name(ctx.environ)
        self.slurm = heartbeat_fields(os.environ if ctx.environ is None else ctx.environ)
        self.node = recorded_role(cfg.node_group)  # this box's rank in a multi-node group over SSH
        os.makedirs(os.path.join(ctx.run_dir, paths.HEARTBEATS_DIR), mode=0o700, exist_ok=True)
        self.seq = SeqCounter(os.path.join(ctx.run_dir, paths.HEARTBEAT_SEQ_FILE), first=int(self.clock.time() * 1000))
        if sinks is None:
            sinks = sinks_for(cfg, ctx.name, ctx.run_dir, self.box, request_timeout, ctx.emit)
        # Sinks that draw curves get every metric record, not only the newest, spooled with the next beat: the
        # tracker and the heartbeat file in the beat's `points` (bounded, thinned past MAX_POINTS), MLflow all of
        # them in its own spool document.
        # The metrics file's read position is saved at each beat: a restarted agent or a relaunch reads on from
        # there instead of sending the file's records again (MLflow would draw them twice). The feed has read
        # nothing yet: the loop fills it once the hooks are built.
        self.points: Optional[PointLog] = PointLog() if any(getattr(s, "wants_points", False) for s in sinks) else None
        self._position_path = os.path.join(ctx.run_dir, paths.METRICS_POSITION_FILE)
        self._position_saved: Any = None
        if self.points is not None:
            try:
                self.feed.metrics_file.resume(read_json(self._position_path))
            except (OSError, ValueError):
                pass
        # One spool and one sender thread per sink: a sink that is down queues only its own beats, the others go on.
        self.senders: List[Sender] = []
        for sink in sinks:
            spool = Spool(self._spool_dir(sink.name), max_entries=spool_max)
            sender = Sender(sink, spool, batch_size=batch_size,
                            backoff=backoff or Backoff(base=min(1.0, max(self.interval, 0.01)), cap=60.0),
                            on_death=self._sender_died(sink.name), on_health=self._sink_health(sink))
            sender.start()
            self.senders.append(sender)
        if ping is None and cfg.ping_url:
            ping = PingSink(cfg.ping_url, timeout=request_timeout)
        self.ping = ping
        self._lock = threading.Lock()
        self._last_output_mono: Optional[float] = None
        self._started_mono = self.clock.monotonic()
        self._next_beat: Optional[float] = None  # None: the first tick beats
        self._event_pending = False
        self._last_state: Optional[str] = None
        self._last_alert_codes: Set[str] = set()
        self._stream_alert = False
        self._closed = False
        self.hint = MetricsHint(float(cfg.metrics_hint_minutes) * 60.0)
        self.log_tail = LogTail(cfg.log_tail_lines, secret_values(cfg, ctx.environ))
        self._secrets_attempt: Any = ctx.attempt()  # read just above: the next attempt reads them again
        self.times = AttemptTimes(self.clock.time())  # the beat's `times` (times.py)

    # -- TelemetryHook
    def on_output(self, line: str) -> None:
        mono = self.clock.monotonic()
        self.log_tail.add(line)
        with self._lock:
            self._last_output_mono = mono
            self.hint.on_output(mono)

    def on_progress(self, fields: Dict[str, float]) -> None:
        """A record the feed has taken: its newest values (the step, the record's time) include it already."""
        progress = self.feed.progress
        step = progress.values.get("step")
        wall = self.clock.time() if progress.updated_at is None else progress.updated_at
        with self._lock:
            self.hint.on_record()
            if self.points is not None:
                self.points.add(fields, step, wall)
            loss = fields.get("loss")
            if loss is not None and self.alerts.observe_loss(float(loss), None if step is None else int(step)) is not None:
                self._stream_alert = True
            if self.alerts.observe_record(fields) is not None:  # a resume that went backwards (resumecheck.py)
                self._stream_alert = True
            backwards = self.alerts.take_resume_event()
        if backwards is not None:  # outside the lock: emit() calls back into on_event
            self.ctx.emit("resume_backwards", **backwards)

    def on_event(self, event: Dict[str, Any]) -> None:
        with self._lock:
            self._event_pending = True
            self.alerts.on_event(event)  # a restore and the attempt it starts: the resume check
        self.times.on_event(event)

    def tick(self, state: Dict[str, Any]) -> None:
        if self._closed:
            return
        mono = self.clock.monotonic()
        self._metrics_hint(mono)
        with self._lock:
            st = str(state.get("state", ""))
            reason = None
            if self._next_beat is None:
                reason = "start"
            elif st != self._last_state or self._event_pending:
                reason = "event"
            elif self._stream_alert:
                reason = "alert"
            elif mono >= self._next_beat:
                reason = "interval"
        if reason is None:
            # condition alerts (stall, disks, ...) are evaluated at beats; a stall is checked every tick
            if self._quiet_seconds(mono) is not None and self._stall_suspected(state, mono):
                reason = "alert"
            else:
                return
        self.beat(state, reason)

    def close(self, state: Dict[str, Any]) -> None:
        if self._closed:
            return
        self.beat(state, "final")
        self._closed = True
        deadline = self.clock.monotonic() + self.close_timeout
        for sender in self.senders:
            sender.flush(max(0.0, deadline - self.clock.monotonic()))
        for sender in self.senders:
            sender.stop(timeout=max(0.1, min(1.0, deadline - self.clock.monotonic())))
        if self.ping is not None:
            self.ping.join(max(0.0, deadline - self.clock.monotonic()))

    # -- a run disk that refuses writes
    def _fault(self, what: str) -> Optional[Callable[[OSError], None]]:
        """The reporter for a disk fault on `what` (RunContext.write_failed), None outside a supervisor."""
        report = self.ctx.write_failed
        return None if report is None else lambda e: report(what, e)

    def _written(self, name: str, doc: Any) -> bool:
        """atomic_write_json of `name` in the run dir; False when the disk refused it (reported, not raised: the
        beats still go out, they are the only news while the disk is full)."""
        try:
            atomic_write_json(os.path.join(self.ctx.run_dir, name), doc)
            return True
        except OSError as e:
            report = self._fault(name)
            if report is None or disk_fault(e) is None:
                raise
            report(e)
            return False

    # -- internals
    def _sender_died(self, sink_name: str) -> Any:
        def died(error: BaseException) -> None:
            from onbox.supervisor.notes import thread_death

            self.ctx.emit("thread_died", **thread_death(
                "onbox-heartbeat-%s" % sink_name, "heartbeats to %s" % sink_name, error, self.ctx.name, os.getpid(),
                hint="the beats stay spooled in %s" % os.path.join(self.ctx.run_dir, paths.HEARTBEATS_DIR)))
        return died

    def _spool_dir(self, sink_name: str) -> str:
        return os.path.join(self.ctx.run_dir, paths.HEARTBEAT_SPOOL_DIR % sink_name)

    def _sink_health(self, sink: Any) -> Any:
        def health(ok: bool, error: Optional[str]) -> None:
            if ok:
                self.ctx.emit("heartbeat_sink_up", sink=sink.name)
                return
            self.ctx.emit("heartbeat_sink_down", sink=sink.name, error=error,
                          hint=getattr(sink, "down_hint", None) or "the run goes on; its beats wait in %s and are "
                          "sent, in order, when %s answers" % (self._spool_dir(sink.name), sink.name))
        return health

    def _metrics_hint(self, mono: float) -> None:
        """Say whether the output is recognised as metrics (metricshint.py). Emitted outside the lock: emit() calls
        back into on_event."""
        with self._lock:
            said = self.hint.check(mono)
        for kind, fields in said:
            self.ctx.emit(kind, **fields)

    def _quiet_seconds(self, mono: float) -> Optional[float]:
        marks = [m for m in (self._last_output_mono, self.feed.progress.step_advanced_mono) if m is not None]
        return mono - max([*marks, self._started_mono])

    def _stall_suspected(self, state: Dict[str, Any], mono: float) -> bool:
        quiet = self._quiet_seconds(mono)
        return (quiet is not None and quiet >= self.alerts.settings.stall_seconds
                and "stall" not in self._last_alert_codes and _pid_alive(state.get("child_pid")))

    def beat(self, state: Dict[str, Any], reason: str) -> Dict[str, Any]:
        """Take one heartbeat now, spool it for every sink, wake the senders. Returns the document."""
        mono, wall = self.clock.monotonic(), self.clock.time()
        gpus = self._read("gpus", self.readers.gpu)
        host = self._read("host", self.readers.host)
        disks = self.readers.disks(self._disk_paths())
        checkpoint = self._checkpoint_status()
        pid = state.get("child_pid")
        alive = _pid_alive(pid)
        st = str(state.get("state", "unknown")) or "unknown"
        with self._lock:
            quiet = self._quiet_seconds(mono)
            self.alerts.evaluate(child_alive=alive and st.lower() not in ENDED_STATES, child_pid=pid,
                                 quiet_seconds=quiet, disks=disks, gpus=(gpus or {}).get("gpus") or [],
                                 oom_kill=(host or {}).get("oom_kill"),
                                 last_sync=(checkpoint or {}).get("last_sync"), state=state, checkpoint=checkpoint)
            alerts = self.alerts.collect()
            codes = {a.code for a in alerts}
            if codes - self._last_alert_codes and reason == "interval":
                reason = "alert"
            self._last_alert_codes = codes
            self._stream_alert = False
            self._event_pending = False
            self._last_state = st
            self._next_beat = mono + self.interval
            progress = self.feed.snapshot()
            points, points_dropped = self.points.take() if self.points is not None else ([], 0)
            last_output_age = None if self._last_output_mono is None else round(mono - self._last_output_mono, 3)
        attempt = state.get("attempt")
        if attempt != self._secrets_attempt:  # an attempt re-reads its secrets (a rotated file): redact the new ones
            self._secrets_attempt = attempt
            self.log_tail.set_secrets(secret_values(self.ctx.config, self.ctx.environ))
        doc: Dict[str, Any] = {
            "schema": SCHEMA,
            "run": self.ctx.name,
            "box": self.box,
            "attempt": attempt if isinstance(attempt, int) else self.ctx.attempt(),
            "seq": self.seq.next(on_fault=self._fault(paths.HEARTBEAT_SEQ_FILE)),
            "time": wall,
            "reason": reason,
            "interval_s": self.interval,
            "state": st,
            "child": {"pid": pid if isinstance(pid, int) else None, "alive": alive,
                      "restarts": state.get("restarts"), "last_exit": state.get("last_exit"),
                      "last_output_age_s": last_output_age},
            "preemption": state.get("preemption"),
            # the run's deadline (onbox/supervisor/deadline.py): {at, source, ask_at, left_s, commit_estimate_s, ...}
            "deadline": _deadline(state.get("deadline"), wall),
            "slurm": self.slurm,  # job id, array task, node list, restart count (onbox/slurm/job.py); None outside
            "times": self.times.block(state, attempt),
            "progress": progress,
            # every record parsed since the previous beat (None: no sink draws curves)
            "points": beat_points(points, points_dropped) if self.points is not None else None,
            "checkpoint": checkpoint,
            # the run's lease on durable storage (onbox/checkpoints/fencing.py): epoch, holder, renewed_at, fenced
            "lease": (checkpoint or {}).get("lease") if isinstance((checkpoint or {}).get("lease"), dict) else None,
            "gpus": gpus,
            "host": host,
            "disks": disks,
            "alerts": [a.to_dict() for a in alerts],
            "phase": phase_fields(state.get("phase")),
            "node": self.node,
            "log_tail": self.log_tail.snapshot(),
            "spool": {"backlog": sum(s.spool.backlog() for s in self.senders),
                      "dropped": sum(s.spool.dropped for s in self.senders),
                      "errors": {s.sink.name: s.last_error for s in self.senders if s.last_error}},
        }
        doc = json_safe(doc)
        for sender in self.senders:
            shape = getattr(sender.sink, "spool_doc", None)  # a sink may keep less (and the points) in its spool
            sender.spool.put(doc["seq"], shape(doc, points, points_dropped) if shape else doc,
                             on_fault=self._fault(paths.HEARTBEAT_SPOOL_DIR % sender.sink.name))
            sender.notify()
        if self.points is not None:  # every record read so far is in a spooled beat now
            position = self.feed.metrics_file.position()
            if position != self._position_saved and self._written(paths.METRICS_POSITION_FILE, position):
                self._position_saved = position
        self._send_ping(reason, st, alerts)
        return doc

    def _read(self, what: str, reader: Any) -> Dict[str, Any]:
        try:
            return reader()
        except Exception as e:  # a reader bug must not stop the beat; it is reported in the beat itself
            log.exception("onbox heartbeat: reading %s failed", what)
            return {"available": False, "reason": "reading failed: %r" % e}

    def _disk_paths(self) -> List[Tuple[str, str]]:
        paths = [("run", self.ctx.run_dir), ("ckpt", self.ctx.ckpt_dir)]
        durable = self.ctx.config.durable
        if durable and ":" not in durable.split("/")[0]:  # a mounted path, not an rclone remote
            paths.append(("durable", durable))
        return paths

    def _checkpoint_status(self) -> Optional[Dict[str, Any]]:
        try:
            data = read_json(os.path.join(self.ctx.run_dir, paths.CHECKPOINT_STATUS_FILE))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _send_ping(self, reason: str, state: str, alerts: List[Any]) -> None:
        if self.ping is None:
            return
        if reason == "start":
            kind = "start"
        elif state.lower() in FAILED_STATES or any(a.severity == "critical" for a in alerts):
            kind = "fail"
        else:
            kind = "success"
        self.ping.ping_soon(kind, last=reason == "final", wait=self.close_timeout / 2)


def _deadline(block: Any, wall: float) -> Optional[Dict[str, Any]]:
    """state.json's `deadline` block with the time left as of this beat (None: the run has no deadline)."""
    if not isinstance(block, dict):
        return None
    out = dict(block)
    if isinstance(out.get("at"), (int, float)):
        out["left_s"] = round(out["at"] - wall, 3)
    return out


def sinks_for(cfg: Any, run: str, run_dir: str, box: str, request_timeout: float,
              emit: Callable[..., None]) -> List[Any]:
    """The sinks a run's configuration names: its tracker, its heartbeat file, its MLflow server (mlflow.py)."""
    sinks: List[Any] = []
    if cfg.tracker:
        sinks.append(TrackerSink(cfg.tracker, cfg.tracker_token_file, timeout=request_timeout))
    if cfg.heartbeat_file:
        sinks.append(FileSink(cfg.heartbeat_file))
    if cfg.mlflow:
        from onbox.heartbeat.mlflow import sink_for

        sinks.append(sink_for(cfg, run, run_dir, box, request_timeout, emit=emit))
    return sinks
