"""`onboxctl down BOX [--yes] [--json]`: the teardown gate. It never runs a destructive command by default."""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import click

from controller.boxes.inventory import Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from controller.launch.start import check_name
from controller.results.teardown import (
    gate,
    meter_argv,
    meter_command,
    meter_sentence,
    passed_line,
    render,
    run_meter_stop,
)
from onbox.clikit import LaidOut, echo_json
from onbox.errors import JobFailed, UsageError


class GateRefused(JobFailed):
    """At least one run's newest checkpoint is not pulled and verified."""


def what_typing_does(tunnelled: bool, executes: bool, cmd: Optional[str]) -> str:
    """What typing the box name back to `onboxctl down` does, said in the prompt: onbox stops or deletes nothing on
    the box itself; it closes the tracker tunnel (when there is one) and says, or with --execute-meter-stop runs,
    the profile's command that stops the meter."""
    done = ["close its tracker tunnel"] if tunnelled else []
    if executes:
        done.append("RUN the meter-stop command `%s`" % cmd)
        return " and ".join(done)
    done.append("show how to stop its meter")
    return "%s (onboxctl stops and deletes nothing on the box: stopping the meter is yours to do)" % " and ".join(done)


@click.command("down", cls=LaidOut, examples=[
    "onboxctl down gpu1                  # asks you to type gpu1 back once every run is safe",
    "onboxctl down gpu1 --abandon old-run --yes",
    "onboxctl down gpu1 --execute-meter-stop   # also runs the profile's meter-stop command"])
@click.argument("box")
@click.option("--yes", is_flag=True, help="Do not ask for the box name to be typed back.")
@click.option("--abandon", multiple=True, metavar="RUN", help="Accept losing RUN's unpulled state (repeatable).")
@click.option("--execute-meter-stop", is_flag=True,
              help="Also RUN the profile's meter-stop command (destructive; off by default).")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict per run (and the meter-stop command) as "
              "JSON.")
def down(box: str, yes: bool, abandon: Tuple[str, ...], execute_meter_stop: bool, as_json: bool) -> None:
    """Check that BOX may be torn down: every run's newest durable checkpoint pulled AND verified locally.

    Refuses (exit 1) while any is not. When allowed, names each run for what it is (pulled and verified, or
    abandoned with --abandon) and says how to stop the meter: the profile's command (run only with
    --execute-meter-stop) or its own sentence.
    """
    for run in abandon:
        check_name(run)
    b = Inventory().resolve(box)
    report = gate(Ssh(settings_from_env()), b, abandoned=abandon)
    cmd = meter_command(report.meter, b)
    argv = meter_argv(cmd, report.meter.profile) if execute_meter_stop else None  # refused before anything is done
    if as_json:
        doc = report.to_dict()
        doc["meter_stop_command"] = cmd
        echo_json(doc)
    else:
        click.echo(render(report), nl=False)
    if not report.allowed:
        blocked = [v.run for v in report.runs if v.blocking]
        raise GateRefused("refusing to tear down %s: %d run(s) not safe: %s" % (box, len(blocked), ", ".join(blocked)),
                          hint="pull and verify first: onboxctl pull %s %s  (or --abandon RUN to accept the loss)"
                               % (box, blocked[0]))
    from controller.boxes.tunnel import Records, close_tunnels

    try:
        tunnelled = bool(Records().find(box))
    except UsageError as e:  # a damaged tunnel record: say so, the teardown verdict stands
        click.echo("note: %s" % e.message, err=True)
        tunnelled = False
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError("confirmation needed: type the box name back on a terminal, or pass --yes")
        typed = click.prompt("Type the box name (%s) to %s" % (box, what_typing_does(tunnelled, argv is not None, cmd)),
                             default="", show_default=False)
        if typed.strip() != box:
            raise UsageError("confirmation did not match %r: nothing done" % box)
    if not as_json:
        click.echo(passed_line(report))
        click.echo(meter_sentence(report.meter, cmd))
    try:
        for t in close_tunnels(Ssh(settings_from_env()), b) if tunnelled else []:  # the box goes: its tunnel too
            if not as_json:
                click.echo("Closed the tracker tunnel %s 127.0.0.1:%d -> %s." % (t.box, t.remote_port, t.local))
    except UsageError as e:  # a damaged tunnel record: say so, the teardown verdict stands
        click.echo("note: %s" % e.message, err=True)
    if argv is not None:  # destructive, asked for: said before it runs and after (stderr: --json keeps stdout)
        click.echo("onboxctl: running the meter-stop command of profile %s: %s" % (report.meter.profile, cmd),
                   err=True)
        done = run_meter_stop(argv, box)
        for text in (done.stdout, done.stderr):
            if text and text.strip():
                click.echo(text.rstrip("\n"), err=True)
        click.echo("onboxctl: the meter-stop command finished (exit 0): %s" % cmd, err=True)
