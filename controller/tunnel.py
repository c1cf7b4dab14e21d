"""Reverse tunnels: a box reaches a tracker on the laptop's 127.0.0.1 through the ssh master onboxctl keeps.

`onboxctl run` with a tracker on this machine (127.0.0.1, localhost, ::1) asks the box's ssh master connection
for a remote forward, `ssh -O forward -R 127.0.0.1:PORT:<tracker host>:<tracker port>`: the box side listens on
its own loopback only (never a public address; sshd's default `GatewayPorts no` enforces that too), and the agent
is given `http://127.0.0.1:PORT` as its tracker. Nothing but ssh carries the bearer token, so a tracker that never
leaves 127.0.0.1 needs no TLS.

Lifetime. The run outlives `onboxctl run`, so the master that carries the tunnel is started to persist
(`ControlPersist=yes`): it stays in the background after onboxctl exits, until its link dies (U17: ServerAlive
ends it within interval x count seconds of a cut or a sleeping laptop, never a half-open hang), `onboxctl tunnel --close BOX`, or `onboxctl down BOX`.
While the tunnel is down the agent spools every beat to disk and delivers the backlog in order once the tracker
answers again; nothing is lost. `onboxctl tunnel [BOX...]` re-opens it on the SAME box port (the agent's URL does
not change), `onboxctl tunnel --keep` keeps re-opening every few seconds, and `onboxctl status` says when a
recorded tunnel is down. What was opened is recorded in $ONBOX_CONFIG_DIR/tunnels.json (box, tracker address,
box port, the master's pid).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit, urlunsplit

from controller.boxes import Box, config_dir
from controller.ssh import Ssh
from onbox import untrusted
from onbox.errors import UnfitError, UsageError
from onbox.fsutil import atomic_write_json

_LOCK = threading.Lock()  # launches to several boxes run in threads
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "ip6-localhost")


def is_local(url: str) -> bool:
    """True when the tracker URL names this machine's loopback: the box cannot reach it without a tunnel."""
    host = (urlsplit(url).hostname or "").lower()
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def local_address(url: str) -> Tuple[str, int]:
    """(host, port) the laptop's ssh connects to for the box: the tracker URL's own host and port."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "127.0.0.1", port


def box_url(url: str, remote_port: int) -> str:
    """The tracker URL as the agent on the box sees it through the tunnel: its own 127.0.0.1:PORT."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, "127.0.0.1:%d" % remote_port, parts.path, parts.query, parts.fragment)).rstrip("/")


def _hostspec(host: str) -> str:
    return "[%s]" % host if ":" in host else host


@dataclasses.dataclass
class Tunnel:
    box: str
    local: str  # host:port of the tracker, as this machine reaches it
    remote_port: int  # the box's 127.0.0.1 port
    spec_port: int  # the port named in the forward request the live master holds (0: allocated by sshd)
    master_pid: Optional[int] = None

    def spec(self, port: Optional[int] = None) -> str:
        host, _, lport = self.local.rpartition(":")
        return "127.0.0.1:%d:%s:%s" % (self.spec_port if port is None else port, _hostspec(host.strip("[]")), lport)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _tunnel(n: int, entry: Any) -> Tunnel:
    """Entry number `n` of tunnels.json as a Tunnel, or ValueError naming what is wrong with it."""
    fields = {f.name for f in dataclasses.fields(Tunnel)}
    if not isinstance(entry, dict) or not {"box", "local", "remote_port", "spec_port"} <= set(entry) <= fields:
        raise ValueError("entry %d is not {box, local, remote_port, spec_port, master_pid}" % n)
    box, local = entry["box"], entry["local"]
    if not isinstance(box, str) or not box:
        raise ValueError("entry %d: box %r is not a box name" % (n, box))
    host, _, port = local.rpartition(":") if isinstance(local, str) else ("", "", "")
    bad_host = not host or any(c.isspace() or c in "/@?#" for c in host)
    if bad_host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise ValueError("entry %d (box %s): the tracker address %r is not host:port" % (n, box, local))
    for key, low in (("remote_port", 1), ("spec_port", 0)):
        v = entry[key]
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v < 65536:
            raise ValueError("entry %d (box %s): %s %r is not a port number" % (n, box, key, v))
    pid = entry.get("master_pid")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0):
        raise ValueError("entry %d (box %s): master_pid %r is not a process id" % (n, box, pid))
    return Tunnel(**entry)


