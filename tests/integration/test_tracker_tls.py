"""A hosted tracker over HTTPS: `onboxctl tracker serve --tls-cert/--tls-key` with a self-signed certificate.

The agent (a real HeartbeatHook, tests/hosts/heartbeat_agent.py, which pushes with `requests`) verifies the
certificate: pointed at the tracker's CA with REQUESTS_CA_BUNDLE it delivers; with only the system's CAs it
delivers nothing and keeps every beat spooled. `onboxctl status` verifies it too (SSL_CERT_FILE)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import requests

from tests.conftest import subprocess_env
from tests.hosts.stall_load import Agent
from tests.hosts.tracker import TrackerProcess
from tests.polling import wait_for

pytestmark = pytest.mark.integration


def test_agent_delivers_over_https_only_when_it_trusts_the_certificate(tmp_path, cert):
    crt, key = cert
    t = TrackerProcess(str(tmp_path / "tracker"), extra_args=["--tls-cert", crt, "--tls-key", key]).start()
    url = "https://127.0.0.1:%d" % t.port
    trusting = distrusting = None
    try:
        with open(t.ready_file) as f:
            assert json.load(f)["scheme"] == "https"
        with pytest.raises(requests.exceptions.SSLError):  # plain trust: the self-signed certificate is refused
            requests.get(url + "/healthz", timeout=10)
        with pytest.raises(requests.exceptions.ConnectionError):  # and plain HTTP is not served on that port
            requests.get("http://127.0.0.1:%d/healthz" % t.port, timeout=10)

        trusting = Agent(str(tmp_path / "a1"), url, t.token_file, name="trusting", env={"REQUESTS_CA_BUNDLE": crt})
        distrusting = Agent(str(tmp_path / "a2"), url, t.token_file, name="distrusting",
                            env={"REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt"})

        def runs():
            r = requests.get(url + "/api/v1/runs", headers=t.headers(), verify=crt, timeout=10)
            return {x["run"]: x for x in r.json()["runs"]}

        wait_for(lambda: (runs().get("trusting") or {}).get("seq"), 30, "beats over https", 0.1)
        spool = os.path.join(str(tmp_path / "a2"), "run", "heartbeats", "spool-tracker")
        wait_for(lambda: os.path.isdir(spool) and len(os.listdir(spool)) >= 5, 30, "the distrusting agent's spool")
        assert "distrusting" not in runs()  # it never sent a beat (nor its token) to an unverified server

        r = subprocess.run([sys.executable, "-m", "controller", "status", "--json", "--tracker", url,
                            "--tracker-token-file", t.token_file], env=subprocess_env({"SSL_CERT_FILE": crt}),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert [x["run"] for x in json.loads(r.stdout)["runs"]] == ["trusting"]
        res = trusting.stop()
        trusting = None
        assert res["backlog"] == 0
    finally:
        for a in (trusting, distrusting):
            if a is not None:
                a.kill()
        t.stop()


@pytest.mark.parametrize("args,message", [
    (["--tls-cert", "CERT"], "--tls-cert and --tls-key go together"),
    (["--tls-key", "KEY"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "CERT", "--tls-key", "CERT"], "not a PEM certificate and its own private key"),
    (["--tls-cert", "KEY", "--tls-key", "KEY"], "not a PEM certificate and its own private key"),
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "KEY"], "cannot read /nonexistent/cert.pem"),
])
def test_bad_tls_files_are_one_line_errors_and_create_nothing(tmp_path, cert, args, message):
    crt, key = cert
    args = [{"CERT": crt, "KEY": key}.get(a, a) for a in args]
    db = tmp_path / "new" / "t.db"
    r = subprocess.run([sys.executable, "-m", "controller", "tracker", "serve", "--db", str(db), "--port", "0", *args],
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()  # nothing half-made: no directory, no database, no token


@pytest.mark.root
def test_a_plain_http_bind_beyond_loopback_warns_in_one_line(tmp_path):
    from tests.hosts.sshd_box import Netns

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for a test-only address")
    ns = Netns()
    try:
        ns.create()  # an address of this machine that is not loopback, and exists only for this test
        t = TrackerProcess(str(tmp_path / "tracker"), host=ns.host_addr).start()
        try:
            assert requests.get(t.url + "/healthz", timeout=10).json()["ok"] is True
            warnings = [line for line in t.log().splitlines() if "cleartext" in line]
            assert len(warnings) == 1 and "--tls-cert" in warnings[0], t.log()
        finally:
            t.stop()
        t = TrackerProcess(str(tmp_path / "quiet")).start()  # 127.0.0.1: nothing to warn about
        t.stop()
        assert "cleartext" not in t.log()
    finally:
        ns.destroy()


@pytest.mark.parametrize("mode,warned", [(0o644, "others"), (0o640, "its group"), (0o600, None)])
def test_a_token_file_others_can_read_warns_in_one_line(tmp_path, mode, warned):
    t = TrackerProcess(str(tmp_path / "tracker"))
    os.chmod(t.token_file, mode)
    t.start()
    t.stop()
    lines = [line for line in t.log().splitlines() if "token file" in line]
    if warned is None:
        assert lines == []
    else:
        assert len(lines) == 1 and "readable by %s" % warned in lines[0] and "chmod 600" in lines[0], lines
