"""The HTTP sinks against a real loopback server: healthchecks-style pings (/start, success, /fail), and the
proxy environment honoured by the tracker sink. (A recording server from the stdlib is fine for a test peer.)"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from onbox.clock import FakeClock
from onbox.heartbeat.collect import BoxReaders
from onbox.heartbeat.hook import HeartbeatHook
from onbox.heartbeat.sinks import PingSink, SinkError, TrackerSink
from tests.fakes.run_context import run_context


class Recorder:
    def __init__(self):
        self.requests = []
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                rec.requests.append((self.command, self.path, dict(self.headers), body))
                out = json.dumps({"accepted": 1, "duplicates": 0}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


@pytest.mark.integration
def test_ping_start_success_fail(recorder, tmp_path):
    clock = FakeClock()
    ctx = run_context(tmp_path, name="p1", clock=clock, durable=None, heartbeat_interval=30.0,
                      ping_url=recorder.url + "/ping/abc")
    hook = HeartbeatHook(ctx, readers=BoxReaders(gpu=lambda: {"available": False}, host=lambda: {}), sinks=[])
    state = {"state": "running", "attempt": 0}
    hook.tick(state)
    hook.ping.join(10)
    clock.advance(31)
    hook.tick(state)
    hook.ping.join(10)
    hook.close(dict(state, state="failed"))
    paths = [p for _, p, _, _ in recorder.requests]
    assert paths == ["/ping/abc/start", "/ping/abc", "/ping/abc/fail"]


@pytest.mark.integration
def test_tracker_sink_honours_proxy_env_and_sends_bearer(recorder, tmp_path, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", recorder.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    sink = TrackerSink("http://tracker.invalid:8787", token_file=str(token), timeout=5)
    sink.send([{"seq": 0}])
    method, path, headers, body = recorder.requests[0]
    assert method == "POST" and path == "http://tracker.invalid:8787/api/v1/heartbeats"  # absolute URI: a proxy
    assert headers["Authorization"] == "Bearer s3cret"
    assert json.loads(body) == {"heartbeats": [{"seq": 0}]}


@pytest.mark.integration
def test_unreachable_tracker_is_a_sink_error_within_the_timeout(tmp_path):
    sink = TrackerSink("http://127.0.0.1:9", timeout=2)  # discard port: connection refused
    with pytest.raises(SinkError):
        sink.send([{"seq": 0}])
    assert PingSink("http://127.0.0.1:9", timeout=2).ping("success") is False