class Records:
    """$ONBOX_CONFIG_DIR/tunnels.json: one entry per (box, tracker address), written atomically under a lock."""

    def __init__(self, directory: Optional[str] = None) -> None:
        self.path = os.path.join(directory or config_dir(), "tunnels.json")

    def load(self) -> List[Tunnel]:
        """Every recorded tunnel; a record that is not a regular file, is too large, nests too deep or holds an
        entry that is not a tunnel (a box port that is no number, an address that is not host:port) is refused
        as damaged, whole: onboxctl wrote it, so a bad entry is a hand edit or a damaged disk."""
        try:
            doc = untrusted.read_json(self.path, untrusted.CONFIG_MAX_BYTES, "tunnel record")
            entries = doc.get("tunnels", []) if isinstance(doc, dict) else None
            if not isinstance(entries, list):
                raise ValueError("not {\"tunnels\": [...]}")
            return [_tunnel(n, t) for n, t in enumerate(entries, 1)]
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise UsageError("tunnel record %s is damaged: %s" % (self.path, untrusted.reason(e)),
                             hint="delete it; `onboxctl run` records tunnels again when it opens them")

    @contextlib.contextmanager
    def editing(self) -> Iterator[List[Tunnel]]:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with _LOCK, open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # several onboxctl processes may open tunnels at once
            tunnels = self.load()
            yield tunnels
            atomic_write_json(self.path, {"tunnels": [t.to_dict() for t in tunnels]}, mode=0o600)

    def find(self, box: str, local: Optional[str] = None) -> List[Tunnel]:
        return [t for t in self.load() if t.box == box and (local is None or t.local == local)]


def _forward(ssh: Ssh, box: Box, spec: str) -> Tuple[bool, str, Optional[int]]:
    """(ok, ssh's complaint, the port sshd allocated when the spec asked for 0)."""
    res = ssh.control(box.target(), "forward", "-R", spec)
    out = res.text.strip()
    return res.returncode == 0, res.err_text, int(out) if re.fullmatch(r"\d+", out) else None


def open_tunnel(ssh: Ssh, box: Box, tracker_url: str, records: Optional[Records] = None) -> Tunnel:
    """Open (or find open) the reverse tunnel from `box`'s 127.0.0.1 to the tracker; returns it, recorded.

    A recorded tunnel is re-opened on its recorded box port; a new one gets a port sshd allocates."""
    if not ssh.settings.multiplex:
        raise UsageError("the tracker tunnel rides the ssh master connection, and ONBOX_SSH_MULTIPLEX=0 turns it off",
                         hint="unset ONBOX_SSH_MULTIPLEX, or pass --no-tunnel and a tracker URL the box reaches")
    records = records or Records()
    host, port = local_address(tracker_url)
    local = "%s:%d" % (_hostspec(host), port)
    ssh.ensure_master(box.target(), persist=True)
    pid = ssh.master_pid(box.target())
    with records.editing() as tunnels:
        old = next((t for t in tunnels if t.box == box.name and t.local == local), None)
        if old is not None and old.master_pid == pid and pid is not None:
            t = old  # this very master holds it: asking again with the same spec is a no-op that confirms it
        elif old is not None:
            t = dataclasses.replace(old, spec_port=old.remote_port, master_pid=pid)  # a new master: same box port
        else:
            t = Tunnel(box=box.name, local=local, remote_port=0, spec_port=0, master_pid=pid)
        ok, err, allocated = _forward(ssh, box, t.spec())
        if not ok:
            detail = (err.splitlines() or ["ssh exited with an error"])[-1]
            if old is not None:
                raise UnfitError("cannot re-open the tracker tunnel on %s at its port 127.0.0.1:%d: %s"
                                 % (box.name, t.remote_port, detail),
                                 hint="something else took that port on the box; runs started there report to it. "
                                      "Close it (`onboxctl tunnel --close %s`) and relaunch, or use a tracker the "
                                      "box reaches (--no-tunnel)" % box.name)
            raise UnfitError("the box %s refused the tracker tunnel: %s" % (box.name, detail),
                             hint="its sshd may forbid forwarding (AllowTcpForwarding no): serve the tracker with "
                                  "--tls-cert/--tls-key where the box reaches it, and pass --no-tunnel")
        if t.spec_port == 0:
            if allocated is None:
                raise UnfitError("ssh did not report the port it opened on %s for the tunnel" % box.name)
            if t.remote_port and allocated != t.remote_port:
                raise UnfitError("the tunnel on %s came back on port %d, not %d" % (box.name, allocated, t.remote_port))
            t.remote_port = allocated
        tunnels[:] = [x for x in tunnels if not (x.box == box.name and x.local == local)] + [t]
    return t


def is_open(ssh: Ssh, t: Tunnel, box: Box) -> bool:
    """Whether the master that opened `t` is still the live one (a local check, no network)."""
    pid = ssh.master_pid(box.target())
    return pid is not None and pid == t.master_pid


def close_tunnels(ssh: Ssh, box: Box, records: Optional[Records] = None) -> List[Tunnel]:
    """Cancel `box`'s recorded forwards, forget them, and let its master go once its sessions end."""
    records = records or Records()
    with records.editing() as tunnels:
        mine = [t for t in tunnels if t.box == box.name]
        tunnels[:] = [t for t in tunnels if t.box != box.name]
    pid = ssh.master_pid(box.target())
    for t in mine:
        if pid is not None and pid == t.master_pid:
            ssh.control(box.target(), "cancel", "-R", t.spec())
    if mine and pid is not None:
        ssh.control(box.target(), "stop")  # a persistent master would stay forever otherwise
    return mine
