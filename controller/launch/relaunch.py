"""Which run a launch belongs to: `onboxctl run BOX -- CMD` without --name (and without --new) finds the run of the
same command it continues, so that the same line again after a preemption resumes the run instead of starting a
new one at step 0.

The same run: the same command (word for word), working directory, durable target and checkpoint dir, as the box's
agent resolves them for this launch (`onbox match`, onbox/launch/match.py: the same layers and paths as `onbox
run`). Where it looks:

1. the box's own runs (`onbox match` lists those of the same command, with their state, whether their agent is
   alive and the newest checkpoint's step: durable, or local without --durable);
2. for a box that never held the run (a replacement box, or one reset or rented again under the same name), this
   machine's launch log (controller/launch/launchlog.py): runs of the same command, workdir, durable target and
   checkpoint dir started there or on other boxes (not on another box of this same launch), which the agent
   looks up on the durable target (`onbox match --candidate RUN`: newest checkpoint, lease). Only with a durable
   target, and only runs it holds something of: without one there is nothing on a new box to resume from.

Then (decide(), a pure function):
- a run with a live agent on the box, or one whose lease another live agent holds (a run that continues
  elsewhere): refused (exit 2) with what to do (stop it, --take-over when its box is gone for good, or --new);
  with --take-over a held run is resumed (its old agent is fenced);
- else the newest (by its last sign of life) is the one; if it ended `done` the launch is a new run, saying so;
  otherwise it is resumed from its newest checkpoint, and the older ones are named;
- no run found: a new run with the default name (onbox.paths.default_run_name), saying why (runs of the same
  command that differ elsewhere are named with what differs).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from controller.boxes.agent import REMOTE_PYZ, parse_json_any
from controller.boxes.inventory import Box
from controller.boxes.ssh import Ssh
from controller.launch.start import box_script, box_workdir, remote_env
from onbox import vocab
from onbox.errors import UsageError

SCHEMA = vocab.SCHEMA_MATCH
MAX_CANDIDATES = 20  # runs of the launch log asked about at once (the newest first): an argv stays short


class RunAlive(UsageError):
    """The run a launch belongs to is still alive (on the box, or holding its lease elsewhere): exit 2. `run`."""

    def __init__(self, run: str, message: str, hint: str) -> None:
        super().__init__(message, hint=hint)
        self.run = run


@dataclasses.dataclass
class Choice:
    """Which run a launch on `box` is, and why: `decision` resume (an earlier run, from `step`), new (a new run),
    or named (--name)."""

    box: str
    decision: str
    run: str
    why: str
    step: Optional[int] = None
    step_from: Optional[str] = None  # "durable" | "local": where the step is read
    found: Optional[str] = None  # "box" | "launch log": where the resumed run was found
    others: List[str] = dataclasses.field(default_factory=list)  # other runs of the same launch, not resumed

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("box")
        return d

    def line(self) -> str:
        """What `onboxctl run` says before it launches: `resuming train-20261125-114657 from step 1351 (...)`."""
        if self.decision == "resume":
            where = "from step %d" % self.step if self.step is not None else "from scratch"
            if self.step is not None and self.step_from == "local":
                where += " (its local checkpoint: the run has no --durable)"
            text = "resuming %s %s: %s" % (self.run, where, self.why)
        else:
            text = "new run %s: %s" % (self.run, self.why)
        if self.others:
            text += "; not resumed (older, same command): %s" % ", ".join(self.others)
        return text


def ask(ssh: Ssh, box: Box, cmd: Sequence[str], onbox_args: Sequence[str], workdir: Optional[str],
        onbox_env: Optional[Dict[str, str]], candidates: Sequence[str], timeout: float = 60.0) -> Dict[str, Any]:
    """`onbox match --json` on `box`, in the directory and environment the launch would run in, with the same
    `onbox run` options: its onbox.match/1 document, else the agent's refusal as an OnboxError."""
    from controller.boxes.agent import refusal

    home, pushed = remote_env(ssh, box)
    wd = box_workdir(home, pushed, workdir)
    pyz = "%s/%s" % (home.rstrip("/"), REMOTE_PYZ)
    argv = [box.python, pyz, "match", "--json", *onbox_args]
    for name in candidates:
        argv += ["--candidate", name]
    res = ssh.run(box.target(), script=box_script(box, wd, [*argv, "--", *cmd], onbox_env), timeout=timeout,
                  check=False, what="onbox match")
    doc = parse_json_any(res.text)
    if res.returncode == 0 and isinstance(doc, dict) and doc.get("schema") == SCHEMA:
        return doc
    raise refusal(box, "onbox match", res, SCHEMA)


