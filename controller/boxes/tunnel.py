"""Reverse tunnels: a box reaches a tracker on the laptop's 127.0.0.1 through the ssh master onboxctl keeps.

`onboxctl run` with a tracker on this machine (127.0.0.1, localhost, ::1) asks the box's ssh master connection
for a remote forward, `ssh -O forward -R 127.0.0.1:PORT:<tracker host>:<tracker port>`: the box side listens on
its own loopback only (never a public address; sshd's default `GatewayPorts no` enforces that too), and the agent
is given `http://127.0.0.1:PORT` as its tracker. Nothing but ssh carries the bearer token, so a tracker that never
leaves 127.0.0.1 needs no TLS.

Lifetime. The run outlives `onboxctl run`, so the master that carries the tunnel is started to persist
(`ControlPersist=yes`): it stays in the background after onboxctl exits, until its link dies (U17: ServerAlive
ends it within interval x count seconds of a cut or a sleeping laptop, never a half-open hang), `onboxctl tunnel
--close BOX`, or `onboxctl down BOX`. A link that dies is not the end of the tunnel: `onboxctl run` also starts the
tunnel's supervisor (controller/boxes/tunnelwatch.py, one background process per tunnel), which notices the master is
gone and re-opens the tunnel on the SAME box port (the agent's URL does not change) as soon as the box answers,
with a bounded backoff; it ends when the tunnel is closed, when no run on the box has a live agent any more, or
after a day down (WatchKnobs). While the tunnel is down the agent spools every beat to disk and delivers the
backlog in order once the tracker answers again; nothing is lost. `onboxctl tunnel [BOX...]` re-opens it at once
(and starts a supervisor where none runs), `--keep` follows it and prints each change, and `onboxctl status` says
when a recorded tunnel is down. What was opened is recorded in $ONBOX_CONFIG_DIR/tunnels.json (box, tracker
address, box port, the master's pid; the supervisor's pid and start time; up or down, since when, how many
re-opens, the last error); what the supervisor did is logged in $ONBOX_CONFIG_DIR/tunnels/BOX-PORT.log.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit, urlunsplit

from controller.boxes.inventory import Box, config_dir
from controller.boxes.ssh import Ssh
from onbox import untrusted
from onbox.clock import Clock, SystemClock
from onbox.environment import Environment
from onbox.errors import OnboxError, UnfitError, UsageError
from onbox.fsutil import atomic_write_json
from onbox.proc import ProcessSeam, ProcRef, is_alive

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
    supervisor_pid: Optional[int] = None  # the tunnel's supervisor (controller/boxes/tunnelwatch.py), with its start
    supervisor_start: Optional[int] = None  # time (clock ticks since boot): a recycled pid is never taken for it
    state: Optional[str] = None  # "up" or "down", as last seen by whoever opened or watched it
    since: Optional[float] = None  # when it went up or down (epoch seconds)
    reopens: int = 0  # times it was re-opened on a new master (after a drop)
    last_error: Optional[str] = None  # why it is down, or why the last re-open failed

    def spec(self, port: Optional[int] = None) -> str:
        host, _, lport = self.local.rpartition(":")
        return "127.0.0.1:%d:%s:%s" % (self.spec_port if port is None else port, _hostspec(host.strip("[]")), lport)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def key(self) -> Tuple[str, str]:
        return self.box, self.local

    def supervised(self) -> bool:
        """Whether its recorded supervisor is alive (the same process: pid AND start time)."""
        return bool(self.supervisor_pid and self.supervisor_start is not None
                    and is_alive(self.supervisor_pid, self.supervisor_start))


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
    for key in ("master_pid", "supervisor_pid"):
        pid = entry.get(key)
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0):
            raise ValueError("entry %d (box %s): %s %r is not a process id" % (n, box, key, pid))
    for key, kind in (("supervisor_start", int), ("reopens", int), ("since", (int, float)), ("state", str),
                      ("last_error", str)):
        v = entry.get(key)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool) or
                              (isinstance(v, (int, float)) and not (math.isfinite(v) and v >= 0))):
            raise ValueError("entry %d (box %s): %s %r is not %s" % (
                n, box, key, v, "a string" if kind is str else "a number of 0 or more"))
    if entry.get("state") not in (None, "up", "down"):
        raise ValueError("entry %d (box %s): state %r is not up or down" % (n, box, entry["state"]))
    return Tunnel(**dict(entry, reopens=entry.get("reopens") or 0))


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

    def get(self, key: Tuple[str, str]) -> Optional[Tunnel]:
        return next((t for t in self.load() if t.key == key), None)

    def log_path(self, t: Tunnel) -> str:
        """Where the tunnel's supervisor logs what it did: $ONBOX_CONFIG_DIR/tunnels/BOX-PORT.log."""
        return os.path.join(os.path.dirname(self.path), "tunnels", "%s-%s.log" % (t.box, t.local.rpartition(":")[2]))


