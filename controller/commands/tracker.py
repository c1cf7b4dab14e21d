"""`onboxctl tracker serve`: the embedded heartbeat tracker."""
from __future__ import annotations

import os
import secrets
import sys
from typing import List, Optional, Tuple

import click

from controller.commands.params import Seconds
from onbox.clikit import LaidOut
from onbox.environment import TRACKER_TOKEN_VAR, Environment
from onbox.errors import UsageError
from onbox.paths import onbox_home


def default_db() -> str:
    return os.path.join(onbox_home(), "tracker", "tracker.db")


def read_token_file(token_file: str) -> str:
    """The first line of --token-file, read by the agent's one token reader (a regular file of at most
    TOKEN_MAX_BYTES: /dev/zero or a FIFO is one clear line); a one-line warning when group or others may read it."""
    from onbox import fsutil

    try:
        token = fsutil.read_token_file(token_file)
    except OSError as e:
        raise UsageError("cannot read the token file %s: %s" % (token_file, e.strerror or e),
                         hint="create it with one line holding the token, mode 600")
    if not token:
        raise UsageError("the token file %s is empty" % token_file,
                         hint="put the token on its first line (e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE`)")
    if any(ord(c) < 32 or ord(c) == 127 for c in token):
        raise UsageError("the token file %s holds control characters" % token_file,
                         hint="put the token on its first line, nothing else")
    mode = fsutil.readable_by_others(os.path.expanduser(token_file))
    if mode is not None:
        click.echo("onboxctl tracker: warning: the token file %s is readable by %s (mode %04o): chmod 600 %s"
                   % (token_file, "others" if mode & 0o007 else "its group", mode, token_file), err=True)
    return token


def resolve_token(token_file: Optional[str], db: str) -> str:
    """--token-file, else $ONBOX_TRACKER_TOKEN, else a generated token kept beside the database (mode 0600)."""
    return resolve_token_where(token_file, db)[0]


def resolve_token_where(token_file: Optional[str], db: str) -> Tuple[str, str]:
    """(the token, where it is in words: "in FILE", "from $ONBOX_TRACKER_TOKEN"); the token itself is never said."""
    if token_file:
        return read_token_file(token_file), "in %s" % os.path.abspath(os.path.expanduser(token_file))
    token = Environment.read().tracker_token
    if token:
        return token, "from $%s" % TRACKER_TOKEN_VAR
    path = os.path.join(os.path.dirname(os.path.abspath(db)), "tracker.token")
    if os.path.exists(path):
        token = read_token_file(path)
        if token:
            return token, "in %s" % path
    from onbox.fsutil import atomic_write

    token = secrets.token_urlsafe(32)
    atomic_write(path, token + "\n", mode=0o600)
    click.echo("onboxctl tracker: generated a token in %s (give it to the agents as a file, never as a flag)"
               % path, err=True)
    return token, "in %s" % path


def url_host(host: str) -> str:
    """`host` as it goes in a URL: an IPv6 address in brackets."""
    host = host.strip("[]")
    return "[%s]" % host if ":" in host else host


def announcement(host: str, port: int, tls: bool, token_where: str, public_read: bool, db: str) -> List[str]:
    """What `tracker serve` says once it serves (two lines, on stderr): where it listens, its database, the
    dashboard's URL and where the token is (never the token). A wildcard address (0.0.0.0, ::) gets the loopback
    URL for the dashboard, and is said to be every address of this machine."""
    scheme = "https" if tls else "http"
    wildcard = host.strip("[]") in ("0.0.0.0", "::")
    here = ("[::1]" if ":" in host else "127.0.0.1") if wildcard else url_host(host)
    token = ("reads need no token (--public-read), writes need the one %s" % token_where if public_read
             else "log in with the token %s" % token_where)
    return ["onboxctl tracker: listening on %s://%s:%d%s (pid %d, database %s)" % (
                scheme, url_host(host), port, ", every address of this machine" if wildcard else "", os.getpid(), db),
            "onboxctl tracker: dashboard %s://%s:%d/%s; %s" % (
                scheme, here, port, " (from elsewhere: this machine's name or address)" if wildcard else "", token)]


@click.group()
def tracker() -> None:
    """The embedded heartbeat tracker that agents push to and `onboxctl status` reads."""


SERVE_EXAMPLES = [
    "onboxctl tracker serve --token-file ~/.onbox-token   # on 127.0.0.1:8787; boxes reach it through ssh tunnels",
    "onboxctl tracker serve --host 0.0.0.0 --tls-cert cert.pem --tls-key key.pem --token-file ~/.onbox-token",
    "onboxctl tracker serve --port 0 --ready-file ready.json   # any free port, written to ready.json",
]
SERVE_SECTIONS = [
    ("Serving beyond this machine", ["--tls-cert", "--tls-key", "--allowed-host"]),
    ("Limits and timeouts", ["--max-body", "--header-timeout", "--body-timeout", "--write-timeout", "--keep-alive",
                             "--max-conns-per-client", "--max-conns"]),
    ("Advanced", ["--ready-file", "--pulls-record"]),
]


@tracker.command(cls=LaidOut, examples=SERVE_EXAMPLES, sections=SERVE_SECTIONS)
@click.option("--db", "db", type=click.Path(dir_okay=False), default=None,
              help="SQLite database (WAL), created 0600. Default: $ONBOX_HOME/tracker/tracker.db")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Keep 127.0.0.1 and let `onboxctl run` tunnel the boxes in; a public "
                   "address wants --tls-cert/--tls-key.")
