"""The teardown gate, the one rule never bent: a box may be torn down only when, for every run on it, the newest
durable checkpoint has been pulled home AND verified locally (no checkpoint is lost with its box).

"Pulled and verified" means the pulls record holds a passing verification of a checkpoint of that name whose
MANIFEST.json has the same sha256 as the one on the box now: a checkpoint committed after the pull, or a
re-commit under the same name, is not covered (U33: trust the artifact you loaded, not a log line).
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Any, Dict, List, Optional, Sequence

from controller.boxes.inventory import Box
from controller.boxes.profiles import MeterStop, meter_stop
from controller.boxes.ssh import Ssh
from controller.results.pull import PullsRecord, newest, remote_runs
from onbox import vocab
from onbox.errors import JobFailed, UnfitError, UsageError
from onbox.toolrun import Says, Tool

METER_STOP_TIMEOUT_S = 300.0
# the profile's meter-stop command, run only with `down --execute-meter-stop`: through the one tool runner, so a
# command that is not installed, hangs or fails says so (and that the box may still bill), never a traceback
METER_STOP = Tool(
    "the meter-stop command", error=JobFailed,
    missing=Says("the meter-stop command `{cmd}` cannot run here: {program} is not installed (or not on PATH)",
                 hint="install it here and run `onboxctl down {box} --execute-meter-stop` again, or stop the box "
                      "the way its platform does: nothing was stopped", error=UnfitError),
    timed_out=Says("the meter-stop command `{cmd}` did not finish within {timeout:.0f} s: it was stopped",
                   hint="check on the platform whether {box} stopped; the box may still bill"),
    failed=Says("the meter-stop command `{cmd}` failed (exit {rc}): {stderr}",
                hint="the box may still bill: stop {box} the way its platform does"))
LIVE_STATES = vocab.BEAT_LIVE_STATES


@dataclasses.dataclass
class RunVerdict:
    run: str
    state: Optional[str]
    newest: Optional[str]
    newest_step: Optional[int]
    pulled: bool
    verified: bool
    blocking: bool
    reason: str
    verified_at: Optional[float] = None
    # what the gate found, in one word: verified (newest pulled and verified) · abandoned (--abandon) · off_box (an
    # rclone remote holds them) · other_node (node 0 of the group commits) · blocked
    kind: str = "blocked"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GateReport:
    box: str
    runs: List[RunVerdict]
    meter: MeterStop
    allowed: bool
    warnings: List[str]

    def to_dict(self) -> Dict[str, Any]:
        return {"box": self.box, "allowed": self.allowed, "runs": [r.to_dict() for r in self.runs],
                "meter_stop": self.meter.to_dict(), "warnings": self.warnings}


def judge_run(box: str, doc: Dict[str, Any], record: PullsRecord, abandoned: Sequence[str] = ()) -> RunVerdict:
    run = doc["run"]
    top = newest(doc.get("checkpoints") or [])
    state = doc.get("state")
    node = doc.get("node") or {}
    if isinstance(node.get("rank"), int) and node["rank"] > 0:
        # a non-primary node never commits: node 0's run holds the group's checkpoints, and its box's gate checks them
        return RunVerdict(run, state, None, None, False, False, False,
                          "node %d of %s: node 0 commits; `onboxctl down` of node 0's box checks %s"
                          % (node["rank"], node.get("run"), node.get("run")), kind="other_node")
    if top is None and doc.get("durable") and not doc.get("run_root"):
        # an rclone remote: the checkpoints already live off the box and outlive it
        return RunVerdict(run, state, None, None, False, False, False,
                          "commits to %s (off the box): pull and verify from there with rclone" % doc["durable"],
                          kind="off_box")
    if top is None:
        blocking = run not in abandoned
        said = doc.get("nothing_committed")  # the agent's why (onbox/checkpoints/local/whynone.py)
        why = "no committed durable checkpoint%s" % (" (abandoned with --abandon)" if not blocking else
                                                      ": nothing would survive the teardown")
        if said and blocking:
            why += " (%s)" % said
        return RunVerdict(run, state, None, None, False, False, blocking, why,
                          kind="blocked" if blocking else "abandoned")
    pulled_entry = record.get(box, run).get("checkpoints", {}).get(top.name)
    proof = record.verified(box, run, top)
    if proof:
        return RunVerdict(run, state, top.name, top.step, True, True, False, "newest checkpoint pulled and verified",
                          verified_at=proof.get("verified_at"), kind="verified")
    if run in abandoned:
        return RunVerdict(run, state, top.name, top.step, bool(pulled_entry), False, False,
                          "not pulled and verified, abandoned with --abandon", kind="abandoned")
    if pulled_entry and pulled_entry.get("manifest_sha256") != top.manifest_sha256:
        why = "the pulled copy of %s differs from the box's (re-committed since): pull again" % top.name
    elif pulled_entry:
        why = "pulled %s but its verification failed: %s" % (top.name, pulled_entry.get("error") or "see pull")
    else:
        older = record.get(box, run).get("checkpoints", {})
        why = "newest checkpoint %s not pulled%s" % (top.name, " (only older ones are)" if older else "")
    return RunVerdict(run, state, top.name, top.step, bool(pulled_entry), False, True, why)


def gate(ssh: Ssh, box: Box, record: Optional[PullsRecord] = None, abandoned: Sequence[str] = ()) -> GateReport:
    record = record or PullsRecord()
    meter = meter_stop(box.profile)  # a refused local profile file is said before any connection
    docs = remote_runs(ssh, box)
    verdicts = [judge_run(box.name, d, record, abandoned) for d in docs]
    warnings = ["run %s is still %s: tearing the box down kills it" % (v.run, v.state)
                for v in verdicts if (v.state or "").lower() in LIVE_STATES]
    unknown = sorted(set(abandoned) - {v.run for v in verdicts})
    if unknown:
        warnings.append("--abandon named runs not on the box: %s" % ", ".join(unknown))
    return GateReport(box=box.name, runs=verdicts, meter=meter, allowed=not any(v.blocking for v in verdicts),
                      warnings=warnings)


def meter_command(meter: MeterStop, box: Box) -> Optional[str]:
    """The platform command that stops the meter, with the box filled in; None when the profile has none."""
    if not meter.command:
        return None
    return meter.command.replace("{box}", box.name).replace("{host}", box.host)


def meter_argv(cmd: Optional[str], profile: str) -> List[str]:
    """The words of the profile's meter-stop command (run as a list argv, never through a shell). Refused before
    anything is done when the profile has none or it does not split into words."""
    if not cmd:
        raise UsageError("profile %s has no meter-stop command to execute" % profile,
                         hint="stop the box the way its platform does, or give the profile a [meter_stop] command")
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        raise UsageError("profile %s: its meter-stop command %r does not split into words (%s)" % (profile, cmd, e),
                         hint="fix the command's quoting in the profile; nothing was run")
    if not argv:
        raise UsageError("profile %s: its meter-stop command is empty" % profile)
    return argv


def run_meter_stop(argv: Sequence[str], box: str, timeout: float = METER_STOP_TIMEOUT_S) -> Any:
    """Run the meter-stop command, bounded; its output is captured (a --json document stays the only stdout) and
    returned as the CompletedProcess for the caller to show. Raises METER_STOP's errors."""
    return METER_STOP.run(argv, timeout, program=argv[0], box=box)


