"""`onboxctl tunnel [BOX...] [--close] [--keep]`: the reverse tunnels that carry boxes' heartbeats home."""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import click

from controller.boxes.inventory import Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from controller.boxes.tunnel import (
    Records,
    Tunnel,
    WatchKnobs,
    close_tunnels,
    is_open,
    open_tunnel,
    start_supervisor,
)
from controller.commands.params import Seconds
from onbox.clikit import LaidOut, echo_json
from onbox.clock import Clock, SystemClock
from onbox.errors import OnboxError, UnfitError, UsageError

Key = Tuple[str, str]


def clock(t: Optional[float]) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "?"


def _row(t: Tunnel, records: Records, state: str, error: Optional[str] = None) -> Dict[str, Any]:
    """What `tunnel` says of one tunnel: its state now (open, reopened, down, closed) and its record's story."""
    # since: when it went up, or down (None when down and no one has recorded since when)
    since = t.since if state != "down" or t.state == "down" else None
    row: Dict[str, Any] = {"box": t.box, "to": t.local, "box_port": t.remote_port, "state": state, "since": since,
                           "reopens": t.reopens, "supervisor": t.supervisor_pid if t.supervised() else None,
                           "log": records.log_path(t)}
    if error or (state == "down" and t.last_error):
        row["error"] = error or t.last_error
    return row


def _look(ssh: Ssh, inv: Inventory, records: Records, key: Key, reopen: bool, knobs: WatchKnobs) -> Dict[str, Any]:
    """One tunnel now: open, or (with `reopen`) re-opened at once; a supervisor started where none runs."""
    t = records.get(key)
    if t is None:
        return {"box": key[0], "to": key[1], "state": "closed"}
    error = None
    try:
        box = inv.resolve(t.box)
        if is_open(ssh, t, box):
            state = "open"
        elif reopen:
            host, _, port = t.local.rpartition(":")
            open_tunnel(ssh, box, "http://%s:%s" % (host, port), records)
            state = "reopened"
        else:
            state = "down"
    except OnboxError as e:
        state, error = "down", e.message
    if knobs.enabled and not (records.get(key) or t).supervised():
        pid, why = start_supervisor(t, records, knobs)
        if pid is None and why:
            error = error or "no supervisor: %s" % why
    return _row(records.get(key) or t, records, state, error)


def _line(r: Dict[str, Any]) -> str:
    head = "tunnel: %s 127.0.0.1:%s -> %s: " % (r["box"], r.get("box_port", "?"), r["to"])
    state = r["state"]
    if state == "closed":
        return head + "closed"
    how = "supervised by pid %s" % r["supervisor"] if r.get("supervisor") else "not supervised"
    reopens = "%s re-open%s" % (r.get("reopens") or 0, "" if r.get("reopens") == 1 else "s")
    if state in ("open", "reopened"):
        return head + "%s (up since %s, %s, %s)" % (state, clock(r.get("since")), reopens, how)
    return head + "down%s (%s, %s)" % (" since %s" % clock(r["since"]) if r.get("since") else "",
                                       r.get("error") or "its ssh master is gone", how)


def _change(before: Dict[str, Any], now: Dict[str, Any]) -> Optional[str]:
    """The line for what changed between two looks at one tunnel (None when nothing did)."""
    head = "tunnel: %s 127.0.0.1:%s -> %s: " % (now["box"], now.get("box_port", before.get("box_port", "?")),
                                                 now["to"])
    was_up, up = before["state"] in ("open", "reopened"), now["state"] in ("open", "reopened")
    if now["state"] == "closed":
        return None if before["state"] == "closed" else head + "closed"
    if was_up and not up:
        return head + "down at %s (%s)" % (clock(now.get("since") or time.time()),
                                           now.get("error") or "its ssh master is gone")
    if up and (not was_up or (now.get("reopens") or 0) > (before.get("reopens") or 0)):
        down_at = before.get("since") if not was_up else None
        return head + "reopened at %s%s" % (clock(now.get("since")),
                                            " (down %.0f s)" % (now["since"] - down_at)
                                            if down_at and now.get("since") else "")
    if now.get("supervisor") != before.get("supervisor") and now.get("supervisor"):
        return head + "supervised by pid %s" % now["supervisor"]
    return None


