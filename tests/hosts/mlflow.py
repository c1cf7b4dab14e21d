"""A real MLflow tracking server for tests, and a recording relay in front of it.

    def test_x(mlflow):                  # a server (one per test session and worker), a relay, a fresh experiment
        url = mlflow.relay.url           # point the agent here; mlflow.server.url is the server itself
        mlflow.relay.cut(); mlflow.relay.restore()          # the server unreachable for a while (refused)
        mlflow.history(run_id, "loss")   # read back through MLflow's REST API

The server is `mlflow server` with a SQLite backend, run from its own venv (build/out/mlflow-venv, built by
`make mlflow-venv`, which `make test` depends on): never installed at test time. Without that venv the fixture
skips, saying how to build it, except in CI (CI=true), where it fails.

Why a relay: MLflow's SQL store drops a metric point that is byte-identical to one it has (its primary key is key,
timestamp, step, value), so reading back cannot tell whether the agent sent a point twice. The relay forwards
every request unchanged and records what was sent and what was answered; it also makes the partitions: `cut()`
refuses connections and drops the open ones, `cut_after(pred)` cuts right after a request that matches,
`lose_answer(pred)` lets the server store a request and then drops the connection before the answer (the
"timed out after the server stored it" case).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional

import pytest

from tests.conftest import REPO_ROOT
from tests.hosts import free_port, require_built

VENV = os.path.join(REPO_ROOT, "build", "out", "mlflow-venv")
STAMP = os.path.join(VENV, ".installed")
API = "/api/2.0/mlflow/"


def unavailable_reason() -> Optional[str]:
    if not os.path.exists(STAMP) or not os.access(os.path.join(VENV, "bin", "mlflow"), os.X_OK):
        return "no MLflow server venv at %s: build it with `make mlflow-venv` (make test does)" % VENV
    return None


def require_mlflow() -> None:
    """Skip (visibly) without the venv; in CI (CI=true) that is a failure: CI must have built it."""
    require_built(unavailable_reason())


class MlflowServer:
    """`mlflow server` on loopback with a SQLite database; start() again after stop() reuses port and database."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.db = os.path.join(workdir, "mlflow.db")
        self.log_path = os.path.join(workdir, "mlflow.log")
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None  # when this process started it
        self.pid = 0  # its process (and process group) id, also when another test worker started it

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self, timeout: float = 90.0) -> "MlflowServer":
        import requests

        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.port = self.port or free_port()
        argv = [os.path.join(VENV, "bin", "mlflow"), "server", "--backend-store-uri", "sqlite:///" + self.db,
                "--default-artifact-root", os.path.join(self.workdir, "artifacts"), "--host", "127.0.0.1",
                "--port", str(self.port), "--workers", "1"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "ONBOX_"))}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        with open(self.log_path, "ab") as log:
            # its own session: the server forks uvicorn; stop() signals the group this fixture created
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("mlflow server exited with %s:\n%s" % (self.proc.returncode, self.log()))
            try:
                if requests.get(self.url + "/health", timeout=2).text.strip() == "OK":
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("mlflow server not ready after %.0f s:\n%s" % (timeout, self.log()))

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the server's process group (its own session, made by start()), SIGKILL if it lingers."""
        from onbox.proc import is_alive

        if not self.pid or (self.proc is not None and self.proc.poll() is not None):
            return
        pgid = self.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None:
                if self.proc.poll() is not None:
                    break
            elif not is_alive(pgid):  # another worker's child: gone, or a zombie its parent reaps
                break
            time.sleep(0.05)
        try:
            os.killpg(pgid, signal.SIGKILL)  # what is left of the group (a uvicorn worker)
        except ProcessLookupError:
            pass
        if self.proc is not None:
            self.proc.wait(timeout)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    # -- reading back through MLflow's REST API
    def api(self, method: str, endpoint: str, body: Optional[Dict[str, Any]] = None, **params: Any) -> Any:
        import requests

        r = requests.request(method, self.url + API + endpoint, json=body, params=params or None, timeout=30)
        r.raise_for_status()
        return r.json()

    def experiment_id(self, name: str) -> Optional[str]:
        import requests

        r = requests.get(self.url + API + "experiments/get-by-name", params={"experiment_name": name}, timeout=30)
        return r.json()["experiment"]["experiment_id"] if r.status_code == 200 else None

    def runs(self, experiment: str, deleted: bool = False) -> List[Dict[str, Any]]:
        eid = self.experiment_id(experiment)
        if eid is None:
            return []
        doc = self.api("POST", "runs/search", {"experiment_ids": [eid], "max_results": 1000,
                                               "run_view_type": "ALL" if deleted else "ACTIVE_ONLY"})
        return doc.get("runs") or []

    def run(self, run_id: str) -> Dict[str, Any]:
        return self.api("GET", "runs/get", run_id=run_id)["run"]

    def history(self, run_id: str, key: str) -> List[Dict[str, Any]]:
        """Every point of a metric, in the order MLflow returns them (paged)."""
        out: List[Dict[str, Any]] = []
        token = None
        for _ in range(1000):
            params: Dict[str, Any] = {"run_id": run_id, "metric_key": key, "max_results": 25000}
            if token:
                params["page_token"] = token
            doc = self.api("GET", "metrics/get-history", **params)
            out += doc.get("metrics") or []
            token = doc.get("next_page_token")
            if not token:
                return out
        return out


