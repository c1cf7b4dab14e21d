"""Notices between the agents of an SSH node group: small authenticated UDP datagrams.

A preemption (or `onbox stop`) reaches one node's agent; the others must stop too, or their trainers hang in a
collective with a dead peer until NCCL's timeout. So the agent that got the notice tells every peer, and each peer
starts the same checkpoint-then-exit it would for its own notice. A hang one node's agent judges is restarted by
the whole group the same way (`restart`: hooks.GroupNotices), or a node whose rank is stopped would never be. Non-primary agents also ask node 0 which
checkpoint it resumes from, so every node of an attempt starts from the same step (hooks.py).

Wire format: b"OBN1" + HMAC-SHA256(key, b"OBN1" + payload) + payload, the payload a JSON object
{g: group id, from: rank, id: random, kind, ...}. The key (32 random bytes, one per launch of the group) came to
every agent over ssh's stdin: a datagram without the right tag, from another group or launch, or from a rank
outside the group is dropped and counted. A replayed datagram is no lever: a replayed `preempt` repeats a stop
already under way (ids are de-duplicated), and an `answer` counts only for the request id it names.

Bounded everywhere: `preempt`/`stop`/`restart` are resent every RESEND_S until each peer acknowledges or SEND_TRIES are spent
(a background thread; the supervisor loop never waits on the network); an `ask` waits at most its timeout. UDP
needs no connection that could hang, and a lost datagram is just resent.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional

from onbox import untrusted
from onbox.multinode.role import NodeGroup, Peer

MAGIC = b"OBN1"
TAG = 32
MAX_DATAGRAM = 8192
RESEND_S = 0.2
SEND_TRIES = 25  # 5 s of resends: longer than any link blip worth waiting for, shorter than a preemption grace
RELIABLE = ("preempt", "stop", "restart")
# A relaunch from the same node-group file (`onbox run --name X` from a box's start-up script) keeps the group's key:
# a notice sealed in the agent's previous life, replayed, would still authenticate. Notices sent (by the sender's
# clock) more than this long before this channel started are dropped; the allowance is for clock skew between boxes.
SKEW_ALLOWANCE_S = 120.0


def seal(key: bytes, payload: Dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode("utf-8")
    return MAGIC + hmac.new(key, MAGIC + body, hashlib.sha256).digest() + body


def unseal(key: bytes, data: bytes) -> Optional[Dict[str, Any]]:
    """The payload of an authentic datagram, else None."""
    if len(data) <= len(MAGIC) + TAG or not data.startswith(MAGIC):
        return None
    tag, body = data[len(MAGIC):len(MAGIC) + TAG], data[len(MAGIC) + TAG:]
    if not hmac.compare_digest(tag, hmac.new(key, MAGIC + body, hashlib.sha256).digest()):
        return None
    try:  # authentic, yet a peer's: 8 KiB of brackets must not end the listener in a RecursionError
        doc = untrusted.loads_json(body, "peer notice")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


OnNotice = Callable[[str, int, Dict[str, Any]], None]  # (kind, from rank, the message)


class PeerChannel:
    """This agent's end: a UDP socket on its peer port, a listener thread, reliable sends to the peers."""

    def __init__(self, group: NodeGroup, on_notice: Optional[OnNotice] = None,
                 answer: Optional[Callable[[], Dict[str, Any]]] = None,
                 log: Optional[Callable[[str], None]] = None, bind: str = "",
                 resolve: Callable[..., Any] = socket.getaddrinfo) -> None:
        self.group = group
        self.resolve = resolve  # the name-service seam: a peer given by host name is looked up through it
        self.on_notice = on_notice or (lambda kind, rank, msg: None)
        self.answer = answer or (lambda: {})
        self.log = log or (lambda m: None)
        self.bind = bind
        self.sock: Optional[socket.socket] = None
        self.dropped = 0  # datagrams that failed authentication or checks
        self._seen: "collections.OrderedDict[str, None]" = collections.OrderedDict()
        self._acks: Dict[str, set] = {}
        self._replies: Dict[str, Dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._addrs: Dict[int, Optional[tuple]] = {}
        self._senders: list = []
        self.started_wall = time.time()
        self._stale_logged: set = set()
        # the group attempt (node 0's resume point seq) this non-primary node's attempt joined, as GroupRestore
        # fetched it; None when unknown (no answer: it restored on its own)
        self.joined: Optional[int] = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> "PeerChannel":
        """Bind the notice port (OSError when it is taken) and start listening."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.bind((self.bind, self.group.me.port))
            sock.settimeout(0.2)
        except OSError:
            sock.close()  # the agent runs on without it: never leak the descriptor
            raise
        self.sock = sock
        self.started_wall = time.time()
        self._thread = threading.Thread(target=self._listen, name="onbox-peers", daemon=True)
        self._thread.start()
        return self

    def close(self, linger: float = SEND_TRIES * RESEND_S) -> None:
        """Stop listening, after the notices still being resent are acknowledged (at most `linger` seconds):
        an agent that exits right after its own preemption must still reach its peers."""
        deadline = time.monotonic() + linger
        for t in self._senders:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- sending -----------------------------------------------------------------------------------------------
    def _addr(self, peer: Peer) -> Optional[tuple]:
        """The peer's socket address, looked up once it resolves: a failed lookup (a name server that was briefly
        away) is not remembered, so the next resend asks again instead of never reaching that node."""
        if self._addrs.get(peer.rank) is None:
            try:
                info = self.resolve(peer.addr, peer.port, socket.AF_INET, socket.SOCK_DGRAM)
            except OSError as e:
                self.log("cannot resolve node %d's address %s: %s" % (peer.rank, peer.addr, e))
                return None
            self._addrs[peer.rank] = info[0][4] if info else None
        return self._addrs[peer.rank]

    def _send(self, peer: Peer, msg: Dict[str, Any]) -> None:
        addr = self._addr(peer)
        if addr is None or self.sock is None:
            return
        try:
            self.sock.sendto(seal(self.group.key, msg), addr)
        except OSError as e:  # no route (a cut link): the resend loop tries again
            self.log("notice to node %d (%s) not sent: %s" % (peer.rank, peer.addr, e))

    def _message(self, kind: str, **fields: Any) -> Dict[str, Any]:
        return dict(fields, g=self.group.group, id=os.urandom(8).hex(), kind=kind, t=time.time(),
                    **{"from": self.group.rank})

    def broadcast(self, kind: str, **fields: Any) -> threading.Thread:
        """Send a notice to every peer, resent until each acknowledges (bounded); returns the sending thread."""
        msg = self._message(kind, **fields)
        with self._cond:
            self._acks[msg["id"]] = set()
        t = threading.Thread(target=self._resend, args=(msg,), name="onbox-peers-send", daemon=True)
        t.start()
        self._senders = [s for s in self._senders if s.is_alive()] + [t]
        return t

    def _resend(self, msg: Dict[str, Any]) -> None:
        pending = self.group.others()
        for _ in range(SEND_TRIES):
            with self._cond:
                acked = self._acks.get(msg["id"], set())
            pending = [p for p in pending if p.rank not in acked]
            if not pending or self._stop.is_set():
                break
            for p in pending:
                self._send(p, msg)
            with self._cond:
                self._cond.wait(RESEND_S)
        if pending:
            self.log("no acknowledgement of %s from node(s) %s" % (msg["kind"], ", ".join(str(p.rank) for p in pending)))
        with self._cond:
            self._acks.pop(msg["id"], None)

    def ask(self, rank: int, timeout: float, every: float = 0.3) -> Optional[Dict[str, Any]]:
        """Ask node `rank` for its answer (node 0's resume point); None when it does not answer in time."""
        peer = self.group.peers[rank]
        msg = self._message("ask")
        deadline = time.monotonic() + timeout
        with self._cond:
            self._replies[msg["id"]] = {}
        try:
            while True:
                self._send(peer, msg)
                with self._cond:
                    reply = self._replies.get(msg["id"])
                    if reply:
                        return reply
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop.is_set():
                        return None
                    self._cond.wait(min(every, left))
                    reply = self._replies.get(msg["id"])
                    if reply:
                        return reply
        finally:
            with self._cond:
                self._replies.pop(msg["id"], None)

    # -- receiving ---------------------------------------------------------------------------------------------
    def _listen(self) -> None:
        while not self._stop.is_set():
            sock = self.sock
            if sock is None:
                return
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM)
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            try:
                self._handle(data, addr)
            except Exception as e:  # one odd datagram must not end the listener
                self.log("peer notice from %s not handled: %r" % (addr, e))

    def _handle(self, data: bytes, addr: tuple) -> None:
        msg = unseal(self.group.key, data)
        sender = msg.get("from") if msg else None
        if (msg is None or msg.get("g") != self.group.group or not isinstance(sender, int)
                or isinstance(sender, bool) or not 0 <= sender < self.group.nnodes or sender == self.group.rank
                or not isinstance(msg.get("id"), str)):
            self.dropped += 1
            return
        kind = msg.get("kind")
        peer = self.group.peers[sender]
        if kind == "ack":
            with self._cond:
                if msg.get("re") in self._acks:
                    self._acks[msg["re"]].add(sender)
                    self._cond.notify_all()
            return
        if kind == "answer":
            with self._cond:
                if msg.get("re") in self._replies:
                    self._replies[msg["re"]] = msg
                    self._cond.notify_all()
            return
        if kind == "ask":
            self._reply(peer, addr, self._message("answer", re=msg["id"], **self.answer()))
            return
        if kind in RELIABLE:
            sent = msg.get("t")
            if not isinstance(sent, (int, float)) or sent < self.started_wall - SKEW_ALLOWANCE_S:
                self.dropped += 1
                if sender not in self._stale_logged:  # once a peer: a replay, or a clock far behind
                    self._stale_logged.add(sender)
                    self.log("dropped a %s notice from node %d sent before this agent started (%s): a replayed "
                             "datagram, or node %d's clock is more than %.0f s behind (check its NTP)" % (
                                 kind, sender, "no time" if not isinstance(sent, (int, float)) else
                                 "%.0f s before" % (self.started_wall - sent), sender, SKEW_ALLOWANCE_S))
                return
            self._reply(peer, addr, self._message("ack", re=msg["id"]))
            if msg["id"] in self._seen:
                return
            self._seen[msg["id"]] = None
            while len(self._seen) > 1024:
                self._seen.popitem(last=False)
            self.on_notice(kind, sender, msg)
            return
        self.dropped += 1

    def _reply(self, peer: Peer, addr: tuple, msg: Dict[str, Any]) -> None:
        """Answer where the datagram came from (the peer's address as this box sees it, NAT included)."""
        if self.sock is None:
            return
        try:
            self.sock.sendto(seal(self.group.key, msg), addr)
        except OSError as e:
            self.log("reply to node %d not sent: %s" % (peer.rank, e))
