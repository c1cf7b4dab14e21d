"""`onboxctl`: the local controller's command line. Commands live in controller/commands/ and load lazily."""
from __future__ import annotations

from typing import List, Optional

import click

from onbox import __version__
from onbox.clikit import LazyGroup, run_cli

C = "controller.commands."
COMMANDS = {
    "box": (C + "boxes", "box", "Manage the inventory of boxes (add, ls, rm, forget-key)."),
    "push": (C + "push", "push", "Copy onbox.pyz and your code to a box, and verify what landed."),
    "secrets": (C + "push", "secrets", "Push a secret to a box via stdin (never argv)."),
    "run": (C + "launch", "run", "Launch a supervised run on one or more boxes; returns at once."),
    "status": (C + "status", "status", "Every run of every box: state, step, loss, GPU, heartbeat age."),
    "stop": (C + "stop", "stop", "Stop a run gracefully: it checkpoints, commits and exits (the box's agent does it)."),
    "logs": (C + "status", "logs", "Show (or follow) a run's log on a box."),
    "queue": (C + "queue", "queue", "A box's run queue: entries, their states, the runner."),
    "pull": (C + "pull", "pull", "Copy a run's committed checkpoints home and verify them."),
    "down": (C + "teardown", "down", "Teardown gate: refuses until every run's newest checkpoint is pulled and verified."),
    "tracker": (C + "tracker", "tracker", "The embedded heartbeat tracker (serve)."),
    "tunnel": (C + "tunnel", "tunnel", "Show, re-open or close the ssh tunnels that carry boxes' heartbeats home."),
    "keep": (C + "keep", "keep", "Watch runs launched with --recover and bring them back without you."),
    "report": (C + "report", "report", "Goodput: how much of each run's time (and cost) became training it kept."),
    "kaggle": (C + "kaggle", "kaggle", "Kaggle kernels as a target: push a run's next session, its status, logs, "
                                       "pull its output."),
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="onboxctl")
def cli() -> None:
    """onboxctl drives rented GPU boxes over OpenSSH: push, launch, watch, pull, verify and tear down safely.

    Exit codes: 0 done, 1 failed, 2 bad usage, 3 environment unfit.
    """


def main(argv: Optional[List[str]] = None) -> None:
    run_cli(cli, "onboxctl", argv)
