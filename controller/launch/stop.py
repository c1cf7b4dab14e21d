"""`onboxctl stop BOX RUN`: the agent's own graceful stop, asked over ssh, and (with --wait) the run's end.

A stop here is what `onbox stop` is on the box: the trainer gets its checkpoint signal, the agent commits the newest
checkpoint and the run ends `stopped`, never restarted. Nothing is killed from here. The box is asked once
(`onbox stop RUN --no-wait --json`, schema onbox.stop/1: the request is placed and the live agent carries it out);
waiting is onboxctl's, one bounded `onbox status RUN --json` after another until the run has ended or the agent's
own bound (its grace plus 30 s) has passed: no ssh session stays open for the length of a grace.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

from controller.boxes.agent import agent_json, ask, refusal
from controller.boxes.inventory import Box
from controller.boxes.ssh import BoxUnreachable, Ssh
from onbox import vocab
from onbox.clock import Clock, SystemClock
from onbox.errors import JobFailed, OnboxError
from onbox.untrusted import printable

STOP_SCHEMA = vocab.SCHEMA_STOP
STATUS_SCHEMA = vocab.SCHEMA_STATUS
ENDED = vocab.TERMINAL_STATES
ASK_TIMEOUT = 60.0  # the ask itself returns at once when the run has a live agent ...
ORPHAN_GRACE = 600.0  # ... without one, `onbox stop` stops the trainer itself: a grace (unknown here) and a commit
FINAL_COMMIT = 300.0  # the agent's default final_sync_timeout
POLL_S = 1.0
SLACK_S = 30.0  # beyond the agent's own bound: ssh round trips, the agent's last records


class NothingToStop(JobFailed):
    """The run has already ended, or nothing of it runs: no stop was asked (exit 1)."""


@dataclasses.dataclass
class StopReport:
    box: str
    run: str
    outcome: str  # asked: the live agent has the request · ended: the run has ended (with --wait, or no agent)
    grace: Optional[float] = None  # the grace the agent applies (seconds)
    wait_s: Optional[float] = None  # how long the agent's own `onbox stop` would wait for it
    state: Optional[str] = None
    last_exit: Optional[Dict[str, Any]] = None
    checkpoint: Optional[Dict[str, Any]] = None  # the newest durable checkpoint: name, step, committed_at, ...
    durable: Optional[str] = None  # where the run commits (None: no --durable)
    last_sync: Optional[Dict[str, Any]] = None
    waited_s: Optional[float] = None
    nothing_committed: Optional[str] = None  # the agent's why, when nothing is committed (onbox status RUN --json)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def ask_timeout(grace: Optional[float]) -> float:
    """The bound of the one ssh call that asks: enough for a run without a live agent, which `onbox stop` stops
    itself (the grace, then the final commit)."""
    return ASK_TIMEOUT + (grace if grace is not None else ORPHAN_GRACE) + FINAL_COMMIT


def ask_stop(ssh: Ssh, box: Box, run: str, grace: Optional[float]) -> Dict[str, Any]:
    """`onbox stop RUN --no-wait --json` on the box: its onbox.stop/1 document. An unknown run is the agent's own
    refusal (exit 2); a run that has ended, or has nothing left running, is NothingToStop."""
    args = ["stop", run, "--no-wait", "--json"] + (["--grace", "%g" % grace] if grace is not None else [])
    doc, res, _ = ask(ssh, box, args, timeout=ask_timeout(grace))
    what = "onbox stop %s" % run
    if res.returncode != 0 or not isinstance(doc, dict) or doc.get("schema") != STOP_SCHEMA:
        raise refusal(box, what, res, STOP_SCHEMA)
    outcome = doc.get("outcome")
    if outcome == vocab.STOP_ALREADY_ENDED:
        raise NothingToStop("run %s on %s has already ended (%s): nothing to stop" % (run, box.name,
                                                                                    doc.get("state")),
                            hint="`onboxctl pull %s %s` takes its checkpoints home" % (box.name, run))
    if outcome == vocab.STOP_NOTHING:
        raise NothingToStop("run %s on %s has no live agent and no live trainer (state.json says %s): nothing to stop"
                            % (run, box.name, doc.get("state")),
                            hint="`onboxctl status --box %s` shows it; `onboxctl logs %s %s` shows how it ended"
                                 % (box.name, box.name, run))
    if outcome not in (vocab.STOP_ASKED, vocab.STOP_STOPPED):
        raise refusal(box, what, res, STOP_SCHEMA)
    return doc


def run_status(ssh: Ssh, box: Box, run: str) -> Dict[str, Any]:
    return agent_json(ssh, box, ["status", run, "--json"], STATUS_SCHEMA, timeout=30)


def ended(doc: Dict[str, Any]) -> bool:
    return doc.get("state") in ENDED and not doc.get("agent_alive")


def wait_ended(ssh: Ssh, box: Box, run: str, bound: float, clock: Clock) -> Dict[str, Any]:
    """The run's status once it has ended (state terminal, agent gone), asking every POLL_S; JobFailed after
    `bound` seconds: the request stays with the agent, which still stops the run."""
    deadline = clock.monotonic() + bound
    while True:
        try:
            doc = run_status(ssh, box, run)
        except BoxUnreachable as e:
            raise BoxUnreachable("%s, while waiting for run %s to stop: the stop was asked, and the agent carries it "
                                 "out without this connection" % (e.message, run), hint=e.hint)
        if ended(doc):
            return doc
        if clock.monotonic() >= deadline:
            raise JobFailed("run %s on %s did not stop within %.0f s (it is %s)" % (run, box.name, bound,
                                                                                  doc.get("state")),
                            hint="the stop request stays and the agent still stops the run: `onboxctl status --box "
                                 "%s`; a stuck trainer: `onboxctl logs %s %s`" % (box.name, box.name, run))
        clock.sleep(POLL_S)


def stop_run(ssh: Ssh, box: Box, run: str, grace: Optional[float] = None, wait: bool = False,
             say: Callable[[str], None] = lambda line: None, clock: Optional[Clock] = None,
             timeout: Optional[float] = None) -> StopReport:
    """Ask the agent to stop RUN; with `wait`, wait (bounded: `timeout` seconds, else the agent's own bound plus
    SLACK_S) for the run to end and report how it ended and its newest durable checkpoint. A run without a live
    agent is stopped by `onbox stop` itself: it has ended when the ask returns."""
    clock = clock or SystemClock()
    t0 = clock.monotonic()
    doc = ask_stop(ssh, box, run, grace)
    report = StopReport(box=box.name, run=run, outcome=vocab.STOP_ASKED, grace=_num(doc.get("grace")),
                        wait_s=_num(doc.get("wait_s")), state=doc.get("state"))
    if doc.get("outcome") == vocab.STOP_ASKED:
        if not wait:
            return report
        say(asked_line(report, waiting=True, bound=timeout))
        bound = timeout if timeout is not None else (
            (report.wait_s if report.wait_s is not None else (grace or 0.0) + 30.0) + SLACK_S)
        final = wait_ended(ssh, box, run, bound, clock)
    else:
        try:
            final = run_status(ssh, box, run)
        except OnboxError:  # it has ended all the same: what the stop itself said stands
            final = dict(doc, checkpoint=None)
    raw = final.get("checkpoint")
    ck: Dict[str, Any] = raw if isinstance(raw, dict) else {}
    report.outcome, report.state = "ended", final.get("state")
    report.last_exit = final.get("last_exit") if isinstance(final.get("last_exit"), dict) else None
    report.checkpoint = ck.get("latest_durable") if isinstance(ck.get("latest_durable"), dict) else None
    report.durable = ck.get("durable") if isinstance(ck.get("durable"), str) else None
    report.last_sync = ck.get("last_sync") if isinstance(ck.get("last_sync"), dict) else None
    said = final.get("nothing_committed")
    report.nothing_committed = printable(said)[:2000] if isinstance(said, str) and said else None
    report.waited_s = round(clock.monotonic() - t0, 1)
    return report


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# -- what it says ----------------------------------------------------------------------------------------------
def asked_line(r: StopReport, waiting: bool = False, bound: Optional[float] = None) -> str:
    grace = " (grace %g s)" % r.grace if r.grace is not None else ""
    if waiting:
        if bound is None and r.wait_s is not None:
            bound = r.wait_s + SLACK_S
        until = " up to %.0f s" % bound if bound is not None else ""
        return "%s/%s: stop asked: the trainer checkpoints%s, the agent commits and ends the run; waiting%s" % (
            r.box, r.run, grace, until)
    return ("%s/%s: stop asked: the trainer checkpoints%s, the agent commits and ends the run (not restarted); "
            "`onboxctl status --box %s` follows it" % (r.box, r.run, grace, r.box))


def checkpoint_line(r: StopReport) -> str:
    """The newest durable checkpoint in words, or why there is none; a failed last sync is never hidden."""
    c = r.checkpoint
    if c and c.get("name"):
        line = "newest durable checkpoint: %s%s" % (c["name"], " (step %s)" % c["step"] if c.get("step") is not None
                                                     else "")
        if r.durable:
            line += " in %s" % r.durable
    elif r.nothing_committed:  # the agent's why: what is in the checkpoint dir, its failed sync, ...
        return r.nothing_committed
    elif r.durable:
        line = "no checkpoint committed to %s" % r.durable
    else:
        line = "no durable checkpoint: the run commits nowhere (no --durable); its checkpoints stay on the box"
    if r.last_sync and r.last_sync.get("ok") is False:
        line += "; LAST SYNC FAILED: %s" % r.last_sync.get("error")
    return line


def ended_lines(r: StopReport) -> List[str]:
    last = r.last_exit or {}
    how = ""
    if last.get("classification"):
        how = " (last exit: %s%s)" % (last["classification"], " — %s" % last["message"] if last.get("message")
                                      else "")
    took = " after %.1f s" % r.waited_s if r.waited_s is not None else ""
    return ["%s/%s: %s%s%s" % (r.box, r.run, r.state or "?", took, how), "  %s" % checkpoint_line(r)]


def render(r: StopReport) -> str:
    lines = [asked_line(r)] if r.outcome == vocab.STOP_ASKED else ended_lines(r)
    return "\n".join(lines) + "\n"