class TunnelClosed(OnboxError):
    """The tunnel's record is gone: it was closed (`onboxctl tunnel --close`, `onboxctl down`)."""


@dataclasses.dataclass(frozen=True)
class WatchKnobs:
    """The tunnel supervisor's settings, from ONBOX_TUNNEL_* (seconds; tests shrink them)."""

    enabled: bool = True  # ONBOX_TUNNEL_WATCH=0: `onboxctl run` and `tunnel` start no supervisor
    poll: float = 2.0  # ONBOX_TUNNEL_POLL: between two local checks of the master (no network)
    backoff_max: float = 15.0  # ONBOX_TUNNEL_BACKOFF_MAX: the longest wait between two re-open tries (1 s, doubling)
    run_check: float = 60.0  # ONBOX_TUNNEL_RUN_CHECK: between two asks whether a run on the box still has an agent
    give_up: float = 86400.0  # ONBOX_TUNNEL_GIVE_UP: a tunnel down this long is left alone (the box is gone)

    RANGES = {"poll": (0.05, 3600.0), "backoff_max": (0.1, 86400.0), "run_check": (1.0, 86400.0),
              "give_up": (1.0, 30 * 86400.0)}

    @classmethod
    def from_env(cls, environ: Optional[Dict[str, str]] = None) -> "WatchKnobs":
        raw = Environment.read(environ).tunnel
        fields: Dict[str, Any] = {}
        for key, (lo, hi) in cls.RANGES.items():
            if key not in raw:
                continue
            try:
                value = float(raw[key])
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and lo <= value <= hi):
                raise UsageError("ONBOX_TUNNEL_%s=%s: not a number of seconds from %g to %g" % (key.upper(), raw[key],
                                                                                                lo, hi))
            fields[key] = value
        watch = raw.get("watch", "1").strip().lower()
        if watch not in ("0", "1", "no", "yes", "false", "true", "off", "on"):
            raise UsageError("ONBOX_TUNNEL_WATCH=%s: give 1 (a supervisor keeps each tunnel up) or 0 (none)"
                             % raw["watch"])
        fields["enabled"] = watch in ("1", "yes", "true", "on")
        return cls(**fields)


def _forward(ssh: Ssh, box: Box, spec: str) -> Tuple[bool, str, Optional[int]]:
    """(ok, ssh's complaint, the port sshd allocated when the spec asked for 0)."""
    res = ssh.control(box.target(), "forward", "-R", spec)
    out = res.text.strip()
    return res.returncode == 0, res.err_text, int(out) if re.fullmatch(r"\d+", out) else None


def open_tunnel(ssh: Ssh, box: Box, tracker_url: str, records: Optional[Records] = None,
                reopen_only: bool = False, clock: Optional[Clock] = None) -> Tunnel:
    """Open (or find open) the reverse tunnel from `box`'s 127.0.0.1 to the tracker; returns it, recorded.

    A recorded tunnel is re-opened on its recorded box port; a new one gets a port sshd allocates. `reopen_only`
    (the supervisor): a tunnel whose record is gone was closed, and is not opened again (TunnelClosed)."""
    if not ssh.settings.multiplex:
        raise UsageError("the tracker tunnel rides the ssh master connection, and ONBOX_SSH_MULTIPLEX=0 turns it off",
                         hint="unset ONBOX_SSH_MULTIPLEX, or pass --no-tunnel and a tracker URL the box reaches")
    records = records or Records()
    host, port = local_address(tracker_url)
    local = "%s:%d" % (_hostspec(host), port)
    if reopen_only and records.get((box.name, local)) is None:
        raise TunnelClosed("the tunnel of %s to %s was closed" % (box.name, local))
    ssh.ensure_master(box.target(), persist=True)
    pid = ssh.master_pid(box.target())
    with records.editing() as tunnels:
        old = next((t for t in tunnels if t.box == box.name and t.local == local), None)
        if old is None and reopen_only:  # closed while the master came up: that master carries nothing now
            ssh.control(box.target(), "stop")
            raise TunnelClosed("the tunnel of %s to %s was closed" % (box.name, local))
        if old is not None and old.master_pid == pid and pid is not None:
            t = dataclasses.replace(old)  # this very master holds it: asking again with the same spec confirms it
        elif old is not None:
            t = dataclasses.replace(old, spec_port=old.remote_port, master_pid=pid)  # a new master: same box port
        else:
            t = Tunnel(box=box.name, local=local, remote_port=0, spec_port=0, master_pid=pid)
        ok, err, allocated = _forward(ssh, box, t.spec())
        for _ in range(3 if not ok and t.spec_port else 0):
            # the box's sshd may still hold the port for the session of a master that died with its link (it
            # learns of that only when it next writes to it): poke it through the new master, and ask again
            ssh.poke(box.target(), t.spec_port)
            ok, err, allocated = _forward(ssh, box, t.spec())
            if ok:
                break
            (clock or SystemClock()).sleep(0.3)
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
        if old is not None and old.master_pid != pid:
            t.reopens += 1
        if old is None or old.master_pid != pid or old.state != "up":
            t.state, t.since, t.last_error = "up", time.time(), None
        tunnels[:] = [x for x in tunnels if not (x.box == box.name and x.local == local)] + [t]
    return t


