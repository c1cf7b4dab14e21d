"""Where onbox keeps its state on a box. One place, so every command agrees.

$ONBOX_HOME (default ~/.onbox, or /tmp/onbox-<uid> when $HOME is unwritable)
  runs/<run>/        one directory a run (mode 0700): its files are named in the table below, and nowhere else
  secrets/<NAME>     secrets for `onbox run --secret NAME` (`onboxctl secrets push` writes ~/.onbox/secrets/)

A run's default name is made here too (`default_run_name`), by the one rule `onbox run` and `onboxctl run` share.
"""
from __future__ import annotations

import os
import re
import time
from typing import Optional, Sequence

# ---- the files of a run directory, named here only: whoever reads or writes one joins its name to the run dir ---
CONFIG_FILE = "config.json"  # `onbox run`: the resolved RunConfig, the exact re-launch record
STATE_FILE = "state.json"  # the supervisor (atomic): state, attempts, last exit, warnings, phase
EVENTS_FILE = "events.jsonl"  # the supervisor's journal: one lifecycle event a line, append-only
SUMMARY_FILE = "training_status.md"  # the supervisor: the summary a person reads
PROGRESS_FILE = "progress.json"  # the trainer's newest progress: step, loss, eval_loss, lr, tokens/s, ..., time
CHECKPOINT_STATUS_FILE = "checkpoint_status.json"  # the checkpoint hook: newest checkpoints, last sync, warnings
OUTPUT_LOG = "output.log"  # the child's stdout and stderr (rotated: output.log.1, .2, ...)
AGENT_LOG = "agent.log"  # the detached agent's own stderr
LOCK_FILE = "lock"  # flock(2) held by the run's live agent
COMMIT_LOCK_FILE = "checkpoints.lock"  # flock(2) of whoever commits the run's checkpoints on this box
STOP_REQUEST = "stop.request"  # `onbox stop`: the agent stops the run at its next step
PREEMPT_FILE = "PREEMPTED"  # ONBOX_PREEMPT_FILE: exists once a preemption is under way
METRICS_FILE = "metrics.jsonl"  # ONBOX_METRICS_FILE: JSON lines the trainer may append
CHECKPOINTS_DIR = "checkpoints"  # ONBOX_CKPT_DIR when the run names none
CONTAINERS_DIR = "containers"  # a container job: the cidfile docker writes for each attempt (<n>.cid)
HEARTBEATS_DIR = "heartbeats"  # the heartbeat hook's: its spools, sequence counter and read positions
HEARTBEAT_SPOOL_DIR = os.path.join(HEARTBEATS_DIR, "spool-%s")  # % sink name: the beats not yet acknowledged
HEARTBEAT_SEQ_FILE = os.path.join(HEARTBEATS_DIR, "seq.json")  # the next heartbeat's seq
METRICS_POSITION_FILE = os.path.join(HEARTBEATS_DIR, "metrics_position.json")  # METRICS_FILE read up to here
MLFLOW_RUN_FILE = os.path.join(HEARTBEATS_DIR, "mlflow.json")  # the MLflow run the beats go to
HANG_STACKS_FILE = "hang-stacks.%d.txt"  # % attempt: a hung attempt's stacks and GPU state (supervisor/hang.py)
HANG_STACKS_RE = re.compile(r"^hang-stacks\.\d+(?:\.\d+)?\.txt$")  # those files (a 2nd hang of one attempt: .<n>)
STACKS_DIR = "stacks"  # ONBOX_STACKS_DIR: where a trainer that opted in has faulthandler dump its stacks
CHILD_EXIT_FILE = "child-exit.json"  # the attempt's keeper: how its child ended, for an adopting agent (shim.py)

RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SECRET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # what `onboxctl secrets push` accepts


def onbox_home() -> str:
    from onbox.environment import Environment

    env = Environment.read().home
    if env:
        return os.path.abspath(os.path.expanduser(env))
    home = os.path.expanduser("~")
    if home and home != "~" and os.access(home, os.W_OK):
        return os.path.join(home, ".onbox")
    return os.path.join("/tmp", "onbox-%d" % os.getuid())


