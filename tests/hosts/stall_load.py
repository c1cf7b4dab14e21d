"""Stalled HTTP clients against a tracker, while a real agent delivers beats and a reader polls /api/v1/runs.

    python -m tests.hosts.stall_load --sockets 2200 --seconds 20 [--tracker-arg=--header-timeout=2 ...]

starts a real `onboxctl tracker serve` (tests/hosts/tracker.py), a real HeartbeatHook agent
(tests/hosts/heartbeat_agent.py) pushing every 0.05 s, a reader polling GET /api/v1/runs, and N stalled sockets
from other loopback addresses (127.0.0.2-5: the agent and reader come from 127.0.0.1) that keep their number up
for the whole window: a quarter connect and send nothing, a quarter send half their headers, a quarter send
complete headers and a few bytes of a promised body, a quarter make one GET and then stay idle (keep-alive). Prints one
JSON document of what happened (the tracker's behaviour is measured here, never asserted on time).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import requests

from tests.conftest import subprocess_env

KINDS = ("silent", "half_headers", "half_body", "idle")
PAYLOAD = {
    "silent": b"",
    "half_headers": b"POST /api/v1/heartbeats HTTP/1.1\r\nHost: tracker\r\nContent-",
    "half_body": b"POST /api/v1/heartbeats HTTP/1.1\r\nHost: tracker\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 2000\r\n\r\n{\"heartbeats\": [",
    "idle": b"GET /healthz HTTP/1.1\r\nHost: tracker\r\n\r\n",
}


def raise_fd_limit(want: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, want))
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


class StalledClients:
    """`total` stalled sockets spread over `sources`, re-opened when the server closes one, until stop()."""

    def __init__(self, host: str, port: int, total: int, sources=("127.0.0.2", "127.0.0.3", "127.0.0.4",
                                                                 "127.0.0.5"), max_opens: int = 200000,
                 reopen: bool = True) -> None:
        self.host, self.port, self.total, self.sources = host, port, total, list(sources)
        self.reopen = reopen
        self.max_opens = max_opens
        self.sel = selectors.DefaultSelector()
        self.counts: Dict[str, int] = {"opened": 0, "open_failed": 0, "closed_silently": 0, "answered_408": 0,
                                       "answered_503": 0, "answered_other": 0}
        self.peak_open = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalled-clients", daemon=True)

    def start(self) -> "StalledClients":
        for i in range(self.total):
            self._open(i)
        self._thread.start()
        return self

    def _open(self, i: int) -> None:
        if self.counts["opened"] >= self.max_opens:
            return
        kind = KINDS[i % len(KINDS)]
        s = socket.socket()
        try:
            s.bind((self.sources[(i // len(KINDS)) % len(self.sources)], 0))  # every source sends every kind
            s.settimeout(5)
            s.connect((self.host, self.port))
            if PAYLOAD[kind]:
                s.sendall(PAYLOAD[kind])
            s.setblocking(False)
        except OSError:
            self.counts["open_failed"] += 1
            s.close()
            return
        self.counts["opened"] += 1
        self.sel.register(s, selectors.EVENT_READ, (i, kind, bytearray()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_open = max(self.peak_open, len(self.sel.get_map()))
            for key, _ in self.sel.select(timeout=0.1):
                i, _kind, got = key.data
                try:
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if data:
                    got.extend(data)
                    continue
                self._closed(key.fileobj, got)
                if self.reopen and not self._stop.is_set():
                    self._open(i)

    def _closed(self, sock: Any, got: bytes) -> None:
        """The server closed `sock`: count how (408 / 503 / another answer / silently)."""
        last = got.rfind(b"HTTP/1.1 ")  # the newest answer (an idle socket first got its 200)
        status = bytes(got[last + 9:last + 12]) if last >= 0 else b""
        self.counts[{b"408": "answered_408", b"503": "answered_503"}.get(
            status, "answered_other" if got else "closed_silently")] += 1
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def stop(self) -> None:
        """Close every socket still open (idempotent)."""
        if self._stop.is_set() and self.sel.get_map() is None:
            return
        self._stop.set()
        self._thread.join(10)
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self.sel.close()


class Reader:
    """GET /api/v1/runs every `period` seconds: status codes and latencies."""

    def __init__(self, url: str, token: str, period: float = 0.05) -> None:
        self.url, self.token, self.period = url, token, period
        self.codes: Dict[str, int] = {}
        self.latencies: List[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reader", daemon=True)

    def start(self) -> "Reader":
        self._thread.start()
        return self

    def _run(self) -> None:
        with requests.Session() as s:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    code = str(s.get(self.url + "/api/v1/runs", headers={"Authorization": "Bearer " + self.token},
                                     timeout=10).status_code)
                except requests.RequestException as e:
                    code = type(e).__name__
                self.latencies.append(time.monotonic() - t0)
                self.codes[code] = self.codes.get(code, 0) + 1
                self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(20)

    def summary(self) -> Dict[str, Any]:
        lat = sorted(self.latencies) or [0.0]
        return {"requests": len(self.latencies), "codes": self.codes,
                "p50_ms": round(statistics.median(lat) * 1000, 1),
                "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 1),
                "max_ms": round(lat[-1] * 1000, 1)}


class Agent:
    """tests/hosts/heartbeat_agent.py: a real HeartbeatHook pushing to the tracker, until stop()."""

    def __init__(self, workdir: str, url: str, token_file: str, name: str = "under-load",
                 env: Optional[Dict[str, str]] = None) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.stop_file = os.path.join(workdir, "stop")
        self.result = os.path.join(workdir, "result.json")
        self.log = os.path.join(workdir, "agent.log")
        argv = [sys.executable, "-m", "tests.hosts.heartbeat_agent", "--run-dir", os.path.join(workdir, "run"),
                "--name", name, "--tracker", url, "--token-file", token_file, "--interval", "0.05",
                "--stop-file", self.stop_file, "--result", self.result, "--max-seconds", "300"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=subprocess_env(env), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)

    def stop(self, timeout: float = 120.0) -> Dict[str, Any]:
        open(self.stop_file, "w").close()
        self.proc.wait(timeout)
        with open(self.result) as f:
            return json.load(f)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def beats_of(t: Any, run: str) -> List[int]:
    """The run's stored seqs ([-1] when the tracker does not answer: the measurement goes on)."""
    try:
        return sorted(b["seq"] for b in t.all_heartbeats(run))
    except requests.RequestException:
        return [-1]