def _same_launch(entry: Dict[str, Any], launch: Dict[str, Any]) -> bool:
    return all((entry.get(k) or None) == (launch.get(k) or None) for k in ("command", "workdir", "durable",
                                                                            "ckpt_dir"))


def candidate_names(log: Sequence[Dict[str, Any]], box: str, fellow_boxes: Set[str]) -> List[str]:
    """The launch log's runs to ask `box`'s agent about (newest first, at most MAX_CANDIDATES): those started with a
    durable target on another box, or on this one (a box rented again under the same name, or reset, no longer has
    the run; one that has it answers `on_box` and its own record counts), but not on another box of this same
    launch (each box finds its own runs)."""
    out: List[str] = []
    for e in log:
        if e["box"] in fellow_boxes - {box} or not e.get("durable") or e["run"] in out:
            continue
        out.append(e["run"])
    return out[:MAX_CANDIDATES]


def _ago(now: float, then: Any) -> str:
    from onbox.checkpoints.leases import renewed_ago

    return renewed_ago(now, then)


def _when(t: Any) -> str:
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _lease_time(facts: Optional[Dict[str, Any]]) -> float:
    lease = (facts or {}).get("lease") or {}
    return max(_num(lease.get("renewed_at")), _num(lease.get("released_at")))


def _differs(r: Dict[str, Any]) -> str:
    rec = r.get("recorded") or {}
    return "%s ran this command with another %s" % (r["run"], " and ".join(
        "%s (%s)" % (k.replace("ckpt_dir", "checkpoint dir").replace("durable", "durable target"), rec.get(k) or "none")
        for k in r["differ"]))


