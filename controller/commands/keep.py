"""`onboxctl keep [--once] [--interval S] [--json]`: the recovery loop (controller/keeper/)."""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, Optional, Tuple

import click

from controller.commands.params import Seconds
from onbox import vocab
from onbox.clikit import LaidOut
from onbox.errors import JobFailed, UsageError


def _line(ev: Dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(ev.get("time") or time.time()))
    who = "%s: " % ev["run"] if ev.get("run") else ""
    return "keep %s %s%s" % (stamp, who, ev.get("text", ""))


@click.command("keep", cls=LaidOut, examples=[
    "onboxctl keep                   # in tmux or under systemd, on a machine that stays up",
    "onboxctl keep --once --json     # one pass (cron)", "onboxctl keep --run gpt --probe-timeout 30"])
@click.option("--once", is_flag=True, help="One pass over every run, then exit (for cron).")
@click.option("--interval", type=Seconds(0.05, 3600), default=5.0, show_default=True,
              help="Seconds between passes.")
@click.option("--run", "runs", multiple=True, help="Only this run (repeatable).")
@click.option("--tracker", default=None, help="Tracker URL for the runs' beats (default: ONBOX_TRACKER, config.toml, "
                                              "else each run's own --tracker).")
@click.option("--tracker-token-file", default=None, type=click.Path(dir_okay=False),
              help="File holding the tracker's token (default: ONBOX_TRACKER_TOKEN, then config.toml).")
@click.option("--probe-timeout", type=Seconds(1, 600), default=20.0, show_default=True,
              help="Seconds one ssh probe of a box may take before it counts as failed.")
@click.option("--suspect-timeout", type=Seconds(0.5, 120), default=3.0, show_default=True,
              help="Seconds a box in doubt (its beats late, or a probe of it failed) may take to answer at all: "
                   "with its beats late and no answer in that time it is lost at once.")
@click.option("--json", "as_json", is_flag=True, help="Every event as a JSON line, and each pass's summary.")
def keep(once: bool, interval: float, runs: Tuple[str, ...], tracker: Optional[str],
         tracker_token_file: Optional[str], probe_timeout: float, suspect_timeout: float, as_json: bool) -> None:
    """Watch every run launched with `--recover pool:NAME` and bring it back without you.

    A run preempted on a box that answers is relaunched there; a run whose beats are late AND whose box fails ssh
    for --lost-after (or, beats late, does not answer at all within --suspect-timeout) is recovered on the first
    healthy idle spare of its pool, else on a box its --provision command brings up, with `onbox run --take-over`;
    the lost box is asked once more right before, and a run whose agent answers alive is left where it is. Every
    box is asked at once, and recoveries go on at once. A keeper that reaches too few of its boxes (under a quarter,
    and no tracker beyond this machine answers) suspects its own network and declares nothing lost until it sees
    again. Every decision is written to $ONBOX_CONFIG_DIR/runs/<run>/
    recovery.json before it is acted on: a keeper killed at any point and started again finishes the same
    recovery, never launching twice. Nothing is ever torn down. Foreground; run it under systemd or tmux.

    Exit codes (--once): 0 the pass was done, 1 a run ended failed_no_resource (or another failed_* state) in it,
    2 a record could not be read (said in one line; that run is left alone).
    """
    from controller import userconfig
    from controller.boxes.inventory import Inventory
    from controller.boxes.ssh import Ssh, settings_from_env
    from controller.keeper.lock import KeeperLock
    from controller.keeper.loop import Keeper, PassReport
    from controller.keeper.records import RecordStore
    from controller.keeper.world import World
    from controller.launch.start import check_name

    for r in runs:
        check_name(r)
    store = RecordStore()
    known = store.runs()
    missing = [r for r in runs if r not in known]
    if missing:
        raise UsageError("no launch record for run %s in %s" % (", ".join(missing), store.root),
                         hint="`onboxctl run ... --recover pool:NAME` records a run for the keeper")
    url = userconfig.tracker_url(tracker)
    token = userconfig.tracker_token(tracker_token_file)
    lock = KeeperLock(store.root).acquire(create=not once)

    def say(ev: Dict[str, Any]) -> None:
        if ev.get("kind") == vocab.KEPT_RECORD_PROBLEM and once and not as_json:
            return  # --once ends with it as its one `onboxctl: ...` line
        click.echo(json.dumps(ev, sort_keys=True) if as_json else _line(ev))
        sys.stdout.flush()

    def on_pass(report: PassReport) -> None:
        if as_json:
            click.echo(json.dumps(report.to_dict(), sort_keys=True))
            sys.stdout.flush()

    world = World(Ssh(settings_from_env()), Inventory(), probe_timeout=probe_timeout, tracker=url, token=token)
    keeper = Keeper(store, world, say=say, runs=list(runs), suspect_timeout=suspect_timeout)
    if not as_json:
        click.echo("keep: watching %d run(s) in %s%s" % (len(runs or known), store.root,
                                                        "" if once else " every %gs (Ctrl-C to stop)" % interval))
    try:
        report = keeper.run(interval, once=once, on_pass=on_pass)
    except KeyboardInterrupt:
        return
    finally:
        lock.release()
    if report.problems:
        first = report.problems[0]
        raise UsageError(str(first["text"]) + ("" if len(report.problems) == 1 else " (and %d more record problem(s))"
                                               % (len(report.problems) - 1)), hint=first["hint"])
    if report.failed:
        raise JobFailed("%d run(s) could not be recovered: %s" % (len(report.failed), ", ".join(report.failed)),
                        hint="`onboxctl status` says why; add a spare to the pool (onboxctl box add NAME --host ... "
                             "--pool POOL) and relaunch with `onboxctl run ... --recover pool:POOL`")
