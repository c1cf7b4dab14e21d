"""One long-lived `rclone rcd` per rclone target: the calls of a commit go to it over HTTP on a unix socket instead
of each starting an rclone process (~50-100 ms apiece on a loaded 2-core box, most of what a small commit costs).

- Started at the first call (`ready()`), by toolrun.Helper: it dies with this process, SIGKILL included
  (PR_SET_PDEATHSIG), and is stopped by its PID and start time (`stop()`: the target's close, the agent's end, the
  target's garbage collection).
- Reached only by this process: the socket lies in a directory of mode 0700 made for it, and every request carries
  a user and password drawn at random for it, handed over in its environment (RCLONE_RC_USER / RCLONE_RC_PASS:
  never in its argv, which every user of the box can read, nor in a file).
- It writes only what a call asks. A call that times out here may still be running there: the daemon is killed
  (as a timed-out rclone process is) before the timeout is raised, and the next call starts a fresh one.
- When it cannot start (an rclone without rc on a unix socket, 1.60 for one; older than MIN_VERSION; a socket path
  too long) `problem` says why and the target makes plain CLI calls for the rest of its life; so it does after
  MAX_ENDED daemons ended by themselves under it (those stopped or killed here do not count).
- `--rc-serve` lets a small file be read by one GET (`read`), which rc's API has no call for.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from typing import Any, Dict, Optional, Sequence, Tuple

from onbox.toolrun import Helper

MIN_VERSION = (1, 65)  # the oldest rclone the rc path was checked against; an older one gets plain CLI calls
MAX_ENDED = 3  # daemons that ended by themselves under a target before it stays with the CLI
SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes
ERROR_BODY_MAX = 64 * 1024
START_POLL_S = 0.003  # how often a starting daemon's socket is looked for (it takes ~70 ms)


class RcdGone(Exception):
    """The daemon ended, or its socket refused, during a call: whether the call's work happened is unknown.
    `sent`: False when nothing reached it (the call can be made again safely)."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            raise
        self.sock = s


