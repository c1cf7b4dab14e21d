"""The network-namespace test host itself: reachability, a real cut, restore, subnet collision, clean teardown."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.hosts.netns import NetnsHost, unavailable_reason

pytestmark = [pytest.mark.integration, pytest.mark.root,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

CONNECT = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=%s).close()"


def can_connect(host: NetnsHost, port: int, timeout: float = 2.0) -> bool:
    res = host.run([sys.executable, "-c", CONNECT % timeout, host.host_ip, str(port)], timeout=timeout + 20,
                   capture_output=True)
    return res.returncode == 0


def test_cut_and_restore(netns_host):
    srv = socket.socket()
    srv.bind((netns_host.host_ip, 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        assert can_connect(netns_host, port)
        netns_host.cut()
        assert not can_connect(netns_host, port, timeout=1.0)
        netns_host.restore()
        assert can_connect(netns_host, port, timeout=5.0)
    finally:
        srv.close()


def test_taken_subnet_moves_to_the_next_and_teardown_is_clean():
    a = NetnsHost(index=101)
    b = NetnsHost(index=102)
    b._third = a._third  # force the collision
    with a, b:
        assert a.subnet != b.subnet
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert a.ns in names and b.ns in names
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=10).stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert a.subnet not in routes and b.subnet not in routes
    assert a.ns not in names and b.ns not in names
