"""What onboxctl asks each box before it starts a node group (`onbox node probe --json`): the box's addresses
(so it can pick the ones the other nodes reach), a free TCP port for the rendezvous (node 0) and a free UDP port for
the agents' notices, and whether a run of that name still has a live agent (a group is relaunched together, never
around a node that still runs)."""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any, Dict, List, Optional

from onbox import fsutil, paths, vocab

SCHEMA = vocab.SCHEMA_NODE_PROBE
TERMINAL = vocab.TERMINAL_STATES


def addresses() -> List[Dict[str, Any]]:
    """The box's IPv4 addresses with their prefix length, loopback and link-local left out."""
    try:
        import psutil

        table = psutil.net_if_addrs()
    except Exception:  # no psutil (or no /sys): the address ssh reached the box by will have to do
        return []
    out = []
    for iface, addrs in sorted(table.items()):
        for a in addrs:
            if a.family != socket.AF_INET:
                continue
            try:
                ip = ipaddress.ip_address(a.address)
                prefix = ipaddress.ip_network("0.0.0.0/%s" % (a.netmask or "255.255.255.255")).prefixlen
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local:
                continue
            out.append({"addr": str(ip), "prefix": prefix, "iface": iface})
    return out


def free_port(kind: int) -> int:
    """A port the kernel says is free now (it may be taken before it is used: the launch then fails loudly)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def run_liveness(name: Optional[str]) -> Optional[Dict[str, Any]]:
    """State of run `name` on this box and whether its agent lives (PID and start time both match)."""
    if not name or not paths.valid_run_name(name):
        return None
    try:
        doc = fsutil.read_json(os.path.join(paths.run_dir(name), paths.STATE_FILE))
    except (OSError, ValueError):
        return {"name": name, "exists": os.path.isdir(paths.run_dir(name)), "state": None, "agent_alive": False}
    if not isinstance(doc, dict):
        doc = {}
    from onbox.proc import is_alive

    def lives(pid: Any, start: Any) -> bool:
        return isinstance(pid, int) and is_alive(pid, start if isinstance(start, int) else None)

    running = doc.get("state") not in TERMINAL
    # an agent that died leaves its job running (U3): a relaunch beside it would start the trainer twice
    return {"name": name, "exists": True, "state": doc.get("state"),
            "agent_alive": bool(running and lives(doc.get("agent_pid"), doc.get("agent_start_time"))),
            "child_alive": bool(running and lives(doc.get("child_pid"), doc.get("child_start_time")))}


def probe(run: Optional[str] = None) -> Dict[str, Any]:
    return {"schema": SCHEMA, "hostname": socket.gethostname(), "addrs": addresses(),
            "tcp_port": free_port(socket.SOCK_STREAM), "udp_port": free_port(socket.SOCK_DGRAM),
            "run": run_liveness(run)}