@click.option("--port", default=8787, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0: any free port; see --ready-file).")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None,
              help="File whose first line is the bearer token (else $ONBOX_TRACKER_TOKEN, else one is generated).")
@click.option("--public-read", is_flag=True, help="Allow reads (GET) without a token; writes always need one.")
@click.option("--ready-file", type=click.Path(dir_okay=False), default=None,
              help="Write {pid, host, port, scheme} here once listening (for scripts and tests).")
@click.option("--max-body", default=4 * 1024 * 1024, show_default=True, type=click.IntRange(1024, 1 << 30),
              help="Largest accepted request body in bytes (larger: 413).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), default=None,
              help="Serve HTTPS with this PEM certificate (chain); needs --tls-key.")
@click.option("--tls-key", type=click.Path(dir_okay=False), default=None, help="The certificate's PEM private key.")
@click.option("--header-timeout", type=Seconds(0, 3600, open_lo=True), default=15.0, show_default=True,
              help="Seconds a client has to send a request's headers (from connecting, or its next request's "
                   "first byte).")
@click.option("--body-timeout", type=Seconds(0, 3600, open_lo=True), default=30.0, show_default=True,
              help="Seconds a client has to send a request body, plus one per 16 KiB of it.")
@click.option("--write-timeout", type=Seconds(0, 3600, open_lo=True), default=60.0, show_default=True,
              help="Seconds a client may leave its answer unread (its receive window full) before it is dropped.")
@click.option("--keep-alive", type=click.IntRange(1, 3600), default=30, show_default=True,
              help="Seconds an idle connection stays open between requests.")
@click.option("--max-conns-per-client", type=click.IntRange(1, 1 << 20), default=256, show_default=True,
              help="Open connections per client address (agents behind tunnels all come from 127.0.0.1).")
@click.option("--max-conns", type=click.IntRange(1, 1 << 20), default=2048, show_default=True,
              help="Open connections in all.")
@click.option("--pulls-record", type=click.Path(dir_okay=False), default=None,
              help="The pulls record the dashboard reads to show whether a run's newest durable checkpoint was "
                   "pulled and verified here. Default: $ONBOX_CONFIG_DIR/pulls.json (what `onboxctl pull` writes).")
@click.option("--allowed-host", "allowed_host", multiple=True, metavar="NAME",
              help="Also answer requests naming this host (repeatable): a DNS name or a reverse proxy's public name "
                   "the tracker is reached by. Addresses, localhost and the --host name are always answered; any "
                   "other Host gets 421 (a page on another site must not read the tracker through DNS rebinding).")
def serve(db: Optional[str], host: str, port: int, token_file: Optional[str], public_read: bool,
          ready_file: Optional[str], max_body: int, tls_cert: Optional[str], tls_key: Optional[str],
          header_timeout: float, body_timeout: float, write_timeout: float, keep_alive: int, max_conns_per_client: int,
          max_conns: int, pulls_record: Optional[str], allowed_host: Tuple[str, ...]) -> None:
    """Serve the tracker API v1 (controller/tracker/API.md) and its dashboard at / until interrupted.

    Once it serves, it says on stderr where it listens, its database, the dashboard's URL and where the token is
    (the file, or $ONBOX_TRACKER_TOKEN; never the token itself). Requests naming a Host it does not serve (its
    addresses, localhost, the --host name, this machine's name when it listens on every address, --allowed-host)
    are refused with 421: controller/tracker/README.md says why."""
    from controller.tracker.guard import Limits
    from controller.tracker.hosts import AllowedHosts, check_allowed_host
    from controller.tracker.server import bind, check_tls, is_loopback
    from controller.tracker.server import serve as run_server
    from controller.tracker.store import open_store

    os.umask(0o077)  # the database, its WAL/SHM, the token and the ready file: this user's only
    db = os.path.abspath(os.path.expanduser(db or default_db()))
    # everything the user can get wrong is checked before anything is created (no half-made tracker dir)
    allowed = AllowedHosts(host, [check_allowed_host(name) for name in allowed_host])
    token = read_token_file(token_file) if token_file else None
    if pulls_record is None:  # before anything is made: a config dir that is a file is refused here
        from controller.boxes.inventory import config_dir

        pulls_record = os.path.join(config_dir(), "pulls.json")
    tls = check_tls(tls_cert, tls_key)
    sock = bind(host, port)
    if not is_loopback(host) and not tls:
        click.echo("onboxctl tracker: warning: serving plain HTTP on %s: bearer tokens and heartbeats cross the "
                   "network in cleartext; give --tls-cert/--tls-key, or keep --host 127.0.0.1 and let "
                   "`onboxctl run` tunnel the boxes in over ssh" % host, err=True)
    store = None
    token_where = "in %s" % os.path.abspath(os.path.expanduser(token_file)) if token_file else ""
    try:
        store = open_store(db)
        if token is None:
            token, token_where = resolve_token_where(None, db)
    except BaseException:
        sock.close()
        if store is not None:
            store.close()
        raise
    limits = Limits(header_timeout=header_timeout, body_timeout=body_timeout, write_timeout=write_timeout,
                    max_per_client=max_conns_per_client, max_connections=max_conns)
    lines = announcement(host, sock.getsockname()[1], bool(tls), token_where, public_read, db)

    def ready() -> None:
        for line in lines:
            click.echo(line, err=True)
        sys.stderr.flush()

    run_server(store, sock, token, public_read=public_read, ready_file=ready_file, max_body=max_body,
               limits=limits, tls=tls, keep_alive=keep_alive, pulls_record=os.path.abspath(os.path.expanduser(pulls_record)),
               on_ready=ready, allowed_hosts=allowed)
