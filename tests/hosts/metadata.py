"""A fake cloud instance-metadata service on loopback, following the providers' documented endpoints:

- AWS IMDSv2: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` returns a token; every GET needs
  `X-aws-ec2-metadata-token` (401 without). `GET /latest/meta-data/spot/instance-action` is 404 until a
  preemption, then `{"action": "terminate", "time": "<UTC ISO>"}`.
- GCP: `GET /computeMetadata/v1/instance/preempted` needs `Metadata-Flavor: Google` (403 without); `FALSE`/`TRUE`.
- Azure: `GET /metadata/scheduledevents?api-version=2019-01-01` needs `Metadata: true` (400 without); a document
  with `Events`, holding a `Preempt` event with `NotBefore` (RFC 1123) once preempted.

    def test_x(metadata_server):
        metadata_server.provider = "aws"     # which cloud it pretends to be ("aws", "gcp", "azure")
        metadata_server.preempt(lead=30)     # switch to "preempt now"
        metadata_server.answer = b"[[[..."   # the notice endpoint answers 200 with these bytes instead (None: off)
        metadata_server.url                   # base URL
        metadata_server.requests              # [(method, path, {lowercased header: value})] seen
"""
from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any, List, Optional, Tuple

import pytest


class FakeMetadata:
    def __init__(self) -> None:
        self.provider = "aws"
        self.preempt_at: Optional[float] = None  # wall time the instance goes away
        self.answer: Optional[bytes] = None  # a broken or spoofed service: the notice endpoint's body, as is
        self.tokens: set = set()
        self.requests: List[Tuple[str, str, dict]] = []
        self.lock = threading.Lock()
        self.url = ""

    def preempt(self, lead: float = 30.0) -> None:
        with self.lock:
            self.preempt_at = time.time() + lead

    def handle(self, method: str, path: str, headers: Any) -> Tuple[int, str, bytes]:
        with self.lock:
            self.requests.append((method, path, {k.lower(): v for k, v in headers.items()}))
            p = self.provider
            at = self.preempt_at
            answer = self.answer
        if p == "aws":
            if method == "PUT" and path == "/latest/api/token":
                if not headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return 400, "text/plain", b"missing ttl"
                token = "tok-%d" % len(self.tokens)
                self.tokens.add(token)
                return 200, "text/plain", token.encode()
            if method == "GET" and path.startswith("/latest/"):
                if headers.get("X-aws-ec2-metadata-token") not in self.tokens:
                    return 401, "text/plain", b"unauthorized"
                if path == "/latest/meta-data/spot/instance-action":
                    if answer is not None:
                        return 200, "application/json", answer
                    if at is None:
                        return 404, "text/plain", b"Not Found"
                    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
                    return 200, "application/json", json.dumps({"action": "terminate", "time": when}).encode()
            return 404, "text/plain", b"Not Found"
        if p == "gcp":
            if method == "GET" and path == "/computeMetadata/v1/instance/preempted":
                if headers.get("Metadata-Flavor") != "Google":
                    return 403, "text/plain", b"Missing Metadata-Flavor:Google header"
                return 200, "application/text", b"TRUE" if at is not None else b"FALSE"
            return 404, "text/plain", b"Not Found"
        if p == "azure":
            if method == "GET" and path.split("?")[0] == "/metadata/scheduledevents":
                if headers.get("Metadata") != "true":
                    return 400, "application/json", b'{"error": "Bad request. Required metadata header not specified"}'
                if answer is not None:
                    return 200, "application/json", answer
                events = []
                if at is not None:
                    events.append({"EventId": "A123BC45-1234-5678-AB90-ABCDEF123456", "EventType": "Preempt",
                                   "ResourceType": "VirtualMachine", "Resources": ["vm1"],
                                   "EventStatus": "Scheduled",
                                   "NotBefore": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(at))})
                return 200, "application/json", json.dumps({"DocumentIncarnation": 1, "Events": events}).encode()
            return 404, "text/plain", b"Not Found"
        return 404, "text/plain", b"Not Found"


@pytest.fixture
def metadata_server():
    fake = FakeMetadata()

    class Handler(http.server.BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            code, ctype, body = fake.handle(self.command, self.path, self.headers)
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = _serve
        do_PUT = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = "http://127.0.0.1:%d" % server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def garbage_metadata_server():
    """A "metadata service" on loopback that answers every connection with bytes that are not HTTP (a captive
    portal, a broken proxy on the link-local address): the client's read raises. Yields its base URL."""
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()
    served: List[int] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    conn.recv(65536)
                    conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                except OSError:
                    pass
            served.append(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield "http://127.0.0.1:%d" % listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
