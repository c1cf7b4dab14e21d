"""What the supervisor learns from events and must show: a background thread that died, a hung trainer (what was
seen, where its stacks are, what was done about it, whether it came back), a run whose output no metric parser
recognises, a heartbeat sink that is down (until it answers again), a run directory that refuses
writes (until it takes them again), the Slurm requeue outcome, and when training_status.md is due again.

Events reach `RunNotes.on_event` from any thread (the metadata poller, the heartbeat senders and the checkpoint
commit thread all emit through the supervisor), so the notes are kept under a lock and the loop takes them at its
next tick: a warning lands in state.json (`warnings`), hence in `onbox status`, training_status.md and the
heartbeat's alerts. Never silence: a dead thread used to leave preemption notices off without a word.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

from onbox import vocab

# Events after which training_status.md says something new (a commit, a failed sync, a restore, ...).
SUMMARY_EVENTS = {vocab.EV_CHECKPOINT_COMMITTED, vocab.EV_SYNC_FAILED, vocab.EV_DURABLE_FULL,
                  vocab.EV_CHECKPOINT_RESTORED, vocab.EV_CHECKPOINT_RESUME, vocab.EV_RESTORE_FAILED,
                  vocab.EV_LOCAL_PRUNED, vocab.EV_FINAL_CHECKPOINT, vocab.EV_FINAL_SYNC_NONE,
                  vocab.EV_FINAL_SYNC_SKIPPED}
# A node of a multi-node group that could not start from node 0's checkpoint (onbox/multinode/hooks.py).
NODE_RESUME_PROBLEMS = {vocab.EV_NODE_RESUME_FAILED, vocab.EV_NODE_RESUME_MISMATCH, vocab.EV_NODE_RESUME_FALLBACK}
HANG_EVENTS = {vocab.EV_HANG_DETECTED, vocab.EV_HANG_ACTION, vocab.EV_HANG_RECOVERED}  # onbox/supervisor/hang.py
HANG_HINT = ("read the stacks in %s: the frame each process waits in tells which rank or worker is stuck; a hang that "
             "repeats is not fixed by restarting (look for a dead or slow rank, a stuck DataLoader worker, the "
             "interconnect: NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO)")
AGENT_RESTART_HINT = ("restart the agent to restart its threads: `kill -KILL %s` (the child keeps running), then "
                      "`onbox adopt %s`")


class RunNotes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warnings: Dict[str, Dict[str, Any]] = {}
        self._requeue: Optional[Dict[str, Any]] = None
        self._status_due = False
        self._state_due = False

    def on_event(self, ev: Dict[str, Any]) -> None:
        kind = ev.get("type")
        with self._lock:
            if kind == vocab.EV_THREAD_DIED:
                key = "thread_died:%s" % ev.get("thread")
                self._warnings[key] = {"code": "thread_died", "severity": "critical", "at": ev.get("time"),
                                       "thread": ev.get("thread"),
                                       "message": "%s stopped: the agent's thread %s died (%s)" % (
                                           ev.get("what"), ev.get("thread"), ev.get("error")),
                                       "hint": ev.get("hint")}
                self._state_due = True
            elif kind == vocab.EV_HEARTBEAT_SINK_DOWN:
                self._warnings["sink_down:%s" % ev.get("sink")] = {
                    "code": "sink_down", "severity": "warning", "at": ev.get("time"), "sink": ev.get("sink"),
                    "message": "heartbeats to %s are failing: %s" % (ev.get("sink"), ev.get("error")),
                    "hint": ev.get("hint")}
                self._state_due = True
            elif kind == vocab.EV_HEARTBEAT_SINK_UP and self._warnings.pop("sink_down:%s" % ev.get("sink"), None):
                self._state_due = True
            elif kind == vocab.EV_RUN_DIR_UNWRITABLE:  # onbox/supervisor/records.py
                self._warnings["run_dir_unwritable"] = {
                    "code": "run_dir_unwritable", "severity": "critical", "at": ev.get("time"),
                    "message": "the run directory refuses writes (%s: %s, writing %s): the agent supervises on and "
                               "holds the newest state in memory; state.json and events.jsonl are stale"
                               % (ev.get("errno"), ev.get("error"), ev.get("what")),
                    "hint": ev.get("hint")}
                self._state_due = True
            elif kind == vocab.EV_RUN_DIR_WRITABLE and self._warnings.pop("run_dir_unwritable", None) is not None:
                self._state_due = True
            elif kind in HANG_EVENTS:
                self._hang(kind, ev)
                self._state_due = True
            elif kind == vocab.EV_METRICS_UNRECOGNISED:
                self._warnings["no_metrics"] = {"code": "no_metrics", "severity": "warning", "at": ev.get("time"),
                                                "message": ev.get("message"), "hint": ev.get("hint")}
                self._state_due = True
            elif kind == vocab.EV_METRICS_RECOGNISED and self._warnings.pop("no_metrics", None) is not None:
                self._state_due = True
            elif kind in NODE_RESUME_PROBLEMS:
                self._warnings["node_resume"] = {"code": kind, "severity": "critical", "at": ev.get("time"),
                                                 "message": "this node may not resume from node 0's step: %s"
                                                 % ev.get("reason"),
                                                 "hint": "stop the group and relaunch it with a --durable every "
                                                         "node reaches (an rclone remote or a shared mount)"}
                self._state_due = True
            elif kind == vocab.EV_CHECKPOINT_UNREADABLE:
                self._warnings["unreadable"] = {
                    "code": "checkpoint_unreadable", "severity": "critical", "at": ev.get("time"),
                    "message": "the newest checkpoint %s cannot be read here (%s): it is not committed, and a "
                               "restart resumes from an older one" % (ev.get("checkpoint"), ev.get("problem")),
                    "hint": "check its permissions and the disk (`ls -l %s`, dmesg for I/O errors)" % ev.get("path")}
                self._state_due = True
            elif kind == vocab.EV_CHECKPOINT_READABLE and self._warnings.pop("unreadable", None) is not None:
                self._state_due = True
            elif kind == vocab.EV_RESUME_FROM_SCRATCH:
                self._warnings["from_scratch"] = {
                    "code": "resume_from_scratch", "severity": "critical", "at": ev.get("time"),
                    "message": "the attempt starts from scratch: %s" % ev.get("why"),
                    "hint": "see `onbox checkpoints` and the run's events (checkpoint_refused, restore_verify_failed) "
                            "for why; refused checkpoints are kept whole in <durable>/<run>/quarantine/"}
                self._state_due = True
            elif kind == vocab.EV_RESUME_BACKWARDS:  # onbox/telemetry/resumecheck.py: for the rest of the attempt
                from onbox.telemetry import resumecheck

                self._warnings["resume_backwards"] = {
                    "code": "resume_backwards", "severity": "critical", "at": ev.get("time"),
                    "message": resumecheck.describe(ev), "hint": resumecheck.HINT}
                self._state_due = True
            elif kind in (vocab.EV_NODE_RESUME, vocab.EV_CHECKPOINT_RESUME) and any(
                    [self._warnings.pop(k, None) is not None for k in ("node_resume", "from_scratch",
                                                                       "resume_backwards")]):
                self._state_due = True  # a later attempt started from a checkpoint again
            elif kind == vocab.EV_REQUEUE:
                self._requeue = {"ok": bool(ev.get("ok")), "job_id": ev.get("job_id"),
                                 "detail": ev.get("reason") if ev.get("ok") else ev.get("error")}
            elif kind == vocab.EV_REQUEUE_SKIPPED:
                self._requeue = {"ok": False, "job_id": ev.get("job_id"), "detail": ev.get("reason")}
            elif kind in SUMMARY_EVENTS:
                self._status_due = True

    def _hang(self, kind: str, ev: Dict[str, Any]) -> None:
        """The `hang` warning: critical from the detection until the trainer reports a step again (then a warning
        that says it came back), naming the stacks file and, once acted on, what was done."""
        peer = ev.get("peer")
        if kind == vocab.EV_HANG_DETECTED and isinstance(peer, dict):  # a peer's judgement: its warning is critical
            self._warnings["hang"] = {
                "code": "hang", "severity": "critical", "at": ev.get("time"), "stacks": ev.get("stacks"),
                "message": "attempt %s stopped with its group: node %s judged the group hung (no new step for %.0f s "
                           "there, bound %.0f s); this node's stacks of %s process(es): %s; node %s's: %s" % (
                               ev.get("attempt"), peer.get("node"), peer.get("quiet_s") or 0,
                               peer.get("bound_s") or 0, ev.get("process_count"),
                               ev.get("stacks") or ev.get("stacks_problem"), peer.get("node"), peer.get("stacks")),
                "hint": HANG_HINT % (ev.get("stacks") or "the stacks file")}
            return
        if kind == vocab.EV_HANG_DETECTED:
            self._warnings["hang"] = {
                "code": "hang", "severity": "critical", "at": ev.get("time"), "stacks": ev.get("stacks"),
                "message": "attempt %s hung at step %s (%s): no new step and no output for %.0f s, past its bound "
                           "%.0f s (%s); stacks of %s process(es): %s" % (
                               ev.get("attempt"), ev.get("step"), ev.get("phase"), ev.get("quiet_s") or 0,
                               ev.get("bound_s") or 0, ev.get("rule"), ev.get("process_count"),
                               ev.get("stacks") or ev.get("stacks_problem")),
                "hint": HANG_HINT % (ev.get("stacks") or "the stacks file")}
            return
        w = self._warnings.get("hang")
        if w is None:
            return
        if kind == vocab.EV_HANG_ACTION:
            w["message"] = "%s; %s" % (w["message"], ev.get("message"))
            w["action"] = ev.get("action")
            if ev.get("peer") is not None and ev.get("state") == vocab.BACKOFF:
                w["severity"] = "warning"  # restarted with its group; a node that prints no step never "recovers"
        else:  # hang_recovered
            w["severity"] = "warning"
            w["message"] = "%s; recovered: step %s reported %.0f s after the hang was detected" % (
                w["message"], ev.get("step"), ev.get("after_s") or 0)

    def summary_due(self) -> None:
        """What training_status.md shows changed without an event (a hook's file beside state.json, progress.json):
        due at the next tick. From any thread (RunContext.summary_due)."""
        with self._lock:
            self._status_due = True

    def take(self) -> Tuple[bool, bool]:
        """(training_status.md is due, state.json is due) since the last take."""
        with self._lock:
            due, self._status_due, self._state_due = (self._status_due, self._state_due), False, False
        return due

    def to_state(self) -> Dict[str, Any]:
        """The keys state.json carries for these notes."""
        with self._lock:
            warnings: List[Dict[str, Any]] = [dict(w) for _, w in sorted(self._warnings.items())]
            requeue = dict(self._requeue) if self._requeue else None
        return {"warnings": warnings, "requeue": requeue}

    @property
    def requeue(self) -> Optional[Dict[str, Any]]:
        with self._lock:
            return dict(self._requeue) if self._requeue else None


def thread_death(thread: str, what: str, error: BaseException, run: str, agent_pid: int,
                 hint: str = "") -> Dict[str, Any]:
    """The fields of a `thread_died` event."""
    text = "%s: %s" % (type(error).__name__, error) if str(error) else type(error).__name__
    text = " ".join(text.split())  # one line: an error may quote what the peer sent, line breaks and all
    return {"thread": thread, "what": what, "error": text[:500],
            "hint": ((hint + "; ") if hint else "") + AGENT_RESTART_HINT % (agent_pid, run)}


def preempted_message(source: str, requeue: Optional[Dict[str, Any]], run: str) -> str:
    """What is true after a preemption: requeued by Slurm, or not, or nothing restarts it by itself."""
    if requeue and requeue.get("ok"):
        return "preempted (%s); requeued as Slurm job %s" % (source, requeue.get("job_id"))
    if requeue:
        return "preempted (%s); NOT requeued: %s" % (source, requeue.get("detail"))
    return ("preempted (%s); relaunch with `onbox run --name %s` (or let the scheduler requeue it) to resume from "
            "the newest checkpoint" % (source, run))
