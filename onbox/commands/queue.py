"""`onbox queue add|ls|rm|run`: the box's run queue (onbox/queue/). Thin commands over the journal and the runner.

An entry is checked exactly as `onbox run` checks a run (the same options, the same resolution and pre-flight:
onbox.launch.plan.prepare) and queued with its resolved configuration, so a bad entry is refused now (exit 2,
nothing written), not at 3 a.m. when its turn comes.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

import click

from onbox import vocab
from onbox.clikit import LaidOut, echo_json
from onbox.commands.run import RUN_SECTIONS, run_options
from onbox.errors import ExitCode, UsageError
from onbox.queue.journal import RUNNING
from onbox.queue.render import render_queue


@click.group("queue")
def queue() -> None:
    """The box's run queue: ablations one after another, N at a time or one per GPU; each entry is its own run.

    \b
    onbox queue add [RUN OPTIONS] -- CMD...   queue a run (the options of `onbox run`)
    onbox queue ls [--json]                   entries and their states, the runner
    onbox queue rm ENTRY                      drop an entry that is not running (id or run name)
    onbox queue run [--parallel N|--per-gpu]  run the queue (detached; --foreground to stay)

    A preemption of the runner (SIGTERM, SIGUSR1, a cloud notice), or of one entry's agent, checkpoints and stops
    the running entries and exits 75; `onbox queue run` again continues with the entry it was on (resumed) and
    never re-runs a done one.
    """


def _journal() -> Any:
    from onbox import paths
    from onbox.queue.journal import Journal

    problem = paths.home_problem()
    if problem:
        raise UsageError("ONBOX_HOME %s is unusable: %s" % (paths.onbox_home(), problem),
                         hint="point ONBOX_HOME at a directory (unset, it is ~/.onbox)")
    return Journal()


def _peek_run_file(run_file: Optional[str]) -> Tuple[Optional[str], List[str]]:
    """The run file's [run] name and command, best effort (prepare() reports a broken file properly)."""
    if not run_file:
        return None, []
    from onbox.tomlread import load_toml

    try:
        data = load_toml(run_file, "run file")
    except Exception:
        return None, []
    table = data.get("run", data) if isinstance(data, dict) else {}
    table = table if isinstance(table, dict) else {}
    name, command = table.get("name"), table.get("command")
    return (name if isinstance(name, str) else None), [str(c) for c in command] if isinstance(command, list) else []


ADD_EXAMPLES = [
    "onbox queue add --name lr-3e-4 --durable /workspace/durable -- python3 train.py --lr 3e-4",
    "onbox queue add -- python3 train.py --lr 1e-3      # named q<ID>-train",
    "onbox queue add --name det-50ep -f det.toml -- python3 train.py --task det --epochs 50",
]


@queue.command("add", cls=LaidOut, usage="[OPTIONS] -- CMD [ARGS]...", examples=ADD_EXAMPLES,
               sections=[(heading, [f for f in flags if f != "--take-over"]) for heading, flags in RUN_SECTIONS],
               context_settings={"ignore_unknown_options": False, "allow_interspersed_args": False})
