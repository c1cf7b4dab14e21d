"""A test host with its own address in a network namespace, and a network cut.

    with NetnsHost() as box:                 # or the `netns_host` fixture
        box.run(["python3", "-c", "..."])    # argv runs inside the namespace (ip netns exec)
        box.cut(); ...; box.restore()        # drop / bring back the box's link
    box.host_ip  (10.200.X.1, this machine's side)   box.box_ip (10.200.X.2, inside)
    cut_keeper_side(boxes); ...; heal_keeper_side(boxes)   # this machine's side of every box's link (sshd boxes)

Safety: an `unreachable` route for the /24 with a high metric is added FIRST, before any link
exists, so that packets for the box can never follow the default route out of the machine, whatever link is
down; every route is checked with `ip route get`. Names carry the pid and a counter (parallel runs don't
collide); the /24 inside 10.200.0.0/16 is derived from them. Teardown deletes the namespace (and with it the
veth pair) and then the unreachable route. Needs root and iproute2; the fixture skips with the reason otherwise.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
from typing import Any, List, Optional, Sequence

import pytest

UNREACHABLE_METRIC = 4242
_counter = itertools.count()


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise NetnsError("ip %s failed: %s" % (" ".join(args), res.stderr.strip()))
    return res


def unavailable_reason() -> Optional[str]:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


class NetnsHost:
    def __init__(self, index: Optional[int] = None) -> None:
        n = next(_counter) if index is None else index
        pid = os.getpid()
        tag = "%d%s" % (pid % 10**7, "" if n == 0 else "x%d" % n)
        self.ns = "onbox%s" % tag
        self.veth_host = ("ob%sh" % tag)[:15]
        self.veth_box = ("ob%sn" % tag)[:15]
        self._third = (pid * 7 + n * 13) % 254 + 1  # 10.200.<1..254>.0/24 from the pid: parallel runs differ
        self._set_subnet(self._third)
        self._route = False
        self._ns = False
        self._veth = False

    def _set_subnet(self, third: int) -> None:
        self.subnet = "10.200.%d.0/24" % third
        self.host_ip = "10.200.%d.1" % third
        self.box_ip = "10.200.%d.2" % third

    def _claim_subnet(self) -> None:
        """Add the unreachable route; a /24 another run holds already ("File exists") moves us to the next one."""
        for k in range(254):
            self._set_subnet((self._third - 1 + k) % 254 + 1)
            res = _ip("route", "add", "unreachable", self.subnet, "metric", str(UNREACHABLE_METRIC), check=False)
            if res.returncode == 0:
                self._route = True
                return
            if "exists" not in res.stderr.lower():
                raise NetnsError("ip route add unreachable %s failed: %s" % (self.subnet, res.stderr.strip()))
        raise NetnsError("no free /24 in 10.200.0.0/16 for a test namespace")

    def setup(self) -> "NetnsHost":
        try:
            # FIRST: keep every packet for this /24 on the machine, whatever happens to the links below
            self._claim_subnet()
            _ip("netns", "add", self.ns)
            self._ns = True
            _ip("link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_box)
            self._veth = True
            _ip("link", "set", self.veth_box, "netns", self.ns)
            _ip("addr", "add", self.host_ip + "/24", "dev", self.veth_host)
            _ip("link", "set", self.veth_host, "up")
            _ip("-n", self.ns, "addr", "add", self.box_ip + "/24", "dev", self.veth_box)
            _ip("-n", self.ns, "link", "set", self.veth_box, "up")
            _ip("-n", self.ns, "link", "set", "lo", "up")
            self.check_route()
        except BaseException:
            self.teardown()
            raise
        return self

    def check_route(self) -> None:
        """The box's address must go via our veth (or be unreachable): never via the default route."""
        res = _ip("route", "get", self.box_ip, check=False)
        out = res.stdout + res.stderr
        if self.veth_host not in out and "unreachable" not in out.lower():
            raise NetnsError("route to %s would leave the machine: %s" % (self.box_ip, out.strip()))

    def argv(self, argv: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: List[str], **kwargs) -> subprocess.Popen:
        """Start argv inside the namespace (the caller owns the process and stops it by PID)."""
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: List[str], timeout: float = 30.0, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), timeout=timeout, **kwargs)

    def cut(self) -> None:
        """Partition: the box's side goes down, packets are silently dropped (no RST, no ICMP)."""
        _ip("-n", self.ns, "link", "set", self.veth_box, "down")
        self.check_route()

    def restore(self) -> None:
        _ip("-n", self.ns, "link", "set", self.veth_box, "up")
        self.check_route()

    def teardown(self) -> None:
        if self._ns:
            _ip("netns", "del", self.ns, check=False)  # removes the veth pair with it
            self._ns = self._veth = False
        if self._veth:
            _ip("link", "del", self.veth_host, check=False)
            self._veth = False
        if self._route:
            # the kernel removes the veth pair asynchronously: the unreachable route goes only after the link did
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and _ip("link", "show", self.veth_host, check=False).returncode == 0:
                time.sleep(0.02)
            _ip("route", "del", "unreachable", self.subnet, "metric", str(UNREACHABLE_METRIC), check=False)
            self._route = False

    def __enter__(self) -> "NetnsHost":
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()


@pytest.fixture
def netns_host():
    """A box in its own network namespace, linked to this machine by a veth pair; removed at teardown."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with NetnsHost() as host:
        yield host


def _route_stays_here(addr: str) -> None:
    """A packet for `addr` goes to one of this machine's links or is refused: never via a gateway (out of it)."""
    res = _ip("route", "get", addr, check=False)
    out = res.stdout + res.stderr
    if " via " in out and "unreachable" not in out.lower():
        raise NetnsError("route to %s would leave the machine: %s" % (addr, out.strip()))


def cut_keeper_side(boxes: Sequence[Any]) -> None:
    """The keeper's own network goes: the host side of every box's link (its veth's end on this machine) down, the
    boxes themselves untouched (they train on, and reach neither this machine's tracker nor anything else here).
    Each box's /24 must hold its `unreachable` route first (the box fixtures add it before any link exists): checked
    before the cut, and every box's route checked after it."""
    for b in boxes:
        ns = b.netns
        routes = _ip("route", "show", "type", "unreachable", ns.subnet, check=False).stdout
        if "metric %d" % UNREACHABLE_METRIC not in routes:
            raise NetnsError("no unreachable route for %s: refusing to cut (packets could leave the machine)"
                             % ns.subnet)
    for b in boxes:
        _ip("link", "set", b.netns.host_if, "down")
    for b in boxes:
        _route_stays_here(b.netns.box_addr)


def heal_keeper_side(boxes: Sequence[Any]) -> None:
    """The keeper's links back up (cut_keeper_side undone)."""
    for b in boxes:
        _ip("link", "set", b.netns.host_if, "up")
    for b in boxes:
        _route_stays_here(b.netns.box_addr)
