"""`onboxctl run BOX0 BOX1 ... --nodes -- torchrun ...`: one agent per box, started as one multi-node group.

1. Probe every box at once (`onbox node probe`): its addresses, a free TCP port (the rendezvous, on node 0) and
   a free UDP port (the agents' notices), and whether the node's run still has a live agent: a group is
   (re)launched whole or not at all.
2. Pick each node's address as the other nodes reach it: an address of the box inside a subnet every other box has
   an address in (the cluster's private network), else the inventory host (the address this machine reaches the
   box by). MASTER_ADDR is node 0's (or --master-addr), MASTER_PORT the free TCP port node 0 reported.
3. A fresh group id and 32-byte key; each node's group document goes to `onbox run --node-group -` over ssh's
   stdin, never an argv (U34). Node 0 starts first (it marks the durable target the others must see), then the
   others at once. If one fails to start, node 0 is asked to stop, and that stop reaches every node started.
Node N's run is `<name>.node<N>`; node 0's is `<name>`, the run that commits and that the teardown gate checks.
"""
from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import os
from typing import Any, Dict, List, Optional, Sequence

from controller.boxes.agent import REMOTE_PYZ
from controller.boxes.inventory import Box
from controller.boxes.ssh import Ssh
from controller.launch.start import LaunchResult, launch, parse_json_tail
from onbox import vocab
from onbox.errors import OnboxError, UsageError
from onbox.multinode.role import SCHEMA, check_addr, node_run_name


def probe_box(ssh: Ssh, box: Box, run: str, timeout: float) -> Dict[str, Any]:
    res = ssh.run(box.target(), [box.python, REMOTE_PYZ, "node", "probe", "--run", run, "--json"], timeout=timeout,
                  what="onbox node probe")
    doc = parse_json_tail(res.text)
    if doc.get("schema") != vocab.SCHEMA_NODE_PROBE:
        raise UsageError("box %s did not answer `onbox node probe`: %r" % (box.name, res.text[-200:]),
                         hint="push the current onbox.pyz first: onboxctl push %s" % box.name)
    return doc


def _private_first(addrs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return sorted(addrs, key=lambda a: not ipaddress.ip_address(a["addr"]).is_private)


def node_address(i: int, boxes: Sequence[Box], probes: Sequence[Dict[str, Any]]) -> str:
    """Where the other nodes reach box i: an address in a subnet they all share, else its inventory host."""
    others = [p.get("addrs") or [] for j, p in enumerate(probes) if j != i]
    for a in _private_first(list(probes[i].get("addrs") or [])):
        try:
            net = ipaddress.ip_network("%s/%s" % (a["addr"], a["prefix"]), strict=False)
            if net.prefixlen < 8:
                continue
            if all(any(ipaddress.ip_address(b["addr"]) in net for b in theirs) for theirs in others):
                return str(a["addr"])
        except (KeyError, ValueError):
            continue
    box = boxes[i]
    if not box.in_inventory:
        raise UsageError("cannot tell which address of %s the other nodes reach: its addresses share no subnet "
                         "with theirs, and %s is an ssh alias" % (box.name, box.name),
                         hint="add the box with its address (onboxctl box add %s --host ADDR ...), or give "
                              "--master-addr" % box.name)
    return check_addr(box.host, "the host of box %s" % box.name)


def group_docs(names: Sequence[str], addrs: Sequence[str], probes: Sequence[Dict[str, Any]], master_addr: str,
               group: str, key: bytes) -> List[Dict[str, Any]]:
    peers = [{"rank": i, "addr": a, "port": int(p["udp_port"])} for i, (a, p) in enumerate(zip(addrs, probes))]
    return [{"schema": SCHEMA, "group": group, "run": names[0], "rank": i, "nnodes": len(names),
             "master_addr": master_addr, "master_port": int(probes[0]["tcp_port"]), "peers": peers,
             "key": key.hex()} for i in range(len(names))]


def launch_group(ssh: Ssh, boxes: Sequence[Box], cmd: Sequence[str], base: str, onbox_args: Sequence[str],
                 workdir: Optional[str] = None, parallel: int = 8, timeout: float = 60.0,
                 onbox_env: Optional[Dict[str, str]] = None, tunnel_to: Optional[str] = None,
                 master_addr: Optional[str] = None) -> List[LaunchResult]:
    """Start the group; one LaunchResult per node, node 0 first (module docstring)."""
    if len(boxes) < 2:
        raise UsageError("--nodes needs two boxes or more", hint="onboxctl run gpu1 gpu2 --nodes -- torchrun ...")
    if len({b.name for b in boxes}) != len(boxes):
        raise UsageError("a box is named twice: each node needs its own box")
    names = [node_run_name(base, i) for i in range(len(boxes))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(parallel, len(boxes)))) as pool:
        probes = list(pool.map(lambda bn: probe_box(ssh, bn[0], bn[1], timeout), zip(boxes, names)))
    live = ["%s (%s on %s)" % (n, (p.get("run") or {}).get("state"), b.name) for b, n, p in zip(boxes, names, probes)
            if (p.get("run") or {}).get("agent_alive") or (p.get("run") or {}).get("child_alive")]
    if live:
        raise UsageError("the group %s still runs: %s" % (base, ", ".join(live)),
                         hint="stop it first (`onbox stop %s` on any node stops every node), then relaunch" % base)
    addrs = [node_address(i, boxes, probes) for i in range(len(boxes))]
    master = check_addr(master_addr, "--master-addr") if master_addr else addrs[0]
    docs = group_docs(names, addrs, probes, master, os.urandom(8).hex(), os.urandom(32))
    args = [*onbox_args, "--node-group", "-"]

    def one(i: int) -> LaunchResult:
        return launch(ssh, boxes[i], cmd, names[i], args, workdir, timeout, onbox_env, tunnel_to,
                      stdin=json.dumps(docs[i]).encode("utf-8"))

    first = one(0)
    if not first.ok:
        return [first] + [LaunchResult(box=b.name, name=n, ok=False, error="not started: node 0 did not start",
                                       exit_code=first.exit_code) for b, n in zip(boxes[1:], names[1:])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(parallel, len(boxes) - 1))) as pool:
        rest = list(pool.map(one, range(1, len(boxes))))
    results = [first, *rest]
    if not all(r.ok for r in rest):
        stop_group(ssh, boxes[0], names[0], timeout)
        first.error = "stopped: node(s) %s did not start" % ", ".join(str(i) for i, r in enumerate(results) if not r.ok)
        first.ok = False
    return results


def stop_group(ssh: Ssh, box: Box, run: str, timeout: float) -> None:
    """`onbox stop` on node 0 without waiting: its agent tells every other node (onbox/multinode/notices.py). Its own
    ssh call, never chained to a launch (U4)."""
    try:
        ssh.run(box.target(), [box.python, REMOTE_PYZ, "stop", run, "--no-wait"], timeout=timeout, check=False,
                what="onbox stop")
    except OnboxError:
        pass  # node 0 unreachable: the others fail their rendezvous and end under their restart policy
