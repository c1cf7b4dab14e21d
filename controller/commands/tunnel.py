"""`onboxctl tunnel [BOX...] [--close] [--keep]`: the reverse tunnels that carry boxes' heartbeats home."""
from __future__ import annotations

import time
from typing import Dict, List, Tuple

import click

from controller.boxes import Inventory
from controller.commands.params import Seconds
from controller.ssh import Ssh, settings_from_env
from controller.tunnel import Records, Tunnel, close_tunnels, is_open, open_tunnel
from onbox.commands.clikit import echo_json
from onbox.errors import OnboxError, UnfitError, UsageError


def _reopen(ssh: Ssh, inv: Inventory, tunnels: List[Tunnel]) -> List[Dict[str, object]]:
    out = []
    for t in tunnels:
        row: Dict[str, object] = {"box": t.box, "to": t.local, "box_port": t.remote_port}
        try:
            box = inv.resolve(t.box)
            if is_open(ssh, t, box):
                row["state"] = "open"
            else:
                host, _, port = t.local.rpartition(":")
                open_tunnel(ssh, box, "http://%s:%s" % (host, port))
                row["state"] = "reopened"
        except OnboxError as e:
            row.update(state="down", error=e.message)
        out.append(row)
    return out


@click.command("tunnel")
@click.argument("boxes", nargs=-1)
@click.option("--close", is_flag=True, help="Close the tunnels (and let their ssh master go) and forget them.")
@click.option("--keep", is_flag=True, help="Keep re-opening them every --interval seconds until Ctrl-C.")
@click.option("--interval", type=Seconds(1, 3600), default=15.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def tunnel(boxes: Tuple[str, ...], close: bool, keep: bool, interval: float, as_json: bool) -> None:
    """Re-open (or with --close, close) the recorded reverse tunnels of BOX (default: every box with one).

    `onboxctl run` opens one when the tracker is on this machine; it lives in the box's ssh master connection,
    which stays after onboxctl exits until its link dies. Re-opened, it uses the same port on the box, so the
    agent's tracker URL still holds; the beats the agent spooled meanwhile are delivered then.
    """
    if close and keep:
        raise UsageError("--close and --keep contradict each other")
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
    while True:
        rows = _reopen(ssh, inv, chosen)
        if as_json:
            echo_json({"tunnels": rows})
        else:
            for r in rows:
                click.echo("tunnel: %s 127.0.0.1:%s -> %s: %s%s" % (r["box"], r["box_port"], r["to"], r["state"],
                                                                   " (%s)" % r["error"] if r.get("error") else ""))
        if not keep:
            down = [r for r in rows if r["state"] == "down"]
            if down:
                raise UnfitError("%d tunnel(s) could not be opened" % len(down),
                                 hint="the box may be down; its agent keeps the beats until a tunnel is back")
            return
        time.sleep(interval)