@click.command("tunnel", cls=LaidOut, examples=[
    "onboxctl tunnel                 # every recorded tunnel, re-opened where it is down",
    "onboxctl tunnel gpu1 --keep     # and follow it until Ctrl-C", "onboxctl tunnel gpu1 --close"])
@click.argument("boxes", nargs=-1)
@click.option("--close", is_flag=True, help="Close the tunnels (and let their ssh master go) and forget them.")
@click.option("--keep", is_flag=True, help="Stay, check every --interval seconds, and print each change (down at T, "
                                           "reopened at T) until Ctrl-C.")
@click.option("--interval", type=Seconds(1, 3600), default=5.0, show_default=True,
              help="With --keep: seconds between checks.")
@click.option("--json", "as_json", is_flag=True, help="Print the tunnels as JSON (with --keep, one more document "
              "per change).")
def tunnel(boxes: Tuple[str, ...], close: bool, keep: bool, interval: float, as_json: bool) -> None:
    """Show, re-open (or with --close, close) the recorded reverse tunnels of BOX (default: every box with one).

    `onboxctl run` opens one when the tracker is on this machine; it lives in the box's ssh master connection,
    and a supervisor in the background re-opens it when the link drops (on the same port on the box, so the
    agent's tracker URL still holds; the beats the agent spooled meanwhile are delivered then). This command
    re-opens a tunnel that is down at once and starts a supervisor where none runs; --keep then follows them.
    """
    if close and keep:
        raise UsageError("--close and --keep contradict each other")
    knobs = WatchKnobs.from_env()
    records = Records()
    recorded = records.load()
    unknown = sorted(set(boxes) - {t.box for t in recorded})
    if unknown:
        raise UsageError("no tunnel recorded for %s" % ", ".join(unknown),
                         hint="`onboxctl run` opens one when its --tracker is on this machine")
    chosen = [t for t in recorded if not boxes or t.box in boxes]
    ssh = Ssh(settings_from_env())
    inv = Inventory()
    if close:
        done = []
        for name in sorted({t.box for t in chosen}):
            done += [t.to_dict() for t in close_tunnels(ssh, inv.resolve(name), records)]
        if as_json:
            echo_json({"closed": done})
        else:
            for t in done:
                click.echo("tunnel: closed %s 127.0.0.1:%s -> %s" % (t["box"], t["remote_port"], t["local"]))
        return
    if not chosen:
        click.echo("tunnel: none recorded (`onboxctl run` opens one when its --tracker is on this machine)")
        return
    keys = [t.key for t in chosen]
    rows = [_look(ssh, inv, records, k, True, knobs) for k in keys]
    if as_json:
        echo_json({"tunnels": rows})
    else:
        for r in rows:
            click.echo(_line(r))
    if not keep:
        down = [r for r in rows if r["state"] == "down"]
        if down:
            raise UnfitError("%d tunnel(s) could not be opened" % len(down),
                             hint="the box may be down; its agent keeps the beats until a tunnel is back%s" % (
                                 ", and the supervisor re-opens it then" if knobs.enabled else ""))
        return
    try:
        _follow(ssh, inv, records, keys, dict(zip(keys, rows)), interval, knobs, as_json, SystemClock())
    except KeyboardInterrupt:  # the way --keep ends: the supervisors keep the tunnels up without it
        return


def _follow(ssh: Ssh, inv: Inventory, records: Records, keys: List[Key], last: Dict[Key, Dict[str, Any]],
            interval: float, knobs: WatchKnobs, as_json: bool, waits: Clock) -> None:
    """--keep: look every `interval` seconds (`waits`: the clock seam), say each change once; until every tunnel is
    closed."""
    while any(r["state"] != "closed" for r in last.values()):
        waits.sleep(interval)
        changes: List[Tuple[Dict[str, Any], str]] = []
        for k in keys:
            # a tunnel down with no supervisor alive is re-opened here; with one, it does that and this only looks
            rec = records.get(k)
            now = _look(ssh, inv, records, k, rec is not None and not rec.supervised(), knobs)
            said = _change(last[k], now)
            if said:
                changes.append((now, said))
            last[k] = now
        if as_json and changes:
            echo_json({"tunnels": [r for r, _ in changes]})
        for _, said in changes if not as_json else []:
            click.echo(said)
        sys.stdout.flush()
