"""A node's role in a multi-node run, and the node-group document an SSH group's agents are started with.

NodeRole is what both paths share: the node index (0 is the primary: it alone commits and is what the teardown
gate checks), the node count, and how a node's run is named (`<run>` on node 0, `<run>.node<N>` elsewhere, so
run dirs and heartbeats of nodes sharing a box or a tracker never collide).

The node-group document (schema onbox.node_group/1, a JSON file of mode 0600 under $ONBOX_HOME/nodes/) is written
by `onbox run --node-group -` from its stdin: onboxctl streams it over ssh, so the shared key never appears in an
argv, a config.json or a log (U34). config.json records only the file's path.

    {"schema": "onbox.node_group/1", "group": "<hex id>", "run": "<node 0's run name>", "rank": 1, "nnodes": 2,
     "master_addr": "10.0.0.2", "master_port": 29517,
     "peers": [{"rank": 0, "addr": "10.0.0.2", "port": 40211}, {"rank": 1, "addr": "10.0.0.3", "port": 40893}],
     "key": "<64 hex digits>"}
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import stat
from typing import Any, Dict, List, Optional, Tuple

from onbox import fsutil, paths, untrusted, vocab
from onbox.errors import UsageError

SCHEMA = vocab.SCHEMA_NODE_GROUP
GROUP_ID_RE = re.compile(r"^[0-9a-f]{8,64}$")
HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}$")  # a DNS name; IP literals are checked apart
MAX_NODES = 1024
MAX_DOC_BYTES = 256 * 1024


def node_run_name(base: str, rank: int) -> str:
    """`<base>` on node 0, `<base>.node<N>` on the others (the Slurm path names its nodes the same way)."""
    return base if rank == 0 else "%s.node%d" % (base, rank)


@dataclasses.dataclass(frozen=True)
class NodeRole:
    """One node of a multi-node run: its index, the node count, and whether it is the primary."""

    rank: int
    nnodes: int
    source: str  # "slurm" or "ssh"
    primary: bool

    def run_name(self, base: str) -> str:
        return node_run_name(base, self.rank)


@dataclasses.dataclass(frozen=True)
class Peer:
    rank: int
    addr: str  # where the other nodes reach this node's agent
    port: int  # its UDP notice port


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    group: str
    run: str  # node 0's run name: the durable prefix every node restores from
    rank: int
    nnodes: int
    master_addr: str
    master_port: int
    peers: Tuple[Peer, ...]
    key: bytes = dataclasses.field(repr=False)

    @property
    def role(self) -> NodeRole:
        return NodeRole(rank=self.rank, nnodes=self.nnodes, source="ssh", primary=self.rank == 0)

    @property
    def me(self) -> Peer:
        return self.peers[self.rank]

    def others(self) -> List[Peer]:
        return [p for p in self.peers if p.rank != self.rank]

    def public(self) -> Dict[str, Any]:
        """What may be shown and recorded: everything but the key."""
        return {"group": self.group, "run": self.run, "rank": self.rank, "nnodes": self.nnodes,
                "master_addr": self.master_addr, "master_port": self.master_port,
                "peers": [dataclasses.asdict(p) for p in self.peers]}

    def to_doc(self) -> Dict[str, Any]:
        return dict(self.public(), schema=SCHEMA, key=self.key.hex())


def child_vars(group: NodeGroup) -> Dict[str, str]:
    """The rendezvous for the trainer. NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT for scripts that read them, and
    torchrun's own PET_* variables (its flags' defaults: a flag in the command still wins), so a plain
    `torchrun --nproc-per-node=8 train.py` joins the group with no rendezvous flags at all. The rendezvous is
    torchrun's `static` one on MASTER_ADDR:MASTER_PORT (a c10d TCPStore on node 0): it keeps --node-rank, so
    global rank 0, the rank that saves, runs on node 0, the node that commits. The dynamic c10d backend orders
    nodes by host name and pid and ignores --node-rank: rank 0 could land on a node whose saves nobody commits."""
    return {
        "NNODES": str(group.nnodes), "NODE_RANK": str(group.rank),
        "MASTER_ADDR": group.master_addr, "MASTER_PORT": str(group.master_port),
        "PET_NNODES": str(group.nnodes), "PET_NODE_RANK": str(group.rank),
        "PET_MASTER_ADDR": group.master_addr, "PET_MASTER_PORT": str(group.master_port),
        "PET_RDZV_BACKEND": "static", "PET_RDZV_ID": group.group,
    }


def groups_dir() -> str:
    return os.path.join(paths.onbox_home(), "nodes")


def group_path(run: str) -> str:
    return os.path.join(groups_dir(), "%s.json" % run)


def check_addr(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError("%s must be an address, not %r" % (what, value))
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if not HOST_RE.fullmatch(value):
        raise UsageError("%s %r is neither an IP address nor a host name" % (what, value))
    return value


def _port(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise UsageError("%s must be a port 1-65535, not %r" % (what, value))
    return value


def parse_group(doc: Any, source: str) -> NodeGroup:
    """The document, checked field by field; UsageError naming the source and the field (never the key)."""
    def bad(msg: str) -> UsageError:
        return UsageError("node group %s: %s" % (source, msg),
                          hint="onboxctl run BOX1 BOX2 --nodes writes it; a hand-written one follows "
                               "the schema %s" % SCHEMA)

    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise bad("not a %s document" % SCHEMA)
    group, run, key = doc.get("group"), doc.get("run"), doc.get("key")
    if not isinstance(group, str) or not GROUP_ID_RE.fullmatch(group):
        raise bad("group must be 8-64 lowercase hex digits")
    if not isinstance(run, str) or not paths.valid_run_name(run):
        raise bad("run must be a run name, not %r" % (run,))
    if not isinstance(key, str) or not re.fullmatch(r"(?:[0-9a-f]{2}){32,64}", key):
        raise bad("key must be an even number (64-128) of lowercase hex digits (32 bytes or more)")
    nnodes, rank = doc.get("nnodes"), doc.get("rank")
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or not 2 <= nnodes <= MAX_NODES:
        raise bad("nnodes must be 2-%d, not %r" % (MAX_NODES, nnodes))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < nnodes:
        raise bad("rank must be 0-%d, not %r" % (nnodes - 1, rank))
    try:
        master_addr = check_addr(doc.get("master_addr"), "master_addr")
        master_port = _port(doc.get("master_port"), "master_port")
        raw = doc.get("peers")
        if not isinstance(raw, list) or len(raw) != nnodes:
            raise UsageError("peers must list all %d nodes" % nnodes)
        peers = []
        for i, p in enumerate(raw):
            if not isinstance(p, dict) or p.get("rank") != i:
                raise UsageError("peers[%d] must be {rank: %d, addr, port}" % (i, i))
            peers.append(Peer(rank=i, addr=check_addr(p.get("addr"), "peers[%d].addr" % i),
                              port=_port(p.get("port"), "peers[%d].port" % i)))
    except UsageError as e:
        raise bad(e.message)
    return NodeGroup(group=group, run=run, rank=rank, nnodes=nnodes, master_addr=master_addr,
                     master_port=master_port, peers=tuple(peers), key=bytes.fromhex(key))


def load_group(path: str) -> NodeGroup:
    """Read and check a node-group file. It holds the group's key: refused when others can read it."""
    try:
        st = os.stat(path)
        raw = untrusted.read_bytes(path, MAX_DOC_BYTES, "node group")  # a FIFO or /dev/zero is refused, not read
    except untrusted.UntrustedInput as e:
        raise UsageError("the node group %s %s" % (path, e.reason),
                         hint="relaunch the group with `onboxctl run BOX... --nodes`")
    except OSError as e:
        raise UsageError("cannot read the node group %s: %s" % (path, e.strerror or e),
                         hint="relaunch the group with `onboxctl run BOX... --nodes`")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UsageError("the node group %s is readable by others (mode %o): it holds the group's key"
                         % (path, stat.S_IMODE(st.st_mode)), hint="chmod 600 %s" % path)
    try:
        doc = untrusted.loads_json(raw, "node group")
    except ValueError as e:  # not UTF-8, not JSON, or nested too deep
        raise UsageError("the node group %s is not JSON: %s" % (path, getattr(e, "reason", e)))
    return parse_group(doc, path)


