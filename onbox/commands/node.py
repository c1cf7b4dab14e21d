"""`onbox node probe`: what onboxctl asks each box before it starts a multi-node group (onbox/multinode/probe.py)."""
from __future__ import annotations

import json
from typing import Optional

import click

from onbox.clikit import LaidOut, echo_json


@click.group()
def node() -> None:
    """A box as a node of a multi-node group (`onboxctl run BOX... --nodes` drives these)."""


@node.command("probe", cls=LaidOut, examples=["onbox node probe", "onbox node probe --run big --json   # what onboxctl run --nodes asks"])
@click.option("--run", "run", default=None, help="Also say whether run RUN has a live agent here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def probe(run: Optional[str], as_json: bool) -> None:
    """This box's IPv4 addresses, a free TCP and a free UDP port, and RUN's liveness."""
    from onbox.multinode.probe import probe as do_probe

    doc = do_probe(run)
    if as_json:
        echo_json(doc)
        return
    click.echo("host %s" % doc["hostname"])
    for a in doc["addrs"]:
        click.echo("  %s/%d (%s)" % (a["addr"], a["prefix"], a["iface"]))
    click.echo("free ports: tcp %d, udp %d" % (doc["tcp_port"], doc["udp_port"]))
    if doc["run"] is not None:
        click.echo("run %s" % json.dumps(doc["run"], sort_keys=True))
