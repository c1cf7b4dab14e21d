"""`onboxctl stop BOX RUN [--grace S] [--wait [--timeout S]] [--json]`: the agent's graceful stop
(controller/launch/stop.py)."""
from __future__ import annotations

from typing import Optional

import click

from controller.commands.params import Seconds
from onbox.clikit import LaidOut, echo_json

STOP_EXAMPLES = [
    "onboxctl stop gpu1 RUN                 # ask, and return once the agent has the request",
    "onboxctl stop gpu1 RUN --wait          # and wait until it has ended: how, and its newest checkpoint",
    "onboxctl stop gpu1 RUN --grace 120 --wait --timeout 600",
]


@click.command("stop", cls=LaidOut, examples=STOP_EXAMPLES)
@click.argument("box")
@click.argument("run")
@click.option("--grace", type=Seconds(0, 86400), default=None, metavar="SECONDS",
              help="Seconds the trainer gets to checkpoint before the agent kills it (0-86400; default: the run's).")
@click.option("--wait/--no-wait", default=None,
              help="Wait until the run has ended (at most its grace plus a minute), then say how it ended and its "
                   "newest durable checkpoint; or return once the agent has the request (the default).")
@click.option("--timeout", type=Seconds(0, 86400), default=None, metavar="SECONDS",
              help="The longest wait (implies --wait; default: the grace plus a minute).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def stop(box: str, run: str, grace: Optional[float], wait: Optional[bool], timeout: Optional[float],
         as_json: bool) -> None:
    """Stop RUN on BOX gracefully: the trainer checkpoints, the agent commits the newest checkpoint, the run ends
    `stopped` and is not restarted. It is the box's own `onbox stop`, asked over ssh; nothing is killed from here.

    Returns once the agent has the request; --wait waits for the run's end (as `onbox stop` does on the box,
    whose --wait/--no-wait and --timeout these are). Exit 0 when the stop was asked (or,
    with --wait, the run has ended); 1 when the run had already ended or nothing of it runs (nothing was stopped),
    or --wait ran out of time (the agent still stops the run); 2 for a bad name or number, or a run the box does
    not have; 3 when the box cannot be reached.
    """
    import sys

    from controller.boxes.inventory import Inventory
    from controller.boxes.ssh import Ssh, settings_from_env
    from controller.launch.start import check_name
    from controller.launch.stop import render, stop_run
    from onbox.errors import UsageError

    check_name(run)
    b = Inventory().resolve(box)
    ssh = Ssh(settings_from_env())

    def say(line: str) -> None:
        if not as_json:
            click.echo(line)
            sys.stdout.flush()

    if wait is False and timeout is not None:
        raise UsageError("--timeout and --no-wait go separately", hint="--no-wait returns at once; --timeout S waits "
                                                                        "at most S s")
    report = stop_run(ssh, b, run, grace=grace, wait=wait or timeout is not None, say=say, timeout=timeout)
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo(render(report), nl=False)