def decide(box: Box, answer: Dict[str, Any], log: Sequence[Dict[str, Any]], new_name: str, take_over: bool,
           claimed: Set[str], now: Optional[float] = None) -> Choice:
    """The run a launch on `box` is (see the module docstring). `answer`: the box's onbox.match/1 document;
    `log`: the launch log's runs of this command, newest first; `new_name`: the name of a new run; `claimed`: runs
    other boxes of this same launch resume. Raises UsageError (exit 2) for a run that is still alive."""
    now = time.time() if now is None else now
    new_name = free_name(new_name, set(answer.get("names") or []) | claimed)
    launch = answer.get("launch") or {}
    runs = [r for r in answer.get("runs") or [] if isinstance(r, dict) and r.get("run") not in claimed]
    mine = [r for r in runs if not r.get("differ")]
    alive = [r for r in mine if r.get("agent_alive")]
    if alive:
        r = alive[0]
        raise RunAlive(
            r["run"], "run %s of this command is still running on %s (%s%s)" % (
                r["run"], box.name, r.get("state") or "state unknown",
                ", agent pid %s" % r["agent_pid"] if r.get("agent_pid") else ""),
            hint="watch it with `onboxctl status`; to relaunch it, stop it first (`onboxctl stop %s %s`, or on the "
                 "box `%s ~/%s stop %s`: it checkpoints, and the same command then resumes it); for a second run "
                 "beside it, add --new" % (box.name, r["run"], box.python, REMOTE_PYZ, r["run"]))
    # (last sign of life, kind, run, its facts): kind "box" a run of the box, "log" one the launch log names
    found: List[Tuple[float, str, Dict[str, Any], Dict[str, Any]]] = []
    for r in mine:
        last = max(_num(r.get("updated_at")), _num(r.get("started_at")), _lease_time(r.get("durable")))
        found.append((last, "box", r, r.get("durable") or {}))
    facts_of = {c["run"]: c for c in answer.get("candidates") or [] if isinstance(c, dict) and c.get("run")}
    entries: Dict[str, Dict[str, Any]] = {}
    for e in log:
        if e["run"] in entries or e["run"] in claimed or not _same_launch(e, launch) or not launch.get("durable"):
            continue
        c = facts_of.get(e["run"])
        if c is None or c.get("on_box") or not (c.get("durable") or {}).get("exists"):
            continue  # not asked, the box's own record counts, or nothing of it on the durable target
        entries[e["run"]] = e
        found.append((max(_num(e.get("at")), _lease_time(c["durable"])), "log", dict(e, box_ran=e["box"]),
                      c["durable"]))
    held = [f for f in found if ((f[3].get("lease") or {}).get("blocks"))]
    if held and not take_over:
        _, kind, r, facts = max(held, key=lambda f: f[0])
        lease = facts["lease"]
        where = "launched on %s" % r["box_ran"] if kind == "log" else "on %s, %s" % (box.name, r.get("state"))
        raise RunAlive(
            r["run"], "run %s of this command (%s) is held by another agent: its lease on %s was renewed %s by %s" % (
                r["run"], where, facts.get("durable") or launch.get("durable"), _ago(now, lease.get("renewed_at")),
                lease.get("host") or lease.get("holder")),
            hint="if that box is gone for good, relaunch with --take-over (its agent, if it still runs, is fenced "
                 "and stops); if it still runs there, leave it; for a separate run, add --new")
    if not found:
        return Choice(box.name, "new", new_name, why=_why_new(box, runs, log, launch))
    found.sort(key=lambda f: f[0], reverse=True)
    last, kind, r, facts = found[0]
    others = [f[2]["run"] for f in found[1:]]
    ended = r.get("state") if kind == "box" else (facts.get("lease") or {}).get("ended")
    if ended == vocab.DONE:
        return Choice(box.name, "new", new_name, others=others,
                      why="the newest run of this command, %s, ended done%s" % (
                          r["run"], "" if kind == "box" else " (on %s)" % r["box_ran"]))
    if kind == "box":
        why = "the run of this command on %s (%s)" % (box.name, r.get("state") or "state unknown")
        return Choice(box.name, "resume", r["run"], why=why, step=r.get("step"), step_from=r.get("step_from"),
                      found="box", others=others)
    lease = facts.get("lease") or {}
    why = "launched on %s at %s, found in this machine's launch log and on the durable target" % (
        r["box_ran"], _when(entries[r["run"]].get("at")))
    if lease.get("blocks"):
        why += "; --take-over: the live lease of %s is superseded, its agent is fenced" % (
            lease.get("host") or lease.get("holder"))
    return Choice(box.name, "resume", r["run"], why=why, step=facts.get("step"),
                  step_from="durable" if facts.get("step") is not None else None, found="launch log", others=others)


def free_name(name: str, taken: Set[str]) -> str:
    """`name`, or `name-2`, `name-3`, ... when the box already has a run of that name (two launches of the same
    program within one second): a new run never continues another by accident."""
    n, out = 1, name
    while out in taken:
        n += 1
        out = "%s-%d" % (name, n)
    return out


def _why_new(box: Box, runs: List[Dict[str, Any]], log: Sequence[Dict[str, Any]], launch: Dict[str, Any]) -> str:
    """Why no earlier run is continued: the runs of the same command that differ, else that there are none."""
    near = [_differs(r) for r in runs if r.get("differ")]
    if near:
        return "; ".join(near[:3])
    other = [e for e in log if not _same_launch(e, launch)]
    if other:
        e = other[0]
        differ = [k for k in ("workdir", "durable", "ckpt_dir") if (e.get(k) or None) != (launch.get(k) or None)]
        return "%s (on %s) ran this command with another %s" % (e["run"], e["box"], " and ".join(
            "%s (%s)" % (k.replace("ckpt_dir", "checkpoint dir").replace("durable", "durable target"),
                         e.get(k) or "none") for k in differ))
    if log and not launch.get("durable"):
        return "no run of this command on %s; runs on other boxes resume only from a --durable target" % box.name
    return "no earlier run of this command with this working dir and durable target on %s%s" % (
        box.name, " or in this machine's launch log" if launch.get("durable") else "")
