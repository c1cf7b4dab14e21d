"""The MLflow sink: one MLflow run per onbox run, fed from its own spool (`heartbeats/spool-mlflow/`) by its own
sender thread, so MLflow down never holds up the tracker or the heartbeat file, nor they it.

What goes to MLflow (REST only, onbox/heartbeat/mlflow_rest.py):
- params, once: command, profile, box, slurm_job, durable, restart policy. MLflow params never change: a relaunch
  that changes one keeps the first value as the param and puts the new one in the tag `onbox.changed.<param>`
  (box and slurm_job are expected to change: their current values are the tags `onbox.box`, `onbox.slurm_job`);
- tags, when they change: onbox.run (how the run is found again), onbox.state, onbox.attempt, onbox.box,
  onbox.restarts, onbox.alerts, onbox.slurm_job, onbox.points_dropped;
- metrics at the trainer's step: every metric record the agent parsed from the trainer's output or
  ONBOX_METRICS_FILE since the previous beat (loss, eval_loss, lr, tokens_per_s, ...), and each beat's readings
  under MLflow's own system-metric names (system/gpu_0_utilization_percentage, ...);
- the run status: FINISHED (done), FAILED (failed), KILLED (stopped). A preempted run stays RUNNING (tag
  onbox.state=preempted): it is meant to come back (requeue, relaunch); a run that comes back to life after an
  end is set RUNNING again.

MLflow appends metric points, so a resend would draw every point twice: the sink persists a delivery cursor
(`heartbeats/mlflow.json`: beats before `seq` are delivered, and the first `done` metric entries of beat `seq`),
advanced and fsynced after every acknowledged request. A retried batch, a restarted agent and a relaunch start
after it. What can still be sent twice: a request MLflow stored but whose answer never arrived (timeout, cut) —
resent identically (same key, value, timestamp, step), which MLflow's SQL store drops as a duplicate of its
primary key; a file store would keep both.

Each runs/log-batch request keeps MLflow's limits: <= 1000 metrics, <= 100 params, <= 100 tags, <= 1000 entities
in all, <= 1 MB; a beat with more is split over several requests (the cursor marks how far one got).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox import paths, vocab
from onbox.fsutil import atomic_write_json, read_json
from onbox.heartbeat.mlflow_rest import MlflowError, MlflowRest, auth_header
from onbox.heartbeat.sinks import Rejected, SinkError
from onbox.telemetry.metrics import FIELDS

MAX_METRICS, MAX_PARAMS_TAGS, MAX_ENTITIES, MAX_BYTES = 1000, 100, 1000, 1000000  # runs/log-batch limits
BYTE_BUDGET = MAX_BYTES - 64 * 1024  # room for the envelope and the tags
TAG_ROOM = 16  # entities kept back for the tags of a request (we send at most 9)
PARAM_VALUE_MAX, TAG_VALUE_MAX = 6000, 5000  # MLflow takes 6000 / 8000 characters
INT64_MAX = 2 ** 63 - 1
RUN_TAG = "onbox.run"
POINT_FIELDS = tuple(f for f in FIELDS if f != "step")
STATUS_OF_STATE = {vocab.DONE: "FINISHED", vocab.FAILED: "FAILED", vocab.STOPPED: "KILLED", vocab.FENCED: "KILLED"}  # anything else: RUNNING
VARYING_PARAMS = ("box", "slurm_job")  # a replacement box, a new job: the tags say what is current
GPU_METRICS = (("util_percent", "utilization_percentage", 1.0), ("memory_used_bytes", "memory_usage_megabytes", 1e-6),
               ("power_w", "power_usage_watts", 1.0), ("temperature_c", "temperature_celsius", 1.0))


def run_status(state: Any) -> str:
    return STATUS_OF_STATE.get(str(state), "RUNNING")


def mlflow_doc(beat: Dict[str, Any], points: List[Any], points_dropped: int) -> Dict[str, Any]:
    """What the MLflow spool keeps of a beat: the readings it turns into metrics and tags, and the metric points
    since the previous beat ([time_ms, step, {field: value}], values JSON-safe)."""
    gpus = [{k: g.get(k) for k in ("index", "util_percent", "memory_used_bytes", "memory_total_bytes", "power_w",
                                   "temperature_c")}
            for g in ((beat.get("gpus") or {}).get("gpus") or []) if isinstance(g, dict)]
    slurm = beat.get("slurm") or {}
    job = slurm.get("job_id")
    if job and slurm.get("array_task_id") is not None:
        job = "%s_%s" % (slurm.get("array_job_id") or job, slurm["array_task_id"])
    return {"seq": beat["seq"], "time": beat.get("time"), "state": beat.get("state"), "attempt": beat.get("attempt"),
            "box": beat.get("box"), "restarts": (beat.get("child") or {}).get("restarts"),
            "step": (beat.get("progress") or {}).get("step"), "slurm_job": job, "gpus": gpus,
            "memory_bytes": (beat.get("host") or {}).get("memory_current_bytes"),
            "alerts": sorted(str(a.get("code")) for a in beat.get("alerts") or [] if isinstance(a, dict)),
            "points": points, "points_dropped": points_dropped}


def _step(value: Any) -> int:
    return min(max(int(value), 0), INT64_MAX) if isinstance(value, (int, float)) and value == value else 0


def _number(value: Any) -> Any:
    """A metric value as MLflow's JSON takes it: a number, or "NaN" / "Infinity" / "-Infinity"; None: skip."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    return value if value in ("NaN", "Infinity", "-Infinity") else None