class _Relay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        self._relay()

    def do_POST(self) -> None:
        self._relay()

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _relay(self) -> None:
        import requests

        relay: MlflowRelay = self.server.relay  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if relay.is_cut:
            self._drop()
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
        r = requests.request(self.command, relay.upstream + self.path, data=body, headers=headers, timeout=60)
        try:
            doc = json.loads(body) if body else None
        except ValueError:
            doc = None
        rec = {"method": self.command, "path": self.path.split("?")[0], "body": doc, "status": r.status_code,
               "authorization": self.headers.get("Authorization"), "answered": True}
        with relay.lock:
            relay.records.append(rec)
            lose = relay._lose is not None and relay._lose(rec)
            if lose:
                relay._lose = None
                rec["answered"] = False
            cut = relay._cut_after is not None and relay._cut_after(rec)
            if cut:
                relay._cut_after = None
        if cut:
            relay.cut(after_answer=True)
        if lose:
            self._drop()  # the server stored it; the agent never hears so
            return
        try:
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)
        except (BrokenPipeError, ConnectionResetError):  # the agent went away (a test killed it)
            self.close_connection = True
            return
        if cut:
            self._drop()


class MlflowRelay:
    """Forwards HTTP to `upstream`, records every request (see the module docstring), cuts on demand."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.lock = threading.Lock()
        self.records: List[Dict[str, Any]] = []
        self.is_cut = False
        self.port = 0
        self._server: Optional[ThreadingHTTPServer] = None
        self._lose: Optional[Callable[[Dict[str, Any]], bool]] = None
        self._cut_after: Optional[Callable[[Dict[str, Any]], bool]] = None

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self) -> "MlflowRelay":
        server = ThreadingHTTPServer(("127.0.0.1", self.port), _Relay)
        server.daemon_threads = True
        server.relay = self  # type: ignore[attr-defined]
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def cut(self, after_answer: bool = False) -> None:
        """Refuse connections (the listener closes) and drop open ones at their next request."""
        self.is_cut = True
        server, self._server = self._server, None
        if server is not None:
            if after_answer:  # called from a handler thread: shutdown() would wait for serve_forever
                threading.Thread(target=lambda: (server.shutdown(), server.server_close()), daemon=True).start()
            else:
                server.shutdown()
                server.server_close()

    def restore(self) -> None:
        for _ in range(100):  # the old listener closes in a helper thread after cut_after
            try:
                self.is_cut = False
                self.start()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("relay could not listen on port %d again" % self.port)

    def cut_after(self, pred: Callable[[Dict[str, Any]], bool]) -> None:
        self._cut_after = pred

    def lose_answer(self, pred: Callable[[Dict[str, Any]], bool]) -> None:
        self._lose = pred

    def stop(self) -> None:
        self.cut()

    def log_batches(self, run_id: Optional[str] = None) -> List[Dict[str, Any]]:
        with self.lock:
            return [r for r in self.records if r["path"].endswith("/runs/log-batch") and r["body"]
                    and (run_id is None or r["body"].get("run_id") == run_id)]

    def metrics_sent(self, run_id: Optional[str] = None, key: Optional[str] = None) -> List[tuple]:
        """(key, step, timestamp, value) of every metric point in a log-batch the server accepted, in order."""
        return [(m["key"], m["step"], m["timestamp"], m["value"]) for r in self.log_batches(run_id)
                if r["status"] == 200 for m in r["body"].get("metrics") or [] if key is None or m["key"] == key]


class Mlflow:
    """What a test gets: the shared server, its own relay and its own experiment name."""

    def __init__(self, server: MlflowServer, relay: MlflowRelay) -> None:
        self.server = server
        self.relay = relay
        self.experiment = "t-%s" % uuid.uuid4().hex[:12]

    def history(self, run_id: str, key: str) -> List[Dict[str, Any]]:
        return self.server.history(run_id, key)

    def runs(self, deleted: bool = False) -> List[Dict[str, Any]]:
        return self.server.runs(self.experiment, deleted)


class SharedServer:
    """One server for the whole test run, shared by the pytest-xdist workers: the first worker that needs it starts
    it (under a file lock in the run's shared temp dir) and records its PID, start time and port; each worker
    registers as a user; the last one to leave stops it (by that PID, checked against its start time)."""

    def __init__(self, root: str, me: str) -> None:
        self.root, self.me = root, me
        self.info_path = os.path.join(root, "mlflow-server.json")
        self.lock_path = os.path.join(root, "mlflow-server.lock")

    def _locked(self) -> Any:
        import contextlib
        import fcntl

        @contextlib.contextmanager
        def locked() -> Any:
            with open(self.lock_path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # waits while another worker starts the server
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
        return locked()

    def _read(self) -> Dict[str, Any]:
        try:
            with open(self.info_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _write(self, info: Dict[str, Any]) -> None:
        with open(self.info_path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(self.info_path + ".tmp", self.info_path)

    def acquire(self) -> MlflowServer:
        from onbox.proc import is_alive, start_time

        with self._locked():
            info = self._read()
            if info and is_alive(info["pid"], info["start_time"]):
                server = MlflowServer(info["workdir"])
                server.port, server.pid = info["port"], info["pid"]
                info["users"] = sorted(set(info["users"]) | {self.me})
            else:
                server = MlflowServer(os.path.join(self.root, "mlflow-%s" % self.me)).start()
                info = {"pid": server.pid, "start_time": start_time(server.pid), "port": server.port,
                        "workdir": server.workdir, "users": [self.me]}
            self._write(info)
            return server

    def release(self, server: MlflowServer) -> None:
        from onbox.proc import is_alive

        with self._locked():
            info = self._read()
            users = set(info.get("users") or []) - {self.me}
            if users:
                info["users"] = sorted(users)
                self._write(info)
                return
            if info and is_alive(info["pid"], info["start_time"]):
                server.pid = info["pid"]
                server.stop()
            try:
                os.unlink(self.info_path)
            except FileNotFoundError:
                pass


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, worker_id):
    """One MLflow server for the test run (shared by the xdist workers): tests share it, each in its own
    experiment (and through its own relay)."""
    require_mlflow()
    base = tmp_path_factory.getbasetemp()
    shared = SharedServer(str(base.parent if worker_id != "master" else base), worker_id)
    server = shared.acquire()
    try:
        yield server
    finally:
        shared.release(server)


@pytest.fixture
def mlflow(mlflow_server):
    relay = MlflowRelay(mlflow_server.url).start()
    try:
        yield Mlflow(mlflow_server, relay)
    finally:
        relay.stop()
