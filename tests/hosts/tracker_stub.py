"""A stand-in tracker for the keeper's tests: a real HTTP server on a loopback (or bridge) address that answers
`GET /api/v1/runs` with whatever the test sets (a status and a body: garbage, a document nested too deep, an error
page), and takes `POST /api/v1/events` (the keeper's events) as the real one does. What a broken, hostile or
half-upgraded tracker answers, without making the real tracker (controller/tracker/) misbehave.

    stub = TrackerStub().start()
    stub.answer(200, b"<html>not a tracker</html>")
    ...
    stub.stop()
"""
from __future__ import annotations

import http.server
import json
import threading
from typing import Any, Dict, List, Optional, Tuple


class TrackerStub:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._answer: Tuple[int, bytes] = (200, b'{"runs": [], "skipped_rows": 0}')
        self.requests: List[str] = []
        self.events: List[Dict[str, Any]] = []
        self._server: Optional[http.server.ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return "http://%s:%d" % (self.host, self._server.server_address[1])

    def answer(self, status: int = 200, body: Any = b"") -> None:
        """What `GET /api/v1/runs` answers from now on: bytes as they are, anything else as JSON."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self._answer = (status, raw)

    def runs(self, *entries: Dict[str, Any], skipped: int = 0) -> None:
        """A well-formed run list: each entry {"run", "box", "liveness", ...} as the tracker lists a run."""
        self.answer(200, {"runs": list(entries), "skipped_rows": skipped})

    def start(self) -> "TrackerStub":
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: the test reads `requests`
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                stub.requests.append("GET " + self.path)
                if self.path.split("?")[0] == "/api/v1/runs":
                    self._send(*stub._answer)
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                stub.requests.append("POST " + self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(min(n, 1 << 20))
                if self.path == "/api/v1/events":
                    try:
                        stub.events.extend(json.loads(body).get("events") or [])
                    except ValueError:
                        pass
                    self._send(200, b'{"stored": 0}')
                else:
                    self._send(404, b'{"error": "not found"}')

        self._server = http.server.ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="tracker-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