def read_group_stream(data: bytes, source: str = "stdin") -> NodeGroup:
    """The group streamed on `source`: `data` is read with a cap of MAX_DOC_BYTES + 1 bytes, so more is too
    large, never read whole."""
    if len(data) > MAX_DOC_BYTES:
        raise UsageError("node group on %s: larger than %d bytes" % (source, MAX_DOC_BYTES))
    try:
        doc = untrusted.loads_json(data, "node group")
    except ValueError as e:  # not UTF-8, not JSON, or nested too deep
        raise UsageError("node group on %s is not JSON: %s" % (source, getattr(e, "reason", e)),
                         hint="`--node-group -` reads the document onboxctl streams over ssh")
    return parse_group(doc, source)


def save_group(group: NodeGroup, run: str) -> str:
    """Write the group for run `run` (0600 in a 0700 dir); its path, which config.json records."""
    fsutil.make_private_dir(groups_dir())
    path = group_path(run)
    fsutil.atomic_write_json(path, group.to_doc())
    return path


def recorded_role(group_file: Optional[str]) -> Optional[Dict[str, Any]]:
    """rank/run/nnodes of a recorded node-group file without checking its key (for listings); None if unreadable."""
    if not group_file:
        return None
    try:
        doc = fsutil.read_json(group_file, MAX_DOC_BYTES, "node group")
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    return {k: doc.get(k) for k in ("group", "run", "rank", "nnodes")}
