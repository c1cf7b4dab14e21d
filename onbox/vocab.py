"""The run's vocabulary: the words the agent, the tracker, the keeper and onboxctl share, spelled once.

Today: the alerts. Every alert an agent or onboxctl raises has a kind (`code`, a stable machine name) and a severity
(`warning`: look at it; `critical`: work is lost or about to be, act now). An alert travels as one document (a beat's
`alerts[]`, `onboxctl status --json`, the dashboard's "Open alerts"): {code, severity, message, hint, data}. The
agent's alert rules (onbox/telemetry/alerts.py), the warnings the supervisor keeps in state.json and the checkpoint
hook's in checkpoint_status.json all become such documents with the codes below; the tracker and onboxctl read them
back through `alert_from`, which keeps a code it does not know (a newer agent's) but never a severity outside the two.

Beside the alerts, the run's states and which of them mean it ended (every reader of a state.json, a beat or an
`onbox status --json` judges "ended" by TERMINAL_STATES / ENDED_STATES here, so that a new state cannot be missed by
one of them), and the `schema` ids of the documents onbox and onboxctl write and read. A leaf: it imports nothing of
onbox, so that every part may import it. tests/unit/test_vocab_rules.py fails on a state used as one, or a schema
id, spelled anywhere else.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

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


@dataclasses.dataclass(frozen=True)
class AlertKind:
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
