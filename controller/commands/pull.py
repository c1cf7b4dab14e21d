"""`onboxctl pull BOX RUN [DEST]`: copy a run's committed checkpoints home, resumably, and verify them."""
from __future__ import annotations

import sys
from typing import Optional

import click

from controller.boxes.inventory import Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from controller.launch.start import check_name
from controller.results.pull import Transfer, pull_run
from onbox.clikit import LaidOut, echo_json
from onbox.errors import JobFailed


@click.command("pull", cls=LaidOut, examples=[
    "onboxctl pull gpu1 RUN ./results          # every committed checkpoint, each verified",
    "onboxctl pull gpu1 RUN --latest           # the newest only, into ./pulled/RUN/",
    "onboxctl pull gpu1 RUN ./results --bwlimit 50000 --json"])
@click.argument("box")
@click.argument("run")
@click.argument("dest", required=False, default="pulled", type=click.Path(file_okay=False))
@click.option("--latest", is_flag=True, help="Only the newest committed checkpoint.")
@click.option("--no-verify", is_flag=True, help="Copy without verifying (the teardown gate will still refuse).")
@click.option("--load/--no-load", default=None, help="Load with torch while verifying (default: when torch is installed).")
@click.option("--attempts", type=click.IntRange(1, 100), default=5, show_default=True, help="Tries per checkpoint.")
@click.option("--io-timeout", type=click.IntRange(1, 3600), default=30, show_default=True,
              help="Seconds without progress before an attempt is abandoned and retried.")
@click.option("--bwlimit", type=click.IntRange(1), default=None, help="Bandwidth cap in KiB/s (rsync --bwlimit).")
@click.option("--json", "as_json", is_flag=True, help="Print the pull report as JSON.")
def pull(box: str, run: str, dest: str, latest: bool, no_verify: bool, load: Optional[bool], attempts: int,
         io_timeout: int, bwlimit: Optional[int], as_json: bool) -> None:
    """Copy RUN's committed checkpoints, index and logs from BOX into DEST/RUN/ and verify each one.

    Interrupted? Run it again: every file resumes where it stopped (rsync --partial).
    """
    check_name(run)  # before anything: it becomes a local directory under DEST
    b = Inventory().resolve(box)
    ssh = Ssh(settings_from_env())
    tty = sys.stderr.isatty() and not as_json

    def progress(label: str, pct: int, rate: str) -> None:
        if tty:
            sys.stderr.write("\r  %-40s %3d%%  %-12s" % (label[:40], pct, rate))
            sys.stderr.flush()

    def say(msg: str) -> None:
        if as_json:
            return
        if tty:
            sys.stderr.write("\r\x1b[K")
        click.echo("pull: " + msg)

    tr = Transfer(ssh, b, attempts=attempts, io_timeout=io_timeout, progress=progress, bwlimit_kbps=bwlimit)
    report = pull_run(ssh, b, run, dest, latest_only=latest, verify=not no_verify, load=load, transfer=tr, say=say)
    say_pulled(report, run, box, as_json, verified=not no_verify,
               damaged="pull again; if it fails again the copy on the box is damaged: keep the box")


def say_pulled(report, run: str, source: str, as_json: bool, verified: bool, damaged: str) -> None:
    """A pull's last words (one line, or its --json document); a checkpoint that failed verification is exit 1
    with `damaged` as the hint. Shared by `onboxctl pull` and `onboxctl kaggle pull`."""
    if as_json:
        echo_json(report.to_dict())
    else:
        click.echo("pull: %s from %s -> %s: %d checkpoint(s), newest %s, %s (%.1f s)" % (
            run, source, report.dest, len(report.checkpoints), report.newest,
            "all verified" if report.ok else "NOT all verified", report.seconds))
    if not report.ok and verified:
        bad = [c["name"] for c in report.checkpoints if not c.get("ok")]
        raise JobFailed("verification failed for %s" % ", ".join(bad), hint=damaged)