@run_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def add(command: List[str], run_file: Optional[str], foreground: bool, as_json: bool, resume_existing: bool,
        **flags: Any) -> int:
    """Queue a run of CMD, with the options of `onbox run`; `onbox queue run` starts it in its turn.

    The entry is resolved and checked now, as `onbox run` would (flags > ONBOX_* > run file > profile), and runs
    with exactly that configuration: editing the run file later changes nothing queued (rm and add again). Each
    entry is its own run: `--name` (default q<ID>-<script>), its run dir, durable prefix and heartbeats. Exit 2
    on bad input, 3 on an unfit box: nothing is queued then.
    """
    from onbox import paths
    from onbox.commands.run import say_warnings
    from onbox.launch.plan import prepare
    from onbox.queue.journal import PENDING, REMOVED
    from onbox.subsystems import preflight

    if foreground or resume_existing:
        raise UsageError("%s is not an option of a queue entry" % ("--foreground" if foreground else "--resume"),
                         hint="`onbox queue run --foreground` keeps the runner in the foreground")
    file_name, file_command = _peek_run_file(run_file)
    if not command and not file_command:
        raise UsageError("no command to queue", hint="onbox queue add [OPTIONS] -- CMD [ARGS...]")
    journal = _journal()
    user_named = bool(flags.get("name") or file_name)
    base = paths.command_base(list(command) or file_command)
    if not user_named:
        with journal.locked(exclusive=False):
            _, next_id = journal.read()
        flags["name"] = "q%d-%s" % (next_id, base)
    plan = prepare(flags, list(command), run_file)
    say_warnings(plan.warnings)
    cfg = plan.cfg
    with journal.locked():
        entries, next_id = journal.read()
        if not user_named and cfg.name != "q%d-%s" % (next_id, base):  # another add took that id meanwhile
            cfg.name = "q%d-%s" % (next_id, base)
            preflight(cfg)
        taken = [e for e in entries.values() if e.name == cfg.name and e.state != REMOVED]
        if taken or os.path.exists(paths.run_dir(cfg.name)):
            raise UsageError("the run name %s is taken (%s)" % (cfg.name, "queue entry %d" % taken[0].id if taken
                                                                  else "a run in %s" % paths.runs_dir()),
                             hint="give the entry another --name")
        record = {"op": "add", "id": next_id, "name": cfg.name, "config": cfg.to_dict(), "at": time.time()}
        journal.append(record)
    runner = _runner_doc(journal)
    if as_json:
        echo_json({"id": next_id, "name": cfg.name, "state": PENDING, "runner_alive": runner.get("alive")})
    else:
        click.echo("queued %d %s (%s)" % (next_id, cfg.name, "the running queue starts it in its turn"
                                          if runner.get("alive") else "start the queue with `onbox queue run`"))
    return 0


def _agent_alive(e: Any) -> bool:
    from onbox.proc import is_alive

    return bool(e.agent_pid) and is_alive(int(e.agent_pid), e.agent_start)


def _runner_doc(journal: Any) -> Dict[str, Any]:
    from onbox.proc import is_alive

    doc = journal.read_runner()
    doc["alive"] = bool(doc.get("pid")) and is_alive(int(doc["pid"]), doc.get("start_time")) and doc.get(
        "state") in (vocab.RUNNING, vocab.STOPPING)
    return doc


def queue_doc(journal: Any) -> Dict[str, Any]:
    """`onbox queue ls --json`: {"runner": {...}, "entries": [...], "problems": [...]}; each entry with its run's
    own state (state.json) beside the queue's."""
    from onbox.queue.journal import REMOVED
    from onbox.supervisor.rundir import RunDir

    with journal.locked(exclusive=False):
        entries, _ = journal.read()
    out = []
    for e in sorted(entries.values(), key=lambda x: x.id):
        if e.state == REMOVED:
            continue
        doc = e.to_dict()
        doc["agent_alive"] = e.state == RUNNING and _agent_alive(e)
        run = RunDir(doc["run_dir"]).read_state() or {}
        doc["run_state"] = run.get("state")
        doc["phase"] = (run.get("phase") or {}).get("name")
        out.append(doc)
    return {"schema": vocab.SCHEMA_QUEUE, "runner": _runner_doc(journal), "entries": out, "problems": journal.problems}


@queue.command("ls", cls=LaidOut, examples=["onbox queue ls", "onbox queue ls --json"])
@click.option("--json", "as_json", is_flag=True, help="Print the queue as JSON.")
def ls(as_json: bool) -> int:
    """The entries (id, state, run name, the run's own state, GPU, command) and the queue runner."""
    doc = queue_doc(_journal())
    if as_json:
        echo_json(doc)
    else:
        click.echo(render_queue(doc), nl=False)
    return 0


@queue.command("rm", cls=LaidOut, examples=["onbox queue rm 3          # by id",
                                             "onbox queue rm lr-3e-4    # or by run name"])
@click.argument("entry")
@click.option("--json", "as_json", is_flag=True, help="Print the removed entry as JSON.")
def rm(entry: str, as_json: bool) -> int:
    """Remove ENTRY (its id or run name) from the queue; refused while its agent runs. Its run dir stays."""
    from onbox.queue.journal import REMOVED, RUNNING

    journal = _journal()
    with journal.locked():
        entries, _ = journal.read()
        e = journal.find(entries, entry)
        if e.state == RUNNING and _agent_alive(e):
            raise UsageError("queue entry %d %s is running" % (e.id, e.name),
                             hint="`onbox stop %s` stops it (recorded as stopped), then `onbox queue rm %s`"
                                  % (e.name, e.id))
        journal.set_state(e, REMOVED)
    if as_json:
        echo_json(e.to_dict())
    else:
        click.echo("removed %d %s" % (e.id, e.name))
    return 0