def metric_entries(doc: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The beat's metric points, in a fixed order (the cursor counts in it): the trainer's records, then the
    beat's system readings at the step of the beat."""
    out: List[Dict[str, Any]] = []
    for point in doc.get("points") or []:
        t_ms, step, values = point
        for field in POINT_FIELDS:
            v = _number(values.get(field))
            if v is not None:
                out.append({"key": field, "value": v, "timestamp": int(t_ms), "step": _step(step)})
    t_ms, step = int(float(doc.get("time") or 0) * 1000), _step(doc.get("step"))
    for g in doc.get("gpus") or []:
        for src, name, scale in GPU_METRICS:
            v = g.get(src)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append({"key": "system/gpu_%s_%s" % (g.get("index"), name), "value": v * scale,
                            "timestamp": t_ms, "step": step})
        used, total = g.get("memory_used_bytes"), g.get("memory_total_bytes")
        if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total > 0:
            out.append({"key": "system/gpu_%s_memory_usage_percentage" % g.get("index"),
                        "value": 100.0 * used / total, "timestamp": t_ms, "step": step})
    mem = doc.get("memory_bytes")
    if isinstance(mem, (int, float)) and not isinstance(mem, bool):
        out.append({"key": "system/system_memory_usage_megabytes", "value": mem * 1e-6, "timestamp": t_ms,
                    "step": step})
    return out


def beat_tags(doc: Dict[str, Any], dropped_total: int) -> Dict[str, str]:
    tags = {"onbox.state": str(doc.get("state")), "onbox.attempt": str(doc.get("attempt")),
            "onbox.box": str(doc.get("box")), "onbox.restarts": str(doc.get("restarts") or 0),
            "onbox.alerts": ",".join(doc.get("alerts") or []) or "none"}
    if doc.get("slurm_job"):
        tags["onbox.slurm_job"] = str(doc["slurm_job"])
    if dropped_total:
        tags["onbox.points_dropped"] = str(dropped_total)
    return {k: v[:TAG_VALUE_MAX] for k, v in tags.items()}


class MlflowSink:
    """send(beats) logs the beats' metrics and tags to the run (found or created on first use) and sets its
    status; `wants_points`: the hook spools the metric records since the previous beat with each beat."""

    name = "mlflow"
    wants_points = True
    down_hint = ("the run goes on; its beats wait in the spool (heartbeats/spool-mlflow) and go to MLflow, each "
                 "once, when it answers: check the --mlflow URL (`curl URL/health`) and the credentials "
                 "(MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD or --mlflow-token-file)")

    def __init__(self, url: str, experiment: str, run_name: str, params: Dict[str, str], state_path: str,
                 token_file: Optional[str] = None, timeout: float = 10.0,
                 environ: Optional[Dict[str, str]] = None,
                 emit: Optional[Callable[..., None]] = None) -> None:
        self.url = url.rstrip("/")
        self.experiment = experiment
        self.run_name = run_name
        self.params = {k: str(v)[:PARAM_VALUE_MAX] for k, v in params.items() if v not in (None, "")}
        self.state_path = state_path
        self.rest = MlflowRest(url, token_file, timeout, environ)
        self.emit = emit or (lambda *a, **k: None)
        st = self._load()
        same = st.get("url") == self.url and st.get("experiment") == experiment
        self.experiment_id: Optional[str] = st.get("experiment_id") if same else None
        self.run_id: Optional[str] = st.get("run_id") if same else None
        cur = st.get("cursor")
        self.cursor: Optional[Tuple[int, int]] = (int(cur[0]), int(cur[1])) if isinstance(cur, list) else None
        self.dropped_total = int(st.get("points_dropped") or 0)
        self.status: Optional[str] = None  # the run's status in MLflow, as far as we know
        self._tags: Dict[str, str] = {}  # what MLflow has of our per-beat tags
        self._attached = False

    @staticmethod
    def spool_doc(beat: Dict[str, Any], points: List[Any], points_dropped: int) -> Dict[str, Any]:
        return mlflow_doc(beat, points, points_dropped)

    # -- state
    def _load(self) -> Dict[str, Any]:
        try:
            doc = read_json(self.state_path)
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _save(self) -> None:
        atomic_write_json(self.state_path, {
            "url": self.url, "experiment": self.experiment, "experiment_id": self.experiment_id,
            "run_id": self.run_id, "run_name": self.run_name, "points_dropped": self.dropped_total,
            "cursor": list(self.cursor) if self.cursor else None,
            "run_url": "%s/#/experiments/%s/runs/%s" % (self.url, self.experiment_id, self.run_id)
            if self.run_id else None})

    # -- the run
    def _attach(self, first: Dict[str, Any]) -> None:
        """Find (or create) the experiment and the run, log the params it lacks. Once per agent, and again after
        the run vanished (deleted in MLflow)."""
        if self.experiment_id is None:
            self.experiment_id = self.rest.experiment_id(self.experiment)
        run = self.rest.get_run(self.run_id) if self.run_id else None
        created = False
        if run is None:
            run, created = self._find_or_create(first)
        self.run_id = str(run["info"]["run_id"])
        self.status = str(run["info"].get("status") or "RUNNING")
        self._log_params(run, first)
        self._attached = True
        self._save()
        self.emit("mlflow_run", run_id=self.run_id, experiment_id=self.experiment_id, experiment=self.experiment,
                  created=created, url="%s/#/experiments/%s/runs/%s" % (self.url, self.experiment_id, self.run_id))

    def _find_or_create(self, first: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
        assert self.experiment_id is not None
        runs = self.rest.runs_tagged(self.experiment_id, RUN_TAG, self.run_name)
        if runs:  # an earlier attempt, box or agent made it: every one of them writes into the oldest
            return runs[0], False
        mine = self.rest.create_run(self.experiment_id, self.run_name, int(time.time() * 1000),
                                    {RUN_TAG: self.run_name, "mlflow.source.name": "onbox", "mlflow.source.type": "JOB"})
        # Two boxes of the same run creating at once (a replacement box while the old one still beats): both look
        # again; the one that did not make the oldest run deletes its own (still empty) one and joins the oldest.
        runs = self.rest.runs_tagged(self.experiment_id, RUN_TAG, self.run_name)
        if runs and runs[0]["info"]["run_id"] != mine["info"]["run_id"]:
            self.rest.delete_run(mine["info"]["run_id"])
            return runs[0], False
        return mine, True

    def _log_params(self, run: Dict[str, Any], first: Dict[str, Any]) -> None:
        mine = dict(self.params)
        mine.setdefault("box", str(first.get("box") or ""))
        if first.get("slurm_job"):
            mine.setdefault("slurm_job", str(first["slurm_job"]))
        for _ in range(2):  # a second time when another box logged one at the same moment
            have = {p["key"]: p.get("value") for p in (run.get("data") or {}).get("params") or []}
            missing = {k: v for k, v in mine.items() if k not in have and v}
            changed = {k: v for k, v in mine.items() if k in have and have[k] != v and k not in VARYING_PARAMS}
            tags = {"onbox.changed.%s" % k: v[:TAG_VALUE_MAX] for k, v in changed.items()}
            try:
                items = sorted(missing.items())
                for i in range(0, max(len(items), 1), MAX_PARAMS_TAGS):
                    self.rest.log_batch(str(run["info"]["run_id"]), [], dict(items[i:i + MAX_PARAMS_TAGS]),
                                        tags if i == 0 else None)
            except MlflowError as e:  # INVALID_PARAMETER_VALUE: a param got another value meanwhile
                fresh = self.rest.get_run(str(run["info"]["run_id"]))
                if fresh is None:
                    raise SinkError("mlflow: the run vanished while its params were logged: %s" % e)
                run = fresh
                continue
            if changed:
                self.emit("mlflow_param_changed", params=sorted(changed), run_id=run["info"]["run_id"],
                          message="MLflow params never change: the first value stays, the new one is in the "
                                  "tag onbox.changed.<param>")
            return
        raise SinkError("mlflow: could not log the run's params")

    # -- delivery
    def send(self, beats: List[Dict[str, Any]]) -> None:
        if not beats:
            return
        if not self._attached:
            self._attach(beats[0])
        work = []  # (beat, its metric entries, the first entry not yet delivered)
        counted = set()  # beats whose dropped points are in dropped_total already
        for beat in beats:
            seq = int(beat["seq"])
            if self.cursor is not None and seq < self.cursor[0]:
                continue  # delivered before: the spool lost the ack (a crash between the two)
            start = self.cursor[1] if self.cursor is not None and seq == self.cursor[0] else 0
            entries = metric_entries(beat)
            if self.cursor is not None and seq == self.cursor[0] and start >= len(entries):
                counted.add(seq)  # the cursor rests at the end of a beat only once that beat was delivered whole
            work.append((beat, entries, start))
        i, pos = 0, (work[0][2] if work else 0)
        while i < len(work):
            # one request: entries from work[i][pos] on, as many as MLflow's limits allow
            metrics: List[Dict[str, Any]] = []
            size, j, p = 0, i, pos
            while j < len(work):
                entries = work[j][1]
                while p < len(entries) and len(metrics) < MAX_METRICS - TAG_ROOM:
                    n = len(entries[p]["key"]) + 100  # >= its JSON: numbers print in <= 24 characters
                    if metrics and size + n > BYTE_BUDGET:
                        break
                    metrics.append(entries[p])
                    size += n
                    p += 1
                if p < len(entries):
                    break  # full: beat j goes on in the next request
                j += 1
                p = work[j][2] if j < len(work) else 0
            # after this request work[i:j] are complete and work[j] (if any) is delivered up to entry p
            newest = work[j][0] if j < len(work) and p > 0 else work[j - 1][0]
            dropped = self.dropped_total + sum(int(b.get("points_dropped") or 0) for b, _, _ in work[i:j]
                                               if int(b["seq"]) not in counted)
            self._deliver(metrics, newest, dropped)
            self.dropped_total = dropped
            self.cursor = (int(work[j][0]["seq"]), p) if j < len(work) else (
                int(work[j - 1][0]["seq"]), len(work[j - 1][1]))
            self._save()  # fsynced before the next request: a restart resumes exactly here
            # every change of status in this request's beats, in order: a whole short life delivered in one
            # request (a relaunch of a finished run, behind a slow link) still reads RUNNING, then FINISHED with
            # its own end time, not a FINISHED that was never left
            for beat, _entries, _start in work[i:j]:
                self._set_status(beat)
            i, pos = j, p

    def _deliver(self, metrics: List[Dict[str, Any]], beat: Dict[str, Any], dropped_total: int) -> None:
        tags = {k: v for k, v in beat_tags(beat, dropped_total).items() if self._tags.get(k) != v}
        if not metrics and not tags:
            return
        assert self.run_id is not None
        run_id = self.run_id
        try:
            self.rest.log_batch(run_id, metrics, None, tags)
        except MlflowError as e:
            if self._run_gone(e):
                raise SinkError("mlflow: the run %s is gone (%s): the next try finds or makes another" % (
                    run_id, e.code))
            raise Rejected("mlflow refused runs/log-batch: %s" % e, e.status)
        self._tags.update(tags)

    def _run_gone(self, e: MlflowError) -> bool:
        """The run was deleted (or purged) in MLflow: forget it; the next send finds or makes one again."""
        gone = e.code == "RESOURCE_DOES_NOT_EXIST" or ("active" in e.message and "deleted" in e.message)
        if gone:
            self.run_id, self._attached, self._tags = None, False, {}
            self._save()
        return gone

    def _set_status(self, beat: Dict[str, Any]) -> None:
        status = run_status(beat.get("state"))
        if status == self.status:
            return
        assert self.run_id is not None
        end = int(float(beat.get("time") or time.time()) * 1000) if status != "RUNNING" else None
        try:
            self.rest.update_run(self.run_id, status, end)
        except MlflowError as e:
            if self._run_gone(e):
                raise SinkError("mlflow: the run is gone (%s)" % e.code)
            raise SinkError("mlflow: runs/update %s: %s" % (status, e))
        self.status = status

    def close(self) -> None:
        self.rest.close()


def sink_for(cfg: Any, run_name: str, run_dir: str, box: str, timeout: float,
             emit: Optional[Callable[..., None]] = None) -> MlflowSink:
    """The sink of `onbox run --mlflow URL`, its params from the run config (slurm_job from the first beat)."""
    import shlex

    params = {"command": shlex.join(cfg.command), "profile": cfg.profile, "box": box, "durable": cfg.durable,
              "restart": cfg.restart}
    return MlflowSink(cfg.mlflow, cfg.mlflow_experiment, run_name, params,
                      os.path.join(run_dir, paths.MLFLOW_RUN_FILE), cfg.mlflow_token_file, timeout, emit=emit)


def preflight(cfg: Any, environ: Optional[Mapping[str, str]] = None) -> None:
    """`onbox run --mlflow`, in the foreground: a token file that cannot be read, or is empty, is refused now (the
    URL and the experiment name were checked with the config)."""
    from onbox.errors import UsageError

    try:
        empty = bool(cfg.mlflow_token_file) and auth_header(cfg.mlflow_token_file, {}) is None
    except OSError as e:
        raise UsageError("cannot read the MLflow token file %s: %s" % (cfg.mlflow_token_file, e.strerror or e),
                         hint="put the token on the first line of a file (mode 600), or export "
                              "MLFLOW_TRACKING_TOKEN for the agent; never on the command line (U34)")
    if empty:
        raise UsageError("the MLflow token file %s is empty" % cfg.mlflow_token_file,
                         hint="the bearer token goes on its first line")
