"""`onbox match [RUN OPTIONS] [--candidate NAME]... -- CMD`: the runs a launch of CMD with these options would
continue, on this box and on the launch's durable target. `onboxctl run` asks it (over ssh, in the directory and
with the environment it would launch in) before it names a run: it resumes the run it finds, or starts a new one
and says why. Reads only; creates nothing (onbox/commands/README.md, "What onboxctl reads": onbox.match/1)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import click

from onbox import vocab
from onbox.clikit import LaidOut, echo_json, echo_line
from onbox.commands.run import RUN_SECTIONS, run_options

SCHEMA = vocab.SCHEMA_MATCH


EXAMPLES = [
    "onbox match --durable /workspace/durable -- python3 train.py --lr 3e-4",
    "onbox match --durable remote:ckpt --candidate gpt --json -- python3 train.py   # as onboxctl run asks",
]


@click.command(cls=LaidOut, usage="[OPTIONS] [--candidate NAME]... -- CMD [ARGS]...", examples=EXAMPLES,
               sections=RUN_SECTIONS,
               context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@run_options
@click.option("--take-over", "take_over", is_flag=True, help="Accepted as `onbox run` takes it; changes nothing here.")
@click.option("--candidate", "candidates", multiple=True, metavar="NAME",
              help="A run this box may never have held (another box ran it): what the launch's durable target "
                   "holds of it (newest checkpoint, lease). Repeatable.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def match(command: List[str], run_file: Optional[str], foreground: bool, as_json: bool, resume_existing: bool,
          take_over: bool, candidates: Tuple[str, ...], **flags: Any) -> int:
    """The runs that `onbox run [OPTIONS] -- CMD` would continue, here and on its durable target; reads only.

    Those on this box whose config.json records the same command, working directory (this one, or --workdir), durable target and checkpoint dir, with their state,
    whether their agent is alive, and the newest durable checkpoint's step (the local one without --durable); runs
    of the same command that differ elsewhere, with what differs; for each --candidate, what the durable target
    holds of it; and the names of every run here (a new run takes another).

    The options are `onbox run`'s and are resolved the same way (flags, ONBOX_*, run file, profile). Exit 0; 2 for
    options `onbox run` would refuse.
    """
    from onbox import paths
    from onbox.errors import UsageError
    from onbox.launch.match import same_command_runs
    from onbox.launch.plan import resolve

    for name in candidates:
        if not paths.valid_run_name(name):
            raise UsageError("invalid --candidate run name %r" % name)
    cfg = resolve(flags, list(command), run_file)
    ttl = cfg.effective_lease_ttl()
    doc: Dict[str, Any] = {"schema": SCHEMA,
                           "launch": {"command": cfg.command, "workdir": cfg.workdir, "durable": cfg.durable,
                                      "ckpt_dir": cfg.ckpt_dir},
                           "runs": [], "candidates": [], "names": _names()}
    on_box = set()
    for rd, saved, differ in same_command_runs(cfg):
        on_box.add(rd.name)
        doc["runs"].append(_box_run(rd, saved, differ, ttl))
    for name in dict.fromkeys(candidates):
        entry: Dict[str, Any] = {"run": name, "on_box": name in on_box or _has_run(name), "durable": None}
        if not entry["on_box"] and cfg.durable:
            entry["durable"] = _facts(cfg.durable, name, ttl)
        doc["candidates"].append(entry)
    if as_json:
        echo_json(doc)
    else:
        for r in doc["runs"]:
            echo_line("%s  %s%s  step %s%s" % (r["run"], r["state"], " (agent alive)" if r["agent_alive"] else "",
                                                r["step"] if r["step"] is not None else "-",
                                                "  differs: %s" % ", ".join(r["differ"]) if r["differ"] else ""))
        for c in doc["candidates"]:
            facts = c["durable"] or {}
            echo_line("%s  %s  step %s" % (c["run"], "on this box" if c["on_box"] else "on durable storage"
                                           if facts.get("exists") else "not found",
                                           facts.get("step") if facts.get("step") is not None else "-"))
    return 0


def _names() -> List[str]:
    """Every run name this box holds (a new run's name must be none of them)."""
    import os

    from onbox import paths

    try:
        return sorted(n for n in os.listdir(paths.runs_dir()) if paths.valid_run_name(n))
    except OSError:
        return []


def _has_run(name: str) -> bool:
    import os

    from onbox import paths

    return os.path.isdir(paths.run_dir(name))


def _facts(durable: str, run: str, ttl: float) -> Dict[str, Any]:
    from onbox.checkpoints.runfacts import durable_facts

    return durable_facts(durable, run, ttl)


def _box_run(rd: Any, saved: Dict[str, Any], differ: List[str], ttl: float) -> Dict[str, Any]:
    """One run of the same command on this box: its state (as `onbox status` reads it) and, when it is the run
    the launch would continue, its newest checkpoint's step (durable, else local) and its durable facts."""
    from onbox.commands.runs import _summary

    state = _summary(rd)
    out: Dict[str, Any] = {"run": rd.name, "differ": differ, "state": state.get("state"),
                           "agent_alive": bool(state.get("agent_alive")), "agent_pid": state.get("agent_pid"),
                           "started_at": state.get("started_at"), "updated_at": state.get("updated_at"),
                           "step": None, "checkpoint": None, "step_from": None, "durable": None,
                           "progress_step": (state.get("progress") or {}).get("step"),
                           "recorded": {k: saved.get(k) for k in ("workdir", "durable", "ckpt_dir")}}
    if differ:
        return out
    ckpt = state.get("checkpoint") or {}
    if saved.get("durable"):
        facts = _facts(str(saved["durable"]), rd.name, ttl)
        out["durable"] = facts
        newest = ckpt.get("latest_durable") if isinstance(ckpt.get("latest_durable"), dict) else {}
        if facts.get("step") is not None or facts.get("checkpoint"):
            out.update(step=facts.get("step"), checkpoint=facts.get("checkpoint"), step_from="durable")
        elif facts.get("problem") and newest:  # the target cannot be read now: what the agent last committed
            out.update(step=newest.get("step"), checkpoint=newest.get("name"), step_from="durable")
    else:
        local = ckpt.get("latest_local") if isinstance(ckpt.get("latest_local"), dict) else None
        if local:
            out.update(step=local.get("step"), checkpoint=local.get("name"), step_from="local")
    return out