@queue.command("run", cls=LaidOut, examples=["onbox queue run                # one entry at a time, detached",
                                              "onbox queue run --parallel 2   # two at a time",
                                              "onbox queue run --per-gpu --foreground"])
@click.option("--parallel", type=click.IntRange(1, 1024), default=None, metavar="N",
              help="Run N entries at a time (default 1).")
@click.option("--per-gpu", is_flag=True, help="One entry per GPU at a time, with CUDA_VISIBLE_DEVICES set.")
@click.option("--notice-source", type=click.Choice(["auto", "aws", "gcp", "azure", "none"]), default="auto",
              envvar="ONBOX_NOTICE_SOURCE", show_default=True, help="Cloud preemption notices for the runner.")
@click.option("--metadata-url", envvar="ONBOX_METADATA_URL", help="Base URL of the metadata service (override).")
@click.option("--foreground", is_flag=True, help="Stay in the foreground (exit 0 drained, 1 an entry failed, "
              "75 preempted).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def run(parallel: Optional[int], per_gpu: bool, notice_source: str, metadata_url: Optional[str], foreground: bool,
        as_json: bool) -> int:
    """Run the queue's entries in id order, each as its own `onbox run`; detaches once the first ones started.

    One entry at a time, or --parallel N, or one per GPU (--per-gpu); --foreground stays. Continues where a preempted runner stopped; entries added while it runs are run too. Exit 0 started (or
    nothing to run), 2 bad usage or a runner already running, 3 --per-gpu without GPUs.
    """
    from onbox import config, paths
    from onbox.queue.runner import QueueRunner, has_work
    from onbox.queue.slots import agent_argv, gpu_slots, parallel_slots
    from onbox.supervisor import detach

    if parallel is not None and per_gpu:
        raise UsageError("--parallel and --per-gpu exclude each other", hint="--per-gpu runs one entry per GPU")
    if metadata_url and config.url_problem(metadata_url):
        raise UsageError("--metadata-url %r: %s" % (metadata_url, config.url_problem(metadata_url)))
    raw_tick = config.env_overrides(os.environ).get("tick_interval") or "0.5"
    try:
        tick = float(raw_tick)
    except ValueError:
        raise UsageError("ONBOX_TICK_INTERVAL must be a number of seconds, not %r" % raw_tick,
                         hint="unset it (the runner ticks every 0.5 s) or give e.g. ONBOX_TICK_INTERVAL=0.5")
    config.check_range("tick_interval", tick)
    slots = gpu_slots() if per_gpu else parallel_slots(parallel or 1)
    journal = _journal()
    if not journal.exists() or not has_work(journal):
        _say({"ok": True, "started": [], "nothing": True}, as_json, "nothing to run: every entry is done, failed, "
             "stopped or removed (`onbox queue ls`)")
        return 0
    journal.create()
    lock = detach.RunLock(journal.runner_lock_path)
    if not lock.acquire():
        raise UsageError("the queue is already running (runner pid %s)" % (lock.owner() or "?"),
                         hint="`onbox queue ls` shows it; entries you add are picked up by that runner")
    lock.write_owner(os.getpid())
    runner = QueueRunner(journal, slots, agent_argv(), paths.runs_dir(), notice_source=notice_source,
                         metadata_url=metadata_url, tick=tick,
                         mode="one per GPU (%d)" % len(slots) if per_gpu else "")

    def agent(ready: Any) -> int:
        lock.write_owner(os.getpid())
        runner.on_ready = ready
        return runner.run()

    if foreground:
        try:
            return agent(lambda info: None)
        finally:
            lock.release()
    ok, info = detach.daemonize(agent, os.path.join(journal.root, "runner.log"))
    lock.release()
    if not ok:
        click.echo("onbox: the queue runner failed to start: %s" % info.get("error"), err=True)
        return int(ExitCode.JOB_FAILED)
    _say(info, as_json, "queue runner %s (%s): started %s" % (info.get("runner_pid"), info.get("mode"),
                                                             ", ".join(info.get("started") or []) or "nothing yet"))
    return 0


def _say(info: Dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        echo_json(info)
    else:
        click.echo(text)