def runs_dir() -> str:
    return os.path.join(onbox_home(), "runs")


def run_dir(name: str) -> str:
    return os.path.join(runs_dir(), name)


def ckpt_dir(named: Optional[str], run_dir: str) -> str:
    """The run's checkpoint dir (ONBOX_CKPT_DIR): the one its configuration names, else checkpoints/ in its run
    directory."""
    return named or os.path.join(run_dir, CHECKPOINTS_DIR)


def valid_run_name(name: str) -> bool:
    """Run names become directory names and tracker keys: letters, digits, '.', '_', '-'."""
    return bool(RUN_NAME_RE.fullmatch(name))


# What stands between a command and the program it runs: interpreters, launchers and their sub-commands
INTERPRETER_RE = re.compile(r"^python[0-9.]*$")  # python, python3, python3.11 (not python_train.py)
LAUNCHERS = ("bash", "sh", "env", "torchrun", "accelerate", "deepspeed", "uv")
LAUNCHER_VERBS = {"accelerate": "launch", "uv": "run"}
PROGRAM_MAX = 40  # characters of the program's name in a default run name (the whole name stays under 60)


def command_base(command: Sequence[str]) -> str:
    """The program a command runs, as a name: past interpreters, launchers, options, VAR=VALUE and bare
    numbers (an option's value). `python train.py` -> train, `python -m pkg.charlm` -> charlm,
    `uv run torchrun --nproc-per-node 8 train.py` -> train, `python -c CODE` -> python. Letters, digits, '_'
    and '-' only: never a '.', which marks a node's run (`<run>.node1`)."""
    prog = ""
    after = ""  # the launcher just passed, whose sub-command (`uv run`) is skipped too
    for i, tok in enumerate(command):
        base = os.path.basename(tok)
        if tok == "-m" and i + 1 < len(command):  # a module: its last dotted part
            prog = command[i + 1].rsplit(".", 1)[-1]
            break
        if tok == "-c":  # inline code: the interpreter is all there is to name
            break
        if INTERPRETER_RE.match(base) or base in LAUNCHERS:
            prog, after = base, base
            continue
        if not base or tok.startswith("-") or "=" in tok or tok.isdigit() or LAUNCHER_VERBS.get(after) == tok:
            continue
        prog = base[:-3] if base.endswith((".py", ".sh")) else base
        break
    safe = "".join(c if c.isalnum() or c in "_-" else "-" for c in prog)
    return safe.strip("-_")[:PROGRAM_MAX].strip("-_") or "run"


def default_run_name(command: Sequence[str], now: Optional[float] = None) -> str:
    """`<program>-<UTC date>-<UTC time>`, e.g. train-20260101-120000: the name `onbox run` and `onboxctl run` give
    a run of `command` started at `now` when the user names none. UTC and nothing random (no pid): the name
    goes to durable storage and the tracker, read from any time zone, and a relaunch must be able to derive it."""
    return "%s-%s" % (command_base(command), time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)))


def secrets_dir() -> str:
    return os.path.join(onbox_home(), "secrets")


def valid_secret_name(name: str) -> bool:
    """A file name inside secrets_dir(): never a path (no '/', no leading '.')."""
    return bool(SECRET_NAME_RE.fullmatch(name))


def home_problem() -> Optional[str]:
    """Why $ONBOX_HOME (or its runs/ directory) can never hold runs, or None. A home that does not exist yet is
    fine (nothing has run here); one that is, or sits under, a regular file is not: without this check
    `ONBOX_HOME=<a file> onbox status` printed nothing and exited 0."""
    home = onbox_home()
    for path in (home, runs_dir()):
        probe = path
        while not os.path.lexists(probe):
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        if os.path.lexists(probe) and not os.path.isdir(probe):
            return "%s is not a directory" % probe
    return None
