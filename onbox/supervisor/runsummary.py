"""training_status.md: what a person reading the run directory should know now, and nothing that is not true.

It is rendered from state.json's document plus what the subsystems record beside it (checkpoint_status.json,
progress.json), and rewritten on every state change, every commit and every progress change (the journal writes
progress.json itself; the checkpoint hook says when it rewrote its file: RunContext.summary_due). Each line states a fact, and `next:` says what happens next or what to do: after a
preemption nothing restarts a run unless a scheduler requeues it, so the summary says who will.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from onbox import vocab

STATE_MEANING = {
    vocab.STARTING: "starting an attempt",
    vocab.RUNNING: "the job is running",
    vocab.BACKOFF: "waiting before the next restart",
    vocab.STOPPING: "preemption/stop under way: checkpoint requested, waiting for the child",
    vocab.DONE: "finished successfully",
    vocab.FAILED: "failed; not restarting",
    vocab.PREEMPTED: "stopped for a preemption, after its final commit",
    vocab.STOPPED: "stopped on request",
    vocab.FENCED: "stopped: another agent took the run over (a newer lease on durable storage)",
}
LIVE = vocab.LIVE_STATES
PHASE_UNDER_WAY = ("pending", "running", "ending")  # a phase's status (phases.py) while it is not over


def has_metrics(progress: Optional[Dict[str, Any]]) -> bool:
    return progress is not None and any(progress.get(k) is not None for k in ("step", "loss", "eval_loss", "epoch"))


def next_step(state: Dict[str, Any], checkpoint: Optional[Dict[str, Any]] = None) -> str:
    """What happens next, or what to do, in one line."""
    run = state.get("run", "RUN")
    st = state.get("state")
    relaunch = "`onbox run --name %s`" % run
    resumes = ("it resumes from the newest checkpoint" if newest_checkpoint(state, checkpoint)
               else "it starts from scratch: no checkpoint was committed")
    hung = hang_next(state, relaunch, resumes)
    if hung:
        return hung
    if st == vocab.STARTING:
        return "the agent is starting attempt %s" % state.get("attempt")
    if st == vocab.RUNNING:
        return "nothing to do: the agent supervises it (`onbox status %s`, `onbox logs %s -f`)" % (run, run)
    if st == vocab.BACKOFF:
        return "the agent restarts it at %s" % _iso(state.get("backoff_until"))
    if st == vocab.STOPPING:
        return "the agent is stopping it: checkpoint signal sent, the final commit follows"
    if st == vocab.DONE:
        return "nothing: it finished; fetch the results (`onboxctl pull BOX %s`)" % run
    if st == vocab.FAILED:
        return "fix the cause (the last exit below), then relaunch with %s" % relaunch
    if st == vocab.STOPPED:
        return "relaunch with %s when you want it back: %s" % (relaunch, resumes)
    if st == vocab.FENCED:
        return (state.get("last_exit") or {}).get("hint") or "nothing on this box: the run continues elsewhere"
    if st == vocab.PREEMPTED:
        requeue = state.get("requeue") or {}
        if requeue.get("ok"):
            return "requeued as Slurm job %s: when it runs again %s" % (requeue.get("job_id"), resumes)
        if requeue:
            return "NOT requeued (%s): relaunch with %s (or `scontrol requeue %s`); %s" % (
                requeue.get("detail") or "?", relaunch, requeue.get("job_id"), resumes)
        return ("nothing restarts it by itself: relaunch with %s (here, or on a replacement box with the same "
                "--durable), or let the scheduler requeue it; %s" % (relaunch, resumes))
    return "`onbox status %s`" % run


def hang_next(state: Dict[str, Any], relaunch: str, resumes: str) -> Optional[str]:
    """`next:` while a hang stands (the `hang` warning is critical until the trainer reports a step again)."""
    w = next((w for w in state.get("warnings") or [] if isinstance(w, dict) and w.get("code") == "hang"
              and w.get("severity") == "critical"), None)
    st = state.get("state")
    if w is None or st not in (vocab.RUNNING, vocab.BACKOFF, vocab.STARTING, vocab.FAILED):
        return None
    stacks = w.get("stacks") or "the stacks file (see the hang_detected event)"
    if st == vocab.FAILED:
        return "fix the hang (read the stacks in %s), then relaunch with %s: %s" % (stacks, relaunch, resumes)
    if st == vocab.RUNNING and w.get("action") in (None, "alert"):
        return ("the trainer is HUNG and left as it is (--on-hang alert): read the stacks in %s, then stop it "
                "(`onbox stop %s`) and relaunch, or wait for it to come back" % (stacks, state.get("run")))
    if st == vocab.BACKOFF:
        return "the agent restarts it at %s after a hang: read the stacks in %s" % (_iso(state.get("backoff_until")),
                                                                                  stacks)
    return "the agent restarted it after a hang, from the newest checkpoint: read the stacks in %s" % stacks


def newest_checkpoint(state: Dict[str, Any], checkpoint: Optional[Dict[str, Any]]) -> Any:
    c = checkpoint or {}
    return c.get("latest_durable") or c.get("latest_local") or state.get("resume_from")


def render_status(state: Dict[str, Any], checkpoint: Optional[Dict[str, Any]] = None,
                  disk_risks: Optional[List[str]] = None, progress: Optional[Dict[str, Any]] = None) -> str:
    """training_status.md: state and what happens next, progress, newest checkpoint, last exit, warnings,
    risks."""
    last = state.get("last_exit") or {}
    checkpoint = checkpoint or {}
    newest = newest_checkpoint(state, checkpoint)
    st = str(state.get("state"))
    lines = [
        "# Run %s" % state.get("run", "?"),
        "",
        "- state: **%s** — %s" % (st, STATE_MEANING.get(st, "")),
        "- next: %s" % next_step(state, checkpoint),
        "- attempt: %s (restarts: %s) · child pid: %s · agent pid: %s" % (
            state.get("attempt"), state.get("restarts"), state.get("child_pid"), state.get("agent_pid")),
        "- started: %s · updated: %s" % (_iso(state.get("started_at")), _iso(state.get("updated_at"))),
        "- progress: %s" % _progress(progress),
        *(["- phase: %s" % phase_line(state["phase"])] if isinstance(state.get("phase"), dict) else []),
        "- checkpoint dir: %s" % state.get("ckpt_dir"),
        "- newest checkpoint: %s" % (_ckpt_name(newest) or "none yet"),
        *(["- deadline: %s" % deadline_line(state["deadline"], state.get("updated_at"), st in LIVE)]
          if isinstance(state.get("deadline"), dict) else []),
    ]
    if checkpoint:
        lines.append("- durable: %s · local: %s · verified: %s" % (
            _ckpt_name(checkpoint.get("latest_durable")) or "none", _ckpt_name(checkpoint.get("latest_local")) or
            "none", checkpoint.get("verified")))
        sync = checkpoint.get("last_sync") or {}
        if sync:
            lines.append("- last sync: %s at %s" % ("ok" if sync.get("ok") else "FAILED: %s" % sync.get("error"),
                                                    _iso(sync.get("at"))))
    if last:
        lines.append("- last exit: %s — %s" % (last.get("classification"), last.get("message")))
        if last.get("hint"):
            lines.append("  - what to do: %s" % last["hint"])
    if state.get("preemption"):
        p = state["preemption"]
        lines.append("- preemption: from %s, received %s" % (p.get("source"), _iso(p.get("received_at"))))
    if state.get("message"):
        lines.append("- note: %s" % state["message"])
    lines += _phase_table(state.get("phase"))
    warnings = [w for w in state.get("warnings") or [] if isinstance(w, dict)
                and not (w.get("code") == "no_metrics" and has_metrics(progress))]
    if warnings:
        lines += ["", "## Warnings", ""]
        lines += ["- %s%s" % (w.get("message"), (" — %s" % w["hint"]) if w.get("hint") else "") for w in warnings]
    risks = list(disk_risks or [])
    if st in LIVE:
        if not newest:
            risks.append("no checkpoint yet: a preemption now loses all progress")
        elif checkpoint.get("durable") and not checkpoint.get("latest_durable"):
            risks.append("no checkpoint on durable storage yet: losing this box loses all progress")
    if (checkpoint.get("last_sync") or {}).get("ok") is False:
        risks.append("U33: the last commit to durable storage failed; the durable copy is not current")
    if risks:
        lines += ["", "## Risks", ""] + ["- %s" % r for r in risks]
    return "\n".join(lines) + "\n"


def deadline_line(deadline: Dict[str, Any], now: Any, live: bool = True) -> str:
    """`2026-11-25T18:00:00Z (slurm), 1h02m left; checkpoint asked for at 2026-11-25T17:58:30Z (grace 30 s + commit
    ~3.2 s + margin 60 s)`: state.json's `deadline` block, time left as of `now` (wall-clock)."""
    at, ask = deadline.get("at"), deadline.get("ask_at")
    text = "%s (%s)" % (_iso(at), deadline.get("source"))
    if live and isinstance(at, (int, float)) and isinstance(now, (int, float)):
        text += ", %s left" % _span(at - now)
    if deadline.get("asked_at"):
        text += "; checkpoint asked for at %s" % _iso(deadline.get("asked_at"))
    elif live:
        text += "; checkpoint asked for at %s" % _iso(ask)
    return text + " (grace %s s + commit ~%s s + margin %s s)" % (
        _num(deadline.get("grace_s")), _num(deadline.get("commit_estimate_s")), _num(deadline.get("margin_s")))


