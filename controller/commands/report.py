"""`onboxctl report`: the goodput ledger of every run (or one), per run, box, profile or pool, over a window."""
from __future__ import annotations

import time
from typing import Optional

import click

from controller import userconfig
from onbox.clikit import LaidOut, echo_json
from onbox.errors import UsageError


@click.command("report", cls=LaidOut, examples=[
    "onboxctl report                    # every run, since it began", "onboxctl report RUN --since 7d",
    "onboxctl report --by pool --json"])
@click.argument("run", required=False)
@click.option("--since", default=None, metavar="DUR", help="Only the last DUR of wall time: 90m, 12h, 7d, 4w "
                                                             "(default: since each run began).")
@click.option("--by", "by", type=click.Choice(["run", "box", "profile", "pool"]), default="run", show_default=True,
              help="One line per run, box, profile (platform) or pool (the inventory says each box's).")
@click.option("--tracker", default=None, help="Tracker URL (default: ONBOX_TRACKER, then config.toml).")
@click.option("--tracker-token-file", default=None, type=click.Path(dir_okay=False),
              help="File holding the tracker's token (default: ONBOX_TRACKER_TOKEN, then config.toml).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (every run's ledger in `runs`).")
def report(run: Optional[str], since: Optional[str], by: str, tracker: Optional[str],
           tracker_token_file: Optional[str], as_json: bool) -> None:
    """How much of the runs' wall time became training they kept (goodput), and where the rest went.

    Each run's time since its first launch is split into productive (steps still in its lineage), recomputed
    (steps trained again after a preemption, a crash, a fence or a lost box), down (no trainer running), restoring
    (fetch and verify before the trainer starts), starting (to its first step) and stalled; the parts add up to the
    wall time. With prices (`onboxctl box add NAME --price 0.44`, or [profiles] in prices.toml) it says what each
    part cost; COST is all of it, LOST what was not productive. The ledgers are the tracker's (its dashboard and
    /metrics show the same).
    """
    from controller.boxes.inventory import Inventory, config_dir
    from controller.goodput.prices import load_prices
    from controller.goodput.report import group, parse_since, render, window_label
    from controller.launch.start import check_name
    from controller.tracker.client import fetch_ledgers

    if run is not None:
        check_name(run)
    window = parse_since(since) if since is not None else None
    url = userconfig.tracker_url(tracker)
    if not url:
        raise UsageError("no tracker to read the ledgers from",
                         hint="pass --tracker URL (or set ONBOX_TRACKER, or tracker in config.toml): the tracker "
                              "your runs send their beats to")
    token = userconfig.tracker_token(tracker_token_file)
    boxes = Inventory().load()
    prices = load_prices(config_dir())
    doc = fetch_ledgers(url, token, time.time() - window if window is not None else None, run)
    runs = doc["runs"]
    if run is not None and not runs:
        raise UsageError("the tracker at %s has no beats of run %r" % (url, run),
                         hint="`onboxctl status` lists the runs it knows")
    groups = group(runs, by, boxes, prices)
    problems = [p for p in doc.get("problems") or [] if isinstance(p, str)]
    if as_json:
        echo_json({"tracker": url, "since": doc.get("since"), "now": doc.get("now"), "by": by,
                   "groups": [g.to_dict() for g in groups], "runs": runs, "problems": problems})
        return
    click.echo("goodput %s (tracker %s)" % (window_label(window), url))
    for line in render(groups, by, problems):
        click.echo(line)