def main(argv: Optional[List[str]] = None) -> int:
    from tests.hosts.tracker import TrackerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sockets", type=int, default=2200)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tracker-arg", action="append", default=[])
    ap.add_argument("--no-reopen", action="store_true", help="open the stalled sockets once (as in the report)")
    args = ap.parse_args(argv)
    raise_fd_limit(2 * args.sockets + 1000)  # ours and the tracker's (it inherits the limit)
    with tempfile.TemporaryDirectory(prefix="stall") as tmp:
        t = TrackerProcess(os.path.join(tmp, "tracker"), extra_args=args.tracker_arg).start()
        agent = reader = stalled = None
        try:
            agent = Agent(os.path.join(tmp, "agent"), t.url, t.token_file)
            time.sleep(1.0)
            before = len(beats_of(t, "under-load"))
            reader = Reader(t.url, t.token).start()
            t0 = time.monotonic()
            stalled = StalledClients("127.0.0.1", t.port, args.sockets, reopen=not args.no_reopen).start()
            time.sleep(args.seconds)
            during = len(beats_of(t, "under-load")) - before  # negative: the tracker did not answer
            stalled.stop()
            reader.stop()
            window = time.monotonic() - t0
            res = agent.stop()
            got = beats_of(t, "under-load")
            health = requests.get(t.url + "/healthz", headers=t.headers(), timeout=10).json()
            print(json.dumps({
                "stalled_sockets": args.sockets, "reopen": not args.no_reopen, "window_s": round(window, 1), "tracker_args": args.tracker_arg,
                "stalled": dict(stalled.counts, peak_open=stalled.peak_open),
                "reader_GET_runs": reader.summary(),
                "agent": {"beats_delivered_during_window": during, "beats_taken": res["next_seq"] - res["first_seq"],
                          "beats_stored_at_end": len(got), "spool_backlog_at_end": res["backlog"]},
                "tracker_healthz": health}, indent=1))
        finally:
            for part in (stalled, reader):
                if part is not None:
                    try:
                        part.stop()
                    except Exception:
                        pass
            if agent is not None:
                agent.kill()
            t.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