class Rcd:
    """The daemon of one target; `rclone` its binary, `flags` the flags every call carries (the target's own list,
    read when a daemon starts: they go on its command line)."""

    def __init__(self, rclone: str, flags: Sequence[str], start_timeout: float = 10.0) -> None:
        self.rclone = rclone
        self.flags = flags
        self.start_timeout = start_timeout
        self.problem: Optional[str] = None  # why this target makes CLI calls instead (None: it uses the daemon)
        self.ended = 0  # daemons of this target that ended by themselves (not stopped or killed here)
        self._helper: Optional[Helper] = None
        self._dir: Optional[str] = None
        self._auth = ""
        self._answering = False  # the daemon running now answered its first call
        self._owner = 0  # the process that started it (a fork inherits this object: neither its daemon nor its dir)
        self._lock = threading.RLock()  # reentrant: a start whose first call times out kills what it started

    @property
    def pid(self) -> Optional[int]:
        h = self._helper
        return h.pid if h is not None and h.running() else None

    def ready(self) -> bool:
        """The daemon answers (started now when it is not running); False when this target uses the CLI."""
        with self._lock:
            if not self._launch():
                return False
            if not self._answering:
                try:
                    self._await()
                except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
                    self.problem = str(e)
                    self._discard()
                    return False
                self._answering = True
            return True

    def _launch(self) -> bool:
        """A daemon started (or running); False when this target uses the CLI. The caller holds the lock."""
        if self.problem is not None:
            return False
        if self._helper is not None and self._helper.running():
            return True
        if self._helper is not None and self._helper.owner == os.getpid():
            self.ended += 1  # it ended by itself (one this target stopped is gone from _helper)
            if self.ended >= MAX_ENDED:
                self.problem = "rclone rcd ended by itself %d times (last: %s)" % (self.ended, self._helper.tail())
                self._discard()
                return False
        self._discard()
        self._owner = os.getpid()
        self._dir = tempfile.mkdtemp(prefix="onbox-rcd-")  # 0700: only this user reaches the socket
        sock = os.path.join(self._dir, "rc.sock")
        user, password = secrets.token_hex(8), secrets.token_hex(24)
        self._auth = "Basic " + base64.b64encode(("%s:%s" % (user, password)).encode()).decode()
        env = dict(os.environ, RCLONE_RC_USER=user, RCLONE_RC_PASS=password)
        try:
            if len(sock.encode()) > SOCKET_PATH_MAX:
                raise RuntimeError("the socket path %s is too long for a unix socket" % sock)
            self._helper = Helper([self.rclone, "rcd", "--rc-addr", "unix://" + sock, "--rc-serve", *self.flags],
                                  env)
            self._helper.start()
        except FileNotFoundError:
            self.problem = "%s is not installed" % self.rclone  # the CLI call says so, in its own words
        except (OSError, RuntimeError) as e:
            self.problem = str(e)
        if self.problem is not None:
            self._discard()
            return False
        return True

    def _await(self) -> None:
        """Wait (bounded) for the daemon just started to answer, and check that its rclone is recent enough."""
        assert self._helper is not None and self._dir is not None
        deadline = time.monotonic() + self.start_timeout
        while True:  # bounded: the deadline, and the daemon's own end
            try:
                status, doc = self.call("core/version", {}, self.start_timeout)
                break
            except RcdGone as e:  # no socket yet, or one bound and not yet listening: refused
                if e.sent:
                    raise RuntimeError(str(e))
            if not self._helper.running():
                raise RuntimeError("rclone rcd ended at its start: %s" % (self._helper.tail() or "no message"))
            if time.monotonic() > deadline:
                raise RuntimeError("rclone rcd did not answer within %.0f s" % self.start_timeout)
            time.sleep(START_POLL_S)
        version = tuple(doc.get("decomposed") or ())[:2] if status == 200 else ()
        if version < MIN_VERSION:
            raise RuntimeError("rclone %s is older than %s" % (doc.get("version") or "?",
                                                                "%d.%d" % MIN_VERSION))

    def _discard(self, kill: bool = False) -> None:
        """Stop the daemon (if it runs; `kill`: SIGKILL at once) and remove its socket's directory."""
        self._answering = False
        if self._helper is not None:
            self._helper.stop(kill=kill)
            self._helper = None
        if self._dir is not None and self._owner == os.getpid():
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None

    def stop(self) -> None:
        """The target is done: the daemon goes (a later call would start another)."""
        with self._lock:
            self._discard()

    def kill(self) -> None:
        """After a call that timed out here: what it started there must not go on (SIGKILL, as a timed-out rclone
        process gets)."""
        with self._lock:
            self._discard(kill=True)

    # -- requests ----------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Optional[bytes], timeout: float,
                 limit: int) -> Tuple[int, bytes]:
        helper, folder = self._helper, self._dir
        if helper is None or folder is None:
            raise RcdGone("rclone rcd is not running", sent=False)
        conn = _UnixHTTP(os.path.join(folder, "rc.sock"), timeout)
        sent = False
        try:
            conn.connect()
            headers = {"Authorization": self._auth}
            if body is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body, headers)
            sent = True
            resp = conn.getresponse()
            return resp.status, resp.read(limit if resp.status == 200 else ERROR_BODY_MAX)
        except socket.timeout:
            self.kill()
            raise subprocess.TimeoutExpired([self.rclone, "rcd", path], timeout)
        except (OSError, http.client.HTTPException) as e:
            raise RcdGone("rclone rcd did not answer (%s)%s" % (
                e, ": " + helper.tail() if not helper.running() and helper.tail() else ""), sent=sent)
        finally:
            conn.close()

    def call(self, method: str, params: Dict[str, Any], timeout: float) -> Tuple[int, Dict[str, Any]]:
        """(HTTP status, the JSON reply) of rc method `method`; 200 is success, else the reply's "error" says why.
        RcdGone when the daemon did not answer, subprocess.TimeoutExpired after `timeout` s (the daemon killed)."""
        status, raw = self._request("POST", "/" + method, json.dumps(params).encode(), timeout, 1 << 30)
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            doc = {"error": raw[:300].decode("utf-8", "replace")}
        return status, doc if isinstance(doc, dict) else {"error": "not a JSON object: %r" % raw[:100]}

    def read(self, fs: str, remote: str, limit: int, timeout: float) -> Tuple[int, bytes]:
        """(HTTP status, at most `limit` bytes) of the file `remote` of remote `fs` (404: there is none)."""
        path = "/" + urllib.parse.quote("[%s]/%s" % (fs, remote), safe="/")
        return self._request("GET", path, None, timeout, limit)