def passed_line(report: GateReport) -> str:
    """The gate's verdict once it passed, naming each run for what it is: pulled and verified, abandoned with
    --abandon (its newest state is NOT home), committed off the box, or a node whose node 0 commits."""
    if not report.runs:
        return "Gate passed: there are no runs on %s." % report.box
    groups: Dict[str, List[str]] = {}
    for v in report.runs:
        groups.setdefault(v.kind, []).append(v.run)
    if set(groups) == {"verified"}:
        return "Gate passed: every run's newest checkpoint on %s is pulled and verified." % report.box
    said = {"verified": "newest checkpoint pulled and verified: %s",
            "abandoned": "ABANDONED with --abandon, newest state not home: %s",
            "off_box": "committed off the box (rclone): %s",
            "other_node": "a node whose node 0 commits: %s"}
    parts = [said[k] % ", ".join(groups[k]) for k in ("verified", "abandoned", "off_box", "other_node") if k in groups]
    return "Gate passed for %s: %s." % (report.box, "; ".join(parts))


def meter_sentence(meter: MeterStop, cmd: Optional[str]) -> str:
    """How to stop the meter, as one sentence: the profile's command when it has one, else its own words
    (`[billing] teardown`), else what the profile calls the meter stop, quoted."""
    if cmd:
        return "To stop the meter (%s): %s" % (meter.verb, cmd)
    if meter.how:
        return meter.how
    return ("To stop the meter, do on the box's platform what profile %s calls \"%s\" (it names no command for it)."
            % (meter.profile, meter.verb))


def render(report: GateReport) -> str:
    lines = ["Teardown gate for box %s" % report.box]
    if not report.runs:
        lines.append("  (no runs on this box)")
    for v in report.runs:
        mark = "ok     " if not v.blocking else "BLOCKED"
        ck = "%s (step %s)" % (v.newest, v.newest_step) if v.newest else "-"
        lines.append("  %s  %-32s %-10s newest %-28s %s" % (mark, v.run, v.state or "?", ck, v.reason))
    for w in report.warnings:
        lines.append("  warning: %s" % w)
    m = report.meter
    irrev = {True: "IRREVERSIBLE (what is on the box is gone after it)", False: "reversible", None: "reversibility unknown"}[m.irreversible]
    lines.append("Meter stop on profile %s: %s — %s; verified %s%s" % (
        m.profile, m.verb, irrev, m.verified or "(no date)", ", source: %s" % m.source if m.source else ""))
    if m.note:
        lines.append("  note: %s" % m.note)
    return "\n".join(lines) + "\n"
