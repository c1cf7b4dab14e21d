"""`onboxctl tracker serve`: the embedded heartbeat tracker."""
from __future__ import annotations

import os
import secrets
from typing import Optional

import click

from onbox.errors import UsageError
from onbox.paths import onbox_home

TOKEN_ENV = "ONBOX_TRACKER_TOKEN"


def default_db() -> str:
    return os.path.join(onbox_home(), "tracker", "tracker.db")


def resolve_token(token_file: Optional[str], db: str) -> str:
    """--token-file, else $ONBOX_TRACKER_TOKEN, else a generated token kept beside the database (mode 0600)."""
    if token_file:
        try:
            with open(os.path.expanduser(token_file), encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as e:
            raise UsageError("cannot read the token file %s: %s" % (token_file, e.strerror),
                             hint="create it with one line holding the token, mode 600")
        if not token:
            raise UsageError("the token file %s is empty" % token_file)
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = os.path.join(os.path.dirname(os.path.abspath(db)), "tracker.token")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
        if token:
            return token
    from onbox.fsutil import atomic_write

    token = secrets.token_urlsafe(32)
    atomic_write(path, token + "\n", mode=0o600)
    click.echo("onboxctl tracker: generated a token in %s (give it to the agents as a file, never as a flag)"
               % path, err=True)
    return token


@click.group()
def tracker() -> None:
    """The embedded heartbeat tracker that agents push to and `onboxctl status` reads."""


@tracker.command()
@click.option("--db", "db", type=click.Path(dir_okay=False), default=None,
              help="SQLite database (WAL). Default: $ONBOX_HOME/tracker/tracker.db")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8787, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0: any free port; see --ready-file).")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None,
              help="File whose first line is the bearer token (else $ONBOX_TRACKER_TOKEN, else one is generated).")
@click.option("--public-read", is_flag=True, help="Allow reads (GET) without a token; writes always need one.")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Write {pid, host, port} here once listening (for scripts and tests).")
@click.option("--max-body", default=4 * 1024 * 1024, show_default=True, type=click.IntRange(1024, 1 << 30),
              help="Largest accepted request body in bytes (larger: 413).")
def serve(db: Optional[str], host: str, port: int, token_file: Optional[str], public_read: bool,
          ready_file: Optional[str], max_body: int) -> None:
    """Serve the tracker API v1 (controller/tracker/API.md) until interrupted."""
    from controller.tracker.app import serve as run_server

    db = db or default_db()
    os.makedirs(os.path.dirname(os.path.abspath(db)), exist_ok=True)
    token = resolve_token(token_file, db)
    try:
        run_server(db, host, port, token, public_read=public_read, ready_file=ready_file, max_body=max_body)
    except OSError as e:
        raise UsageError("cannot listen on %s:%d: %s" % (host, port, e.strerror or e),
                         hint="pick another --port, or 0 for any free one")
