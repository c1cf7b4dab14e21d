"""The text of `onbox queue ls` and `onboxctl queue BOX`: one rendering of the queue's `--json` document, which
both CLIs show."""
from __future__ import annotations

import shlex
from typing import Any, Dict

from onbox.queue.journal import DONE, FAILED, PREEMPTED, RUNNING, STOPPED
from onbox.untrusted import printable

NAME_WIDTH = 28


def render_queue(doc: Dict[str, Any]) -> str:
    """The text of `onbox queue ls` (and `onboxctl queue BOX`)."""
    r = doc.get("runner") or {}
    if r.get("alive"):
        head = "runner: pid %s, %s, %s" % (r.get("pid"), r.get("state"), r.get("mode"))
    elif r.get("state"):
        head = "runner: not running (last: %s%s)" % (r.get("state"), ", exit %s" % r["exit"] if r.get(
            "exit") is not None else "")
    else:
        head = "runner: never started"
    pending = [e for e in doc.get("entries") or [] if e.get("state") not in (DONE, FAILED, STOPPED)]
    if pending and not r.get("alive"):
        head += "; `onbox queue run` runs what is left"
    lines = [head, "%-4s %-9s %-*s %-9s %-4s %s" % ("ID", "STATE", NAME_WIDTH, "RUN", "RUN-STATE", "GPU", "COMMAND")]
    for e in doc.get("entries") or []:
        cmd = shlex.join(str(c) for c in e.get("command") or [])
        lost = e.get("state") == RUNNING and e.get("agent_alive") is False
        lines.append("%-4s %-9s %-*s %-9s %-4s %s" % (
            e.get("id"), "stale" if lost else e.get("state"), NAME_WIDTH, e.get("name"), e.get("run_state") or "-",
            e.get("gpu") if e.get("gpu") is not None else "-", cmd if len(cmd) <= 60 else cmd[:57] + "..."))
        if e.get("state") in (FAILED, PREEMPTED) and e.get("message"):
            lines.append("     %s" % e["message"])
        elif lost:
            lines.append("     its agent is gone and no runner recorded how it ended: `onbox queue run` records that, or resumes it")
    lines += ["! %s" % p for p in doc.get("problems") or []]
    # an entry's message and command come from the run's records and the user's argv: one line each, no escapes
    return "\n".join(printable(line) for line in lines) + "\n"