def _span(seconds: float) -> str:
    if seconds <= 0:
        return "none (%.0f s past)" % -seconds
    h, rest = divmod(int(seconds), 3600)
    return "%dh%02dm" % (h, rest // 60) if h else "%dm%02ds" % divmod(int(seconds), 60)


def _num(x: Any) -> str:
    return ("%g" % x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def phase_line(phase: Dict[str, Any]) -> str:
    """`2/3 curated — target step 1500, at step 1210; criteria: eval_loss < 2.5` (state.json's `phase`)."""
    target = phase.get("target_steps")
    parts = ["target step %s" % target if target is not None else "until its command exits 0"]
    if phase.get("step") is not None:
        parts.append("at step %s" % phase["step"])
    if phase.get("status") == "ending":
        parts.append("target reached: stopping the command")
    text = "%s/%s %s — %s" % ((phase.get("index") or 0) + 1, phase.get("count"), phase.get("name"), ", ".join(parts))
    return text + ("; criteria: %s" % ", ".join(phase["criteria"]) if phase.get("criteria") else "")


def _phase_table(phase: Any) -> List[str]:
    """## Phases: each ended phase with its end step and criteria, the current one, those still to come."""
    if not isinstance(phase, dict):
        return []
    out = ["", "## Phases", ""]
    for h in phase.get("history") or []:
        checks = ", ".join("%s (%s)" % (c.get("why"), "ok" if c.get("ok") else "FAILED")
                           for c in h.get("criteria") or [])
        out.append("- %s: %s at step %s%s" % (h.get("name"), h.get("status"), h.get("end_step"),
                                              " — " + checks if checks else ""))
    names = phase.get("names") or []
    index = phase.get("index") or 0
    if phase.get("status") in PHASE_UNDER_WAY:  # else it ended: its record is above
        out.append("- %s: current (%s)" % (phase.get("name"), phase_line(phase)))
    out += ["- %s: to come" % n for n in names[index + 1:]]
    return out


def _progress(p: Optional[Dict[str, Any]]) -> str:
    if not has_metrics(p):
        return "no metric recognised yet"
    assert p is not None
    parts = ["%s %s" % (label, p[key]) for key, label in (
        ("epoch", "epoch"), ("step", "step"), ("loss", "loss"), ("eval_loss", "eval loss"), ("lr", "lr"),
        ("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s")) if p.get(key) is not None]
    return "%s (at %s)" % (", ".join(parts), _iso(p.get("time")))


def _ckpt_name(value: Any) -> str:
    """checkpoint_status.json entries may be a path or a {name, step, ...} record."""
    if isinstance(value, dict):
        return "%s (step %s)" % (value.get("name") or value.get("path"), value.get("step"))
    return str(value) if value else ""


def _iso(t: Any) -> str:
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "-"
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    except (OverflowError, OSError, ValueError):
        return "-"
