"""Which Host names the tracker answers (controller/tracker/hosts.py): a foreign name, the DNS-rebinding page's, is
refused for every request and whoever sends it; an address, a loopback name, the --host name, this machine's name
when it listens everywhere and each --allowed-host pass. Through the real app in-process (the real server is
tests/integration/test_bad_inputs_tracker.py)."""
from __future__ import annotations

import warnings

import pytest

from controller.tracker.app import create_app
from controller.tracker.hosts import AllowedHosts, check_allowed_host
from controller.tracker.store import open_store
from onbox.errors import UsageError

with warnings.catch_warnings():  # starlette 1.x would rather have httpx2; httpx is what this venv has
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TOKEN = "t0ken"
AUTH = {"Authorization": "Bearer " + TOKEN}


@pytest.mark.parametrize("bind,host", [
    ("127.0.0.1", "127.0.0.1:8787"), ("127.0.0.1", "127.0.0.1:40000"), ("127.0.0.1", "localhost"),
    ("127.0.0.1", "LOCALHOST.:9"), ("127.0.0.1", "[::1]:8787"), ("127.0.0.1", "[::1]"), ("127.0.0.1", "10.0.0.5"),
    ("::1", "ip6-localhost:1"), ("10.200.7.1", "10.200.7.1:8787"), ("tracker.lan", "Tracker.LAN:8787"),
    ("0.0.0.0", "gpu-laptop:8787"), ("0.0.0.0", "gpu-laptop."), ("::", "GPU-LAPTOP"), ("0.0.0.0", "192.168.1.7"),
    ("127.0.0.1", "proxy.example.org"), ("127.0.0.1", "PROXY.example.org.:443"), ("127.0.0.1", "203.0.113.9"),
])
def test_the_tracker_s_own_names_and_any_address_pass(bind, host):
    allowed = AllowedHosts(bind, [check_allowed_host("proxy.example.org")], hostname=lambda: "gpu-laptop")
    assert allowed.problem(host) is None


@pytest.mark.parametrize("bind,host,says", [
    ("127.0.0.1", "evil.example:8787", "with --allowed-host evil.example"),
    ("127.0.0.1", "gpu-laptop:8787", "with --allowed-host gpu-laptop"),  # the hostname only when bound to all
    ("127.0.0.1", "localhost.evil.example", "with --allowed-host localhost.evil.example"),
    ("10.200.7.1", "tracker.lan", "with --allowed-host tracker.lan"),
    ("0.0.0.0", "evil.example", "Host 'evil.example' refused"),
    ("127.0.0.1", "", "an empty Host"),
    ("127.0.0.1", ":8787", "with --allowed-host NAME"),
    ("127.0.0.1", "[::1", "Host '[::1' refused"),
    ("127.0.0.1", "::1", "Host '::1' refused"),  # a v6 address goes in brackets in a Host header
    ("127.0.0.1", "evil.example:port", "Host 'evil.example:port' refused"),
    ("127.0.0.1", "a b", "Host 'a b' refused"),
    ("127.0.0.1", "evil\x1b]0;x\x07", "Host 'evil\\x1b]0;x\\x07' refused"),
])
def test_a_foreign_name_is_refused_naming_it_and_the_flag(bind, host, says):
    problem = AllowedHosts(bind, hostname=lambda: "gpu-laptop").problem(host)
    assert problem is not None and says in problem and "DNS rebinding" in problem
    assert "\x1b" not in problem and "gpu-laptop," not in problem  # names nothing the page could learn


def test_no_host_header_is_not_a_browser_and_passes():
    assert AllowedHosts("127.0.0.1").problem(None) is None


@pytest.mark.parametrize("value,normal", [("Tracker.Example.", "tracker.example"), ("10.0.0.5", "10.0.0.5"),
                                          ("[::1]", "::1"), ("under_score.lan", "under_score.lan")])
def test_an_allowed_host_is_kept_without_case_and_final_dot(value, normal):
    assert check_allowed_host(value) == normal


@pytest.mark.parametrize("value,says", [("", "is not a host name"), ("https://x.org", "without a scheme"),
                                        ("x.org:443", "without a port"), ("*.x.org", "is not a host name"),
                                        ("x y", "is not a host name"), ("-x.org", "is not a host name"),
                                        ("x" * 300, "is not a host name")])
def test_a_bad_allowed_host_is_a_usage_error(value, says):
    with pytest.raises(UsageError, match=None) as e:
        check_allowed_host(value)
    assert says in e.value.message and "\n" not in e.value.message


@pytest.fixture
def app(tmp_path):
    store = open_store(str(tmp_path / "t.db"))
    yield create_app(store, TOKEN, public_read=True, thin_every_s=0, allowed_hosts=AllowedHosts("127.0.0.1"))
    store.close()


@pytest.mark.parametrize("method,path", [("GET", "/api/v1/runs"), ("GET", "/"), ("GET", "/healthz"),
                                         ("GET", "/api/v1/overview"), ("POST", "/api/v1/heartbeats"),
                                         ("POST", "/login"), ("GET", "/static/dashboard.js"), ("GET", "/nosuch")])
def test_every_route_refuses_a_foreign_host_with_or_without_the_token(app, method, path):
    with TestClient(app, base_url="http://evil.example:8787") as c:
        for headers in ({}, AUTH):
            r = c.request(method, path, headers=headers, json={"heartbeats": []} if method == "POST" else None)
            assert r.status_code == 421, (path, r.status_code)
            assert "--allowed-host evil.example" in r.json()["error"]
    with TestClient(app, base_url="http://127.0.0.1:40000") as c:  # an agent's tunnel: another port, same name
        r = c.request(method, path, headers=AUTH, json={"heartbeats": []} if method == "POST" else None,
                      follow_redirects=False)
        assert r.status_code != 421


def test_two_host_headers_are_refused(app):
    async def call(scope):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)
        await app(scope, receive, send)
        return sent

    import asyncio

    scope = {"type": "http", "method": "GET", "path": "/healthz", "raw_path": b"/healthz", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1"), (b"host", b"evil.example")], "scheme": "http",
             "server": ("127.0.0.1", 8787), "client": ("127.0.0.1", 5), "http_version": "1.1", "root_path": "",
             "asgi": {"version": "3.0"}}
    sent = asyncio.run(call(scope))
    assert sent[0]["status"] == 421 and b"2 Host headers" in sent[1]["body"]
