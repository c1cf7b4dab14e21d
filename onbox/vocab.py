"""The run's vocabulary: the words the agent, the tracker, the keeper and onboxctl share, spelled once.

Today: the alerts. Every alert an agent or onboxctl raises has a kind (`code`, a stable machine name) and a severity
(`warning`: look at it; `critical`: work is lost or about to be, act now). An alert travels as one document (a beat's
`alerts[]`, `onboxctl status --json`, the dashboard's "Open alerts"): {code, severity, message, hint, data}. The
agent's alert rules (onbox/telemetry/alerts.py), the warnings the supervisor keeps in state.json and the checkpoint
hook's in checkpoint_status.json all become such documents with the codes below; the tracker and onboxctl read them
back through `alert_from`, which keeps a code it does not know (a newer agent's) but never a severity outside the two.

Beside the alerts, the run's states and which of them mean it ended (every reader of a state.json, a beat or an
`onbox status --json` judges "ended" by TERMINAL_STATES / ENDED_STATES here, so that a new state cannot be missed by
one of them), the `schema` ids of the documents onbox and onboxctl write and read, and the event types: the agent's
(events.jsonl) and the keeper's (its record, the tracker's events), each with what it means. A leaf: it imports
nothing of onbox, so that every part may import it. tests/unit/test_vocab_rules.py fails on a state used as one, a
schema id or an event type compared, spelled anywhere else, and on an event emitted that is not in the tables here.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional

# The run's states (state.json's `state`, a beat's, `onbox status --json`'s). onbox/supervisor/state.py's RunState
# takes its values from here and holds the legal transitions and the exit codes.
STARTING = "starting"
RUNNING = "running"
BACKOFF = "backoff"  # its child exited and a restart follows, after the backoff
STOPPING = "stopping"  # a notice, a stop or a fence is being handled: the trainer checkpoints and exits
DONE = "done"
FAILED = "failed"
PREEMPTED = "preempted"
STOPPED = "stopped"
FENCED = "fenced"  # a newer lease holds the run: another agent took it over
LIVE_STATES = (STARTING, RUNNING, BACKOFF, STOPPING)  # an agent is at work on the run
TERMINAL_STATES = (DONE, FAILED, PREEMPTED, STOPPED, FENCED)  # the run ended: only a new start changes it
RUN_STATES = LIVE_STATES + TERMINAL_STATES
# Words an older agent or another client wrote into a beat's state (the tracker accepts any string): read, never
# written by this onbox.
CRASH_LOOP, CRASHLOOP, SUCCEEDED, EXITED = "crash_loop", "crashloop", "succeeded", "exited"
RESTARTING, PREEMPTING = "restarting", "preempting"
# What a reader of beats takes for a run that ended / ended failing / ended as it was meant to / is at work.
ENDED_STATES = frozenset((*TERMINAL_STATES, CRASH_LOOP, CRASHLOOP, SUCCEEDED, EXITED))
FAILED_STATES = frozenset({FAILED, CRASH_LOOP, CRASHLOOP})
CLEAN_STATES = frozenset({DONE, STOPPED, SUCCEEDED, EXITED})
BEAT_LIVE_STATES = frozenset((*LIVE_STATES, RESTARTING, PREEMPTING))

# What `onbox stop --json` did (its `outcome`), as onboxctl stop reads it.
STOP_ASKED = "asked"  # the live agent has the request
STOP_STOPPED = "stopped"  # the run stopped (--wait)
STOP_ALREADY_ENDED = "already_ended"
STOP_NOTHING = "nothing_to_stop"  # no live agent and no live trainer
STOP_OUTCOMES = (STOP_ASKED, STOP_STOPPED, STOP_ALREADY_ENDED, STOP_NOTHING)

# How an attempt's exit is classified (an `exit` event's and state.json's `classification`): onbox/supervisor/exits.py
# tells them and holds what each means; the crash-loop alert, the keeper and onboxctl stop read them.
EXIT_SUCCESS = "success"
EXIT_FAILED = "failed"  # a non-zero exit code, its cause not recognised
EXIT_SIGNALED = "signal"  # killed by a signal, its cause not recognised
EXIT_HOST_OOM, EXIT_CUDA_OOM = "host_oom", "cuda_oom"
EXIT_NCCL_TIMEOUT, EXIT_NCCL_ERROR = "nccl_timeout", "nccl_error"
EXIT_DISK_FULL, EXIT_GPU_ERROR = "disk_full", "gpu_error"
EXIT_NO_GPU_RUNTIME = "no_gpu_runtime"  # a container job: docker cannot give the container GPUs
EXIT_PREEMPTED, EXIT_STOPPED = "preempted", "stopped"
EXIT_SESSION_LIMIT = "session_limit"  # the run's deadline: stopped in time, a relaunch continues
EXIT_FENCED = "fenced"  # a newer lease holds the run: the agent stopped its own trainer
EXIT_UNKNOWN = "unknown"  # the exit status cannot be known (an adopted child whose keeper was killed)
EXIT_HUNG = "hung"  # no step, no output, no checkpoint write past its bound: the agent stopped it
EXIT_CLASSES = (EXIT_SUCCESS, EXIT_FAILED, EXIT_SIGNALED, EXIT_HOST_OOM, EXIT_CUDA_OOM, EXIT_NCCL_TIMEOUT,
                EXIT_NCCL_ERROR, EXIT_DISK_FULL, EXIT_GPU_ERROR, EXIT_NO_GPU_RUNTIME, EXIT_PREEMPTED, EXIT_STOPPED,
                EXIT_SESSION_LIMIT, EXIT_FENCED, EXIT_UNKNOWN, EXIT_HUNG)

# The `schema` ids of the documents onbox and onboxctl write (state files, `--json` output) and read back: a reader
# refuses a document whose schema is not the one it knows.
SCHEMA_HEARTBEAT = "onbox.heartbeat/1"
SCHEMA_STATUS = "onbox.status/1"  # onbox status --json
SCHEMA_STOP = "onbox.stop/1"  # onbox stop --json
SCHEMA_CHECKPOINTS = "onbox.checkpoints/1"  # onbox checkpoints RUN --json
SCHEMA_CHECKPOINTS_LIST = "onbox.checkpoints_list/1"  # onbox checkpoints --all --json
SCHEMA_QUEUE = "onbox.queue/1"  # onbox queue --json
SCHEMA_MATCH = "onbox.match/1"  # onbox match --json
SCHEMA_AUDIT = "onbox.audit/1"  # onbox audit --json
SCHEMA_NODE_PROBE = "onbox.node_probe/1"  # onbox node-probe
SCHEMA_NODE_GROUP = "onbox.node_group/1"  # a node's group file under $ONBOX_HOME/nodes/
SCHEMA_CHILD_EXIT = "onbox.child_exit/1"  # the shim's exit record of an adopted child
SCHEMA_CHECKPOINT_STATUS = "onbox.checkpoint_status/1"  # checkpoint_status.json
SCHEMA_MANIFEST = "onbox.manifest/1"  # a durable checkpoint's manifest
SCHEMA_INDEX = "onbox.checkpoints_index/2"  # the durable index (a superset of /1)
SCHEMA_INDEX_V1 = "onbox.checkpoints_index/1"
SCHEMA_LEASE = "onbox.lease/1"  # the run's lease on durable storage
SCHEMA_KAGGLE_PUSH = "onbox.kaggle.push/1"  # onboxctl kaggle push --json
SCHEMA_KAGGLE_STATUS = "onbox.kaggle.status/1"  # onboxctl kaggle status --json
SCHEMA_RECOVERY = "onboxctl.recovery/1"  # the keeper's recovery record
SCHEMA_KEEP_PASS = "onboxctl.keep_pass/1"  # onboxctl keep --once --json
SCHEMA_LAUNCH = "onboxctl.launch/1"  # the keeper's launch record
SCHEMA_LAUNCHES = "onboxctl.launches/1"  # onboxctl's launch log

WARNING = "warning"
CRITICAL = "critical"
SEVERITIES = (WARNING, CRITICAL)

CODE_CHARS = 64  # an alert code from outside is cut here (the heartbeat schema's bound)
MESSAGE_CHARS = 500  # ... its message and its hint here (what a table line or a page shows)


class AlertKind(NamedTuple):  # a NamedTuple, not a dataclass: `onbox status --json` imports this module (start-up)
    code: str
    severity: str  # the default; a warning of the supervisor may say its own (a hang that recovered: warning)
    means: str  # a few words: what a person reads in a legend


_KINDS = (
    # the loss stream and the beat's readings (onbox/telemetry/alerts.py)
    AlertKind("nan_loss", CRITICAL, "the loss is NaN or infinite: the run diverged"),
    AlertKind("loss_spike", WARNING, "the loss spiked far above its recent median"),
    AlertKind("stall", CRITICAL, "no new step and no output for a long time while the trainer lives"),
    AlertKind("low_disk", CRITICAL, "a disk the run writes to is nearly full"),
    AlertKind("low_inodes", CRITICAL, "a disk the run writes to is nearly out of inodes"),
    AlertKind("gpu_dead", CRITICAL, "a GPU is dead (Xid 48/79, fell off the bus)"),
    AlertKind("gpu_pinned", WARNING, "a process that is not this run holds GPU memory"),
    AlertKind("gpu_throttle", WARNING, "a GPU is throttled (power, thermal)"),
    AlertKind("xid", CRITICAL, "a GPU reported an Xid error"),
    AlertKind("host_oom_kill", CRITICAL, "the container's OOM killer killed a process"),
    AlertKind("sync_failed", CRITICAL, "the last checkpoint commit failed: durable storage is not current"),
    AlertKind("crash_loop", CRITICAL, "the last attempts failed the same way"),
    AlertKind("resume_backwards", CRITICAL, "the trainer resumed far below the checkpoint onbox restored"),
    # the supervisor's warnings in state.json (onbox/supervisor/notes.py)
    AlertKind("thread_died", CRITICAL, "a thread of the agent died"),
    AlertKind("sink_down", WARNING, "heartbeats to a sink are failing (spooled meanwhile)"),
    AlertKind("run_dir_unwritable", CRITICAL, "the run directory refuses writes"),
    AlertKind("hang", CRITICAL, "the trainer hung"),
    AlertKind("no_metrics", WARNING, "the trainer's output holds no metric onbox recognises"),
    AlertKind("node_resume_failed", CRITICAL, "a node could not start from node 0's checkpoint"),
    AlertKind("node_resume_mismatch", CRITICAL, "a node's checkpoint is not node 0's"),
    AlertKind("node_resume_fallback", CRITICAL, "a node fell back to an older checkpoint than node 0's"),
    AlertKind("checkpoint_unreadable", CRITICAL, "the newest checkpoint cannot be read on the box: not committed"),
    AlertKind("resume_from_scratch", CRITICAL, "the attempt started from scratch although checkpoints exist"),
    # the checkpoint hook's warnings in checkpoint_status.json (onbox/checkpoints/hook/)
    AlertKind("no_checkpoint", WARNING, "nothing in the checkpoint dir counts as a checkpoint: nothing is committed"),
    AlertKind("checkpoint_dir_too_large", CRITICAL, "the checkpoint dir is too large to scan: nothing is committed"),
    # onboxctl's own (controller/goodput/atrisk.py)
    AlertKind("at_risk", WARNING, "the training since the newest durable checkpoint passed --max-at-risk"),
)
ALERT_KINDS: Dict[str, AlertKind] = {k.code: k for k in _KINDS}
NO_CHECKPOINT = "no_checkpoint"
CHECKPOINT_DIR_TOO_LARGE = "checkpoint_dir_too_large"
RESUME_BACKWARDS = "resume_backwards"


class EventType(NamedTuple):
    name: str  # an event's `type` in events.jsonl (the agent's), or its `kind` (the keeper's)
    means: str  # a few words: what happened


# The agent's events: one JSON object a line in the run's events.jsonl, {time, type, run, attempt, ...}, also fed to
# the telemetry hooks (the beat's times, the resume check) and the run's notes. Every `emit("...")` writes a type
# of this table (tests/unit/test_vocab_rules.py); a reader compares against the EV_ names below.
_EVENTS = (
    # the supervisor (onbox/supervisor/)
    EventType("state", "the run's state changed: old, new and why"),
    EventType("exit", "the trainer exited: its code, signal and classification"),
    EventType("adopted", "a new agent adopted the child an earlier agent started"),
    EventType("log_rotated", "the trainer's output log was rotated"),
    EventType("hook_error", "a subsystem hook raised: said, the supervision goes on"),
    EventType("run_dir_unwritable", "the run directory refuses writes: state and events held in memory"),
    EventType("run_dir_writable", "the run directory takes writes again: what was held is written"),
    EventType("thread_died", "a thread of the agent died (notices, heartbeats, lease, peers)"),
    EventType("preemption_notice", "a preemption notice came: the trainer is told to checkpoint and exit"),
    EventType("notice_ignored", "a notice came while a stop was already under way"),
    EventType("stop_grace_ignored", "a stop request's grace was out of range: the configured one holds"),
    EventType("signal_forwarded", "the checkpoint signal (or a phase's end) was sent to the trainer"),
    EventType("escalated", "the trainer outlived its grace: SIGTERM, then SIGKILL"),
    EventType("final_checkpoint", "the run's end: its final commit, with its summary"),
    EventType("session_limit", "the run's deadline came: checkpointed, with how to continue"),
    EventType("attempt_leftovers_signal", "processes the last attempt left behind were signalled"),
    EventType("attempt_leftovers_stopped", "the last attempt's leftover processes are gone"),
    EventType("hang_detected", "the trainer hung: no step, no output, no checkpoint write"),
    EventType("hang_action", "what was done about a hang (stacks dumped, restarted, stopped)"),
    EventType("hang_recovered", "a hung trainer reported a step again"),
    EventType("peer_restart_ignored", "a peer's restart notice came while this node's trainer was not running"),
    EventType("phase_started", "a phase of the run started"),
    EventType("phase_resumed", "a phase resumed from a checkpoint"),
    EventType("phase_target_reached", "a phase reached its target steps: it is told to end"),
    EventType("phase_end_escalated", "a phase's trainer outlived its end's grace: killed"),
    EventType("phase_completed", "a phase ended meeting its criteria"),
    EventType("phase_failed", "a phase ended failing its criteria"),
    # Slurm (onbox/slurm/)
    EventType("requeue", "the Slurm job was requeued, or the requeue failed (ok)"),
    EventType("requeue_skipped", "the Slurm job was not requeued, and why"),
    # the checkpoints (onbox/checkpoints/)
    EventType("checkpoint_commit_started", "a commit of a checkpoint to durable storage began"),
    EventType("checkpoint_committed", "a checkpoint is on durable storage, verified"),
    EventType("checkpoint_commit_aborted", "a commit was given up (the source changed, a stop)"),
    EventType("checkpoint_refused", "a checkpoint was refused (unsafe names, a bad manifest)"),
    EventType("checkpoint_leftovers_cleaned", "an earlier agent's unfinished commit was removed"),
    EventType("checkpoints_retired", "durable checkpoints past the retention were removed"),
    EventType("durable_full", "durable storage is full: the commit failed"),
    EventType("sync_failed", "a commit to durable storage failed"),
    EventType("retention_failed", "removing a durable checkpoint past the retention failed"),
    EventType("log_sync_failed", "copying the run's logs to durable storage failed"),
    EventType("checkpoint_scan_failed", "scanning the checkpoint dir failed"),
    EventType("checkpoint_status_unwritable", "checkpoint_status.json could not be written"),
    EventType("checkpoint_dir_too_large", "the checkpoint dir is too large to scan: nothing is committed"),
    EventType("checkpoint_unreadable", "the newest checkpoint cannot be read on the box: not committed"),
    EventType("checkpoint_readable", "the checkpoint that could not be read can be again"),
    EventType("no_checkpoint_yet", "nothing in the checkpoint dir counts as a checkpoint yet"),
    EventType("local_pruned", "old local checkpoints were removed"),
    EventType("local_prune_failed", "removing an old local checkpoint failed"),
    EventType("final_sync_skipped", "the final commit was skipped: it could not finish before the deadline"),
    EventType("final_sync_none", "no final commit: fenced, a commit still running, or nothing complete"),
    EventType("checkpoint_resume", "the attempt starts from a checkpoint: which, its step, its source"),
    EventType("checkpoint_restored", "a durable checkpoint was fetched and verified onto the box"),
    EventType("checkpoint_restore_state", "the restore's state file for the trainer was written"),
    EventType("checkpoint_set_aside", "a local checkpoint was moved aside so the restored one takes its place"),
    EventType("set_aside_failed", "moving a local checkpoint aside failed"),
    EventType("restore_blocked_locally", "a durable checkpoint cannot be restored into the local dir"),
    EventType("restore_verify_failed", "a fetched checkpoint failed its verification"),
    EventType("restore_failed", "the restore failed: the attempt may start without it"),
    EventType("restore_durable_skipped", "the restore from durable storage was skipped (a commit still runs)"),
    EventType("restore_fallback_exhausted", "no older checkpoint was left to fall back to in time"),
    EventType("resume_from_scratch", "the attempt starts from scratch although checkpoints exist"),
    EventType("checkpoint_quarantined", "a checkpoint that failed was moved to quarantine/"),
    EventType("quarantine_failed", "moving a failed checkpoint to quarantine/ failed"),
    EventType("quarantine_skipped", "a failed checkpoint was not quarantined (a commit still runs)"),
    EventType("index_update_failed", "the durable index could not be updated"),
    # the lease on durable storage (onbox/checkpoints/leases/)
    EventType("lease_taken", "this agent took the run's lease: its epoch and holder"),
    EventType("lease_taken_over", "this agent took the lease over from a live one (--take-over)"),
    EventType("lease_unreadable", "the previous lease could not be read"),
    EventType("lease_missing", "this agent's lease is gone from durable storage"),
    EventType("lease_renew_failed", "renewing the lease failed"),
    EventType("lease_check_failed", "the fence check could not read durable storage"),
    EventType("lease_check_ok", "the fence check reads durable storage again"),
    EventType("lease_release_failed", "releasing the lease at the end failed"),
    EventType("lease_released", "the lease was released at the run's end"),
    EventType("fenced", "a newer lease holds the run: this agent writes no more"),
    # multi-node groups (onbox/multinode/)
    EventType("commit_skipped", "this node does not commit: node 0 does"),
    EventType("node_resume", "this node starts as node 0 does (or without a checkpoint)"),
    EventType("node_resume_failed", "a node could not start from node 0's checkpoint"),
    EventType("node_resume_mismatch", "a node's checkpoint is not node 0's"),
    EventType("node_resume_fallback", "a node fell back to an older checkpoint than node 0's"),
    EventType("peers_listening", "this node listens for its peers' notices"),
    EventType("peer_notice_sent", "a stop, preemption or restart was told to the other nodes"),
    EventType("peer_notice", "a peer told this node of a stop, preemption or restart"),
    # GPUs (onbox/gpu/)
    EventType("reap_signal", "a process holding the run's GPUs was signalled"),
    EventType("reaped", "the processes holding the run's GPUs, and what became of each"),
    # the heartbeat and its sinks (onbox/heartbeat/)
    EventType("heartbeat_sink_down", "heartbeats to a sink fail: they are spooled"),
    EventType("heartbeat_sink_up", "a sink takes heartbeats again"),
    EventType("metrics_unrecognised", "the trainer printed for a while and no line was a metric"),
    EventType("metrics_recognised", "a metric was recognised after all"),
    EventType("resume_backwards", "the trainer resumed far below the checkpoint onbox restored"),
    EventType("mlflow_run", "the MLflow run the beats are logged to"),
    EventType("mlflow_param_changed", "a parameter differs from the MLflow run's"),
)
EVENT_TYPES: Dict[str, EventType] = {e.name: e for e in _EVENTS}
# The types a reader compares against (tests/unit/test_vocab_rules.py: each is one of EVENT_TYPES).
EV_STATE, EV_ADOPTED, EV_THREAD_DIED = "state", "adopted", "thread_died"
EV_RUN_DIR_UNWRITABLE, EV_RUN_DIR_WRITABLE = "run_dir_unwritable", "run_dir_writable"
EV_HANG_DETECTED, EV_HANG_ACTION, EV_HANG_RECOVERED = "hang_detected", "hang_action", "hang_recovered"
EV_PHASE_STARTED = "phase_started"
EV_REQUEUE, EV_REQUEUE_SKIPPED = "requeue", "requeue_skipped"
EV_CHECKPOINT_COMMITTED, EV_SYNC_FAILED, EV_DURABLE_FULL = "checkpoint_committed", "sync_failed", "durable_full"
EV_CHECKPOINT_UNREADABLE, EV_CHECKPOINT_READABLE = "checkpoint_unreadable", "checkpoint_readable"
EV_LOCAL_PRUNED, EV_FINAL_CHECKPOINT = "local_pruned", "final_checkpoint"
EV_FINAL_SYNC_NONE, EV_FINAL_SYNC_SKIPPED = "final_sync_none", "final_sync_skipped"
EV_CHECKPOINT_RESUME, EV_CHECKPOINT_RESTORED = "checkpoint_resume", "checkpoint_restored"
EV_RESTORE_FAILED, EV_RESUME_FROM_SCRATCH = "restore_failed", "resume_from_scratch"
EV_LEASE_TAKEN, EV_LEASE_TAKEN_OVER, EV_LEASE_UNREADABLE = "lease_taken", "lease_taken_over", "lease_unreadable"
EV_NODE_RESUME, EV_NODE_RESUME_FAILED = "node_resume", "node_resume_failed"
EV_NODE_RESUME_MISMATCH, EV_NODE_RESUME_FALLBACK = "node_resume_mismatch", "node_resume_fallback"
EV_HEARTBEAT_SINK_DOWN, EV_HEARTBEAT_SINK_UP = "heartbeat_sink_down", "heartbeat_sink_up"
EV_METRICS_UNRECOGNISED, EV_METRICS_RECOGNISED = "metrics_unrecognised", "metrics_recognised"
EV_RESUME_BACKWARDS = "resume_backwards"

# The keeper's events (controller/keeper/): its decisions about a run it keeps, each {time, run, kind, text, ...} in
# its record and sent to the tracker (`source` "keeper"), which shows them on the run page and the dashboard.
_KEEPER_EVENTS = (
    EventType("launched", "the run was launched by `onboxctl run` and is kept from now"),
    EventType("spares_unfit", "no spare of the pool can take the run"),
    EventType("suspect", "the run's beats are late: the keeper looks closer"),
    EventType("suspect_cleared", "the run is not lost after all"),
    EventType("keeper_blind", "the keeper cannot see (no tracker, no network): it declares nothing lost"),
    EventType("keeper_sees_again", "the keeper sees again: every doubt starts over"),
    EventType("tracker_unreadable", "the run's beats cannot be read from the tracker"),
    EventType("tracker_readable", "the run's beats can be read again"),
    EventType("needs_a_person", "the keeper cannot tell what happened: a person must look"),
    EventType("ended", "the run ended: the keeper leaves it alone"),
    EventType("detected", "a recovery began: the run is lost, or seems so"),
    EventType("declared_lost", "the run's boxes are declared lost: it is recovered elsewhere"),
    EventType("box_chosen", "the box(es) the run is relaunched on"),
    EventType("spare_skipped", "a spare was passed over, and why"),
    EventType("no_box", "no box to relaunch on yet: tried again later"),
    EventType("provisioned", "the provision command brought up a box"),
    EventType("provision_failed", "the provision command failed, or its box cannot take the run"),
    EventType("provision_leftovers", "processes the provision command left running were stopped"),
    EventType("provision_output_cut", "the provision command printed too much: only its tail was read"),
    EventType("pushed", "onbox.pyz (and the code) was pushed to the chosen box"),
    EventType("box_failed", "the chosen box stopped answering before the relaunch"),
    EventType("launch_failed", "a relaunch failed: tried again later"),
    EventType("launch_in_flight", "an earlier keeper's launch may still land: waited for"),
    EventType("recovery_cancelled", "a recovery was called off before its take-over"),
    EventType("relaunched", "the run was relaunched"),
    EventType("first_new_step", "the relaunched run trains again"),
    EventType("failed_no_resource", "the keeper gave up: no box"),
    EventType("failed_max_recoveries", "the keeper gave up: the run reached its most recoveries"),
    EventType("failed_launch", "the keeper gave up: the relaunch kept failing"),
    # said in `onboxctl keep`'s output, not in a run's record
    EventType("record_problem", "a keeper record cannot be read or written"),
    EventType("tracker_problem", "the tracker cannot be reached"),
    EventType("spare_warmed", "onbox.pyz was pushed to an idle spare that had none, before any loss"),
)
KEEPER_EVENTS: Dict[str, EventType] = {e.name: e for e in _KEEPER_EVENTS}
KEPT_LAUNCHED, KEPT_ENDED, KEPT_SUSPECT_CLEARED = "launched", "ended", "suspect_cleared"
KEPT_FIRST_NEW_STEP, KEPT_LAUNCH_IN_FLIGHT = "first_new_step", "launch_in_flight"
KEPT_FAILED_NO_RESOURCE, KEPT_FAILED_MAX_RECOVERIES = "failed_no_resource", "failed_max_recoveries"
KEPT_FAILED_LAUNCH, KEPT_NEEDS_A_PERSON = "failed_launch", "needs_a_person"
KEPT_PROVISION_LEFTOVERS, KEPT_PROVISION_OUTPUT_CUT = "provision_leftovers", "provision_output_cut"
KEPT_RECORD_PROBLEM, KEPT_TRACKER_PROBLEM = "record_problem", "tracker_problem"
KEPT_SPARE_WARMED = "spare_warmed"


def severity_of(code: str, said: Any = None) -> str:
    """The severity of an alert: what its raiser said when that is one of SEVERITIES, else its kind's default, else
    a warning (a code this onbox does not know)."""
    if said in SEVERITIES:
        return str(said)
    kind = ALERT_KINDS.get(code)
    return kind.severity if kind is not None else WARNING


def alert_doc(code: str, message: str, hint: str = "", severity: Optional[str] = None,
              data: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """One alert as it travels (a beat's alerts[], onboxctl status --json): {code, severity, message, hint, data}."""
    return {"code": code, "severity": severity_of(code, severity), "message": message, "hint": hint,
            "data": dict(data or {})}


def alert_from(doc: Any) -> Optional[Dict[str, Any]]:
    """An alert document from outside (a beat, a box's `onbox status --json`), its fields checked and bounded:
    {code, severity, message, hint}; None when it is no alert (no code). A plain string is a code alone (an older
    beat). The text is still outside text: whoever prints it makes it printable."""
    if isinstance(doc, str):
        doc = {"code": doc}
    if not isinstance(doc, Mapping):
        return None
    code = doc.get("code") if doc.get("code") is not None else doc.get("kind")
    if not isinstance(code, str) or not code:
        return None
    code = code[:CODE_CHARS]

    def text(v: Any) -> str:
        return str(v)[:MESSAGE_CHARS] if v is not None else ""

    return {"code": code, "severity": severity_of(code, doc.get("severity")), "message": text(doc.get("message")),
            "hint": text(doc.get("hint"))}