def is_open(ssh: Ssh, t: Tunnel, box: Box) -> bool:
    """Whether the master that opened `t` is still the live one (a local check, no network)."""
    pid = ssh.master_pid(box.target())
    return pid is not None and pid == t.master_pid


def close_tunnels(ssh: Ssh, box: Box, records: Optional[Records] = None) -> List[Tunnel]:
    """Cancel `box`'s recorded forwards, forget them, stop their supervisors, and let its master go once its
    sessions end."""
    records = records or Records()
    with records.editing() as tunnels:
        mine = [t for t in tunnels if t.box == box.name]
        tunnels[:] = [t for t in tunnels if t.box != box.name]
    for t in mine:
        stop_supervisor(t)  # it would see the record gone on its next look anyway; this is sooner
    pid = ssh.master_pid(box.target())
    for t in mine:
        if pid is not None and pid == t.master_pid:
            ssh.control(box.target(), "cancel", "-R", t.spec())
    if mine and pid is not None:
        ssh.control(box.target(), "stop")  # a persistent master would stay forever otherwise
    return mine


def stop_supervisor(t: Tunnel) -> bool:
    """SIGTERM the tunnel's supervisor: that very process (pid and start time), never one that got its pid since."""
    if not t.supervisor_pid or t.supervisor_start is None:
        return False
    return ProcessSeam().signal_process(ProcRef(t.supervisor_pid, t.supervisor_start), signal.SIGTERM)


def start_supervisor(t: Tunnel, records: Optional[Records] = None,
                     knobs: Optional[WatchKnobs] = None) -> Tuple[Optional[int], Optional[str]]:
    """Start the tunnel's supervisor unless one is alive: (its pid, None), or (None, why there is none). It runs
    in the background (its own session, detached from this process) and registers itself in the record before
    this returns; its output goes to the tunnel's log."""
    records = records or Records()
    knobs = knobs or WatchKnobs.from_env()
    if not knobs.enabled:
        return None, "ONBOX_TUNNEL_WATCH=0"
    now = records.get(t.key)
    if now is None:
        return None, "the tunnel is not recorded"
    if now.supervised():
        return now.supervisor_pid, None
    log = records.log_path(t)
    os.makedirs(os.path.dirname(log), mode=0o700, exist_ok=True)
    _rotate(log)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where `controller` is
    env = dict(os.environ, PYTHONPATH=here + (os.pathsep + os.environ["PYTHONPATH"]
                                               if os.environ.get("PYTHONPATH") else ""))
    env["ONBOX_CONFIG_DIR"] = os.path.dirname(records.path)
    env.pop("ONBOX_TRACKER_TOKEN", None)  # it lives for days and needs no token: none sits in its environment
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        p = subprocess.Popen([sys.executable, "-m", "controller.boxes.tunnelwatch", t.box, t.local],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=fd, env=env,
                             start_new_session=True, close_fds=True, cwd="/")
    except OSError as e:
        return None, "cannot start it: %s" % (e.strerror or e)
    finally:
        os.close(fd)
    try:  # the first process forks the supervisor and exits; the supervisor says "watching PID" and lets go
        out, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        from onbox.toolrun import kill_group

        kill_group(p)
        p.communicate()
        return None, "it did not start within 30 s (see %s)" % log
    m = re.search(r"^(watching|already) (\d+)$", (out or b"").decode("utf-8", "replace"), re.M)
    if not m:
        return None, "it did not start (see %s)" % log
    return int(m.group(2)), None


def _rotate(path: str, limit: int = 1 << 20) -> None:
    """One older copy (`.1`) once the log passes `limit` bytes: the supervisor writes only what changes."""
    try:
        if os.path.getsize(path) > limit:
            os.replace(path, path + ".1")
    except OSError:
        pass
