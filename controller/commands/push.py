"""`onboxctl push BOX [--code DIR]` and `onboxctl secrets push BOX NAME` (value on stdin)."""
from __future__ import annotations

import os
import sys
from typing import IO, List, Optional, Tuple, Union

import click

from controller.boxes.inventory import Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from controller.launch.push import EMPTY_SECRET, check_secret_name, default_pyz, push_secret, secret_input
from controller.launch.push import push as push_core
from controller.results.pull import PullsRecord
from onbox.clikit import LaidOut, echo_json
from onbox.errors import UsageError


@click.command("push", cls=LaidOut, examples=[
    "onboxctl push gpu1 --code .          # onbox.pyz and your code, verified on the box",
    "onboxctl push gpu1                   # onbox.pyz alone",
    "onboxctl push gpu1 --code . --delete --include-secret configs/dev.env"])
@click.argument("box")
@click.option("--code", "code_dir", type=click.Path(file_okay=False), default=None,
              help="Code directory to sync to the box (.gitignore honoured; the dirs `onboxctl pull` brought "
                   "checkpoints home into are left out, and named).")
@click.option("--pyz", default=None, type=click.Path(dir_okay=False), help="onbox.pyz to push (default: dist/onbox.pyz).")
@click.option("--include-secret", "include_secrets", multiple=True, metavar="PATH", help="Send this secret-looking "
              "file or directory of --code anyway (the path the warning names, relative to --code; repeatable). "
              "Without it such files (.env*, keys, kaggle.json, .netrc, credentials*, .git/, .ssh/, ...) are left "
              "out, and named on stderr; `onboxctl secrets push` moves a secret the job needs.")
@click.option("--delete", is_flag=True, help="Also delete files on the box that are gone locally.")
@click.option("--connect-timeout", type=click.IntRange(1, 600), default=None, help="ssh ConnectTimeout seconds.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
def push(box: str, code_dir: Optional[str], include_secrets: Tuple[str, ...], pyz: Optional[str], delete: bool,
         connect_timeout: Optional[int], as_json: bool) -> None:
    """Copy onbox.pyz (only when its hash differs) and your code to BOX, then verify on the box (U42)."""
    b = Inventory().resolve(box)
    ssh = Ssh(settings_from_env(connect_timeout=connect_timeout))
    say = None if as_json else (lambda m: click.echo("push: " + m))
    report = push_core(ssh, b, pyz or default_pyz(), code_dir=code_dir, delete=delete, progress=say,
                       include_secrets=include_secrets, pulled=pulled_dirs() if code_dir else ())
    if report.pulled_left_out and not as_json:
        click.echo("push: left out what `onboxctl pull` brought home (its record, %s): %s" % (
            PullsRecord().path, ", ".join(os.path.join(code_dir or ".", rel) + "/" for rel in report.pulled_left_out)))
    for line in report.warnings:  # on stderr, --json or not: the document carries them as secrets_left_out
        click.echo("onboxctl: warning: %s" % line, err=True)
    if as_json:
        echo_json(report.to_dict())
        return
    click.echo("push: verified on %s: onbox.pyz sha256 %s (%s)%s in %.1f s" % (
        box, report.pyz_sha256[:12], report.remote_version,
        ", code %s (%d files changed)" % (report.code_dir, report.code_files_changed) if report.code_dir else "",
        report.seconds))


def pulled_dirs() -> List[str]:
    """Every local dir `onboxctl pull` brought a run home into, from its record (pulls.json). A record that cannot
    be read is said on stderr, and nothing is left out for it."""
    try:
        pulls = PullsRecord().load()["pulls"]
    except UsageError as e:
        click.echo("onboxctl: warning: %s: what `onboxctl pull` brought home is not known, so not left out" % e.message,
                   err=True)
        return []
    return [str(p["dest"]) for p in pulls.values() if isinstance(p, dict) and isinstance(p.get("dest"), str)]


@click.group("secrets")
def secrets() -> None:
    """Move secrets to a box without them ever appearing in a command line (U34)."""


@secrets.command("push", cls=LaidOut, examples=[
    "onboxctl secrets push gpu1 tracker < ~/.onbox-token   # the job gets it with --secret tracker",
    "onboxctl secrets push gpu1 WANDB_API_KEY              # typed at a hidden prompt"])
@click.argument("box")
@click.argument("name")
def secrets_push(box: str, name: str) -> None:
    """Read a secret from stdin and store it on BOX as ~/.onbox/secrets/NAME (mode 0600)."""
    b = Inventory().resolve(box)
    check_secret_name(name)
    value: Union[bytes, IO[bytes]]
    if sys.stdin is not None and sys.stdin.isatty():
        typed = click.prompt("value for %s (hidden)" % name, hide_input=True, err=True, default="",
                             show_default=False).encode()
        if not typed.strip():
            raise EMPTY_SECRET
        value = typed
    else:
        # refused here when empty, before any connection; otherwise streamed to ssh, never whole in our memory
        value = secret_input(sys.stdin.fileno() if sys.stdin is not None else -1)
    path, size = push_secret(Ssh(settings_from_env()), b, name, value)
    click.echo("secrets: stored %s on %s at ~/%s (%d bytes, mode 0600)" % (name, box, path, size))
