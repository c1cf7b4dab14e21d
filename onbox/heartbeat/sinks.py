"""Where heartbeats go: the onbox tracker (HTTP), a JSONL file (e.g. on the durable dir), a healthchecks-style
ping URL (MLflow: onbox/heartbeat/mlflow.py). And the `Sender`: one thread per spooled sink, pushing in order with
exponential backoff and jitter, saying when its sink is down (`on_health`) and when it answers again.

Every request has a timeout. `requests` honours HTTP(S)_PROXY / NO_PROXY from the environment (trust_env). The
tracker token comes from a file or ONBOX_TRACKER_TOKEN, never from argv (U34), and is re-read after a 401.
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox.clock import Clock, SystemClock
from onbox.config import url_problem
from onbox.environment import Environment
from onbox.errors import UsageError
from onbox.fsutil import read_token_file
from onbox.heartbeat.spool import Spool

log = logging.getLogger("onbox.heartbeat")

MAX_REQUEST_BYTES = 1 << 20  # a request's body; the tracker takes up to 4 MiB (--max-body)


class SinkError(Exception):
    """A send that did not get through (network, 5xx, auth). The beats stay spooled."""


class Rejected(Exception):
    """The sink refuses these beats for good (4xx on a valid-looking request): do not resend them as they are."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def read_token(token_file: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The bearer token: the file's first line, else $ONBOX_TRACKER_TOKEN, else None."""
    token = read_token_file(token_file) if token_file else ""
    return token or Environment.read(environ).tracker_token


def preflight(cfg: Any, environ: Optional[Mapping[str, str]] = None) -> None:
    """What would make the heartbeat sinks fail to start, checked in `onbox run` BEFORE it detaches (a daemon's
    log is where nobody looks): the tracker and ping URLs, the token (U34: a file or the environment only, and
    a tracker without one answers every beat with 401), the heartbeat file's directory."""
    from onbox import fsutil
    from onbox.errors import UnfitError

    for flag, url in (("--tracker", cfg.tracker), ("--ping-url", cfg.ping_url)):
        problem = url and url_problem(url)
        if problem:
            raise UsageError("%s %r: %s" % (flag, url, problem), hint="e.g. http://10.0.0.5:8787")
    if cfg.tracker:
        try:
            token = read_token(cfg.tracker_token_file, environ)
        except OSError as e:
            raise UsageError("cannot read the tracker token file %s: %s" % (cfg.tracker_token_file,
                                                                             e.strerror or e),
                             hint="put the token in a file (mode 600) or in ONBOX_TRACKER_TOKEN; never on the "
                                  "command line (U34)")
        if not token:
            raise UsageError("the tracker %s needs a token: none in %s" % (
                cfg.tracker, cfg.tracker_token_file or "ONBOX_TRACKER_TOKEN"),
                hint="--tracker-token-file PATH (the token on its first line) or ONBOX_TRACKER_TOKEN (U34)")
    if cfg.heartbeat_file:
        problem = fsutil.dir_problem(os.path.dirname(os.path.abspath(cfg.heartbeat_file)))
        if problem:
            raise UnfitError("cannot write the heartbeat file %s: %s" % (cfg.heartbeat_file, problem),
                             hint="give --heartbeat-file a path on a writable disk")


def _session() -> Any:
    import requests  # heavy import: only in the sender thread, never at `onbox` start-up

    s = requests.Session()
    s.trust_env = True  # HTTP(S)_PROXY, NO_PROXY
    s.headers["User-Agent"] = "onbox-heartbeat"
    return s


class TrackerSink:
    """POST /api/v1/heartbeats {"heartbeats": [...]} -> 200 {"accepted": n, "duplicates": m}.

    A backlog's batch goes in requests of at most `max_request_bytes` (beats carry the trainer's points, up to
    ~40 KB each: a hundred of them would pass the tracker's 4 MiB --max-body); a beat larger than that goes
    alone. The tracker stores a beat once, so a batch cut short by a failure is simply sent again."""

    name = "tracker"
    wants_points = True  # the beat's `points` section: the trainer's records since the previous beat

    def __init__(self, url: str, token_file: Optional[str] = None, timeout: float = 10.0,
                 environ: Optional[Dict[str, str]] = None, max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        if not url.startswith(("http://", "https://")):
            raise UsageError("tracker %r is not an http(s) URL" % url, hint="e.g. --tracker http://10.0.0.5:8787")
        self.endpoint = url.rstrip("/") + "/api/v1/heartbeats"
        self.max_request_bytes = max_request_bytes
        self.token_file = token_file
        self.timeout = timeout
        self.environ = environ
        try:
            self.token = read_token(token_file, environ)
        except OSError as e:
            raise UsageError("cannot read the tracker token file %s: %s" % (token_file, e.strerror or e),
                             hint="put the token in a file (mode 600), or in ONBOX_TRACKER_TOKEN; never on the "
                                  "command line (U34)")
        self._http: Any = None

    def send(self, beats: List[Dict[str, Any]]) -> None:
        texts = [json.dumps(b, separators=(",", ":"), allow_nan=False) for b in beats]
        start, size = 0, 0
        for i, text in enumerate(texts):
            if i > start and size + len(text) + 1 > self.max_request_bytes:
                self._post(texts[start:i])
                start, size = i, 0
            size += len(text) + 1
        self._post(texts[start:])

    def _post(self, texts: List[str]) -> None:
        import requests

        if self._http is None:
            self._http = _session()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = "Bearer " + self.token
        body = '{"heartbeats":[%s]}' % ",".join(texts)
        try:
            r = self._http.post(self.endpoint, data=body.encode("utf-8"), headers=headers, timeout=self.timeout)
        except requests.RequestException as e:
            raise SinkError("tracker unreachable: %s" % e.__class__.__name__)
        if r.status_code == 200:
            return
        if r.status_code in (401, 403):
            try:
                self.token = read_token(self.token_file, self.environ)  # the token may have been rotated
            except OSError:
                pass
            raise SinkError("tracker refused the token (%d)" % r.status_code)
        if r.status_code in (400, 413, 422):
            raise Rejected("tracker rejected %d beat(s): %d %s" % (len(texts), r.status_code, r.text[:200]),
                           r.status_code)
        raise SinkError("tracker answered %d" % r.status_code)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


class FileSink:
    """Appends each beat as one JSON line to a file (e.g. `<durable>/<run>/heartbeats.jsonl`), fsynced: the whole
    beat, with the trainer's points since the previous one."""

    name = "file"
    wants_points = True

    def __init__(self, path: str) -> None:
        self.path = path

    def send(self, beats: List[Dict[str, Any]]) -> None:
        data = "".join(json.dumps(b, sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n" for b in beats)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:  # a durable mount that hiccups: keep the beats spooled, retry later
            raise SinkError("heartbeat file %s: %s" % (self.path, e))

    def close(self) -> None:
        return None


class PingSink:
    """healthchecks.io-style pings: `<url>/start` once, `<url>` on a healthy beat, `<url>/fail` on a failure.

    Pings are liveness, not history: only the newest is sent (no spool, no replay of stale pings).
    """

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise UsageError("ping_url %r is not an http(s) URL" % url, hint="e.g. https://hc-ping.com/<uuid>")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._http: Any = None
        self.thread: Optional[threading.Thread] = None  # the ping under way (ping_soon)

    def ping_soon(self, kind: str, last: bool, wait: float) -> None:
        """Ping in a thread of its own, so a beat never waits on it. While the previous ping is still under way the
        next is skipped (pings are liveness: the next beat sends a fresh one), except the `last` word (success or
        /fail): that waits up to `wait` seconds for the previous one, and goes out."""
        if self.thread is not None and self.thread.is_alive():
            if not last:
                return
            self.thread.join(wait)
        self.thread = threading.Thread(target=self.ping, args=(kind,), name="onbox-ping", daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the ping under way."""
        if self.thread is not None:
            self.thread.join(timeout)

    def ping(self, kind: str) -> bool:
        """kind: "start" | "success" | "fail". True when the ping got a 2xx."""
        import requests

        if self._http is None:
            self._http = _session()
        url = self.url if kind == "success" else "%s/%s" % (self.url, kind)
        try:
            r = self._http.get(url, timeout=self.timeout)
        except requests.RequestException:
            return False
        return 200 <= r.status_code < 300

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


class Backoff:
    """Exponential backoff with full jitter: sleep uniform(0, min(cap, base * 2**n)), never less than `floor`."""

    def __init__(self, base: float = 1.0, cap: float = 60.0, floor: float = 0.05,
                 rng: Optional[random.Random] = None) -> None:
        self.base, self.cap, self.floor = base, cap, floor
        self.failures = 0
        self.rng = rng or random.Random()

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(self.failures, 30)))
        self.failures += 1
        return max(self.floor, self.rng.uniform(0, ceiling))

    def reset(self) -> None:
        self.failures = 0


class Sender:
    """Pushes one spool to one sink from a background thread, in seq order, removing beats only on success.

    One beat at a time when the spool is short; batches of up to `batch_size` when there is a backlog.
    """

    def __init__(self, sink: Any, spool: Spool, batch_size: int = 100, backoff: Optional[Backoff] = None,
                 clock: Optional[Clock] = None, on_result: Optional[Callable[[str, bool, str], None]] = None,
                 on_death: Optional[Callable[[BaseException], None]] = None,
                 on_health: Optional[Callable[[bool, Optional[str]], None]] = None, down_after: int = 3) -> None:
        self.sink = sink
        self.spool = spool
        self.batch_size = batch_size
        self.backoff = backoff or Backoff()
        self.clock = clock or SystemClock()
        self.on_result = on_result
        self.on_death = on_death  # the thread ended on an error: beats to this sink stopped (they stay spooled)
        # on_health(False, error) once `down_after` sends in a row failed, on_health(True, None) at the next
        # success: a sink that is down is said out loud (events, state.json warnings, alerts), never fatal
        self.on_health = on_health
        self.down_after = down_after
        self.failures = 0
        self.down = False
        self.rejected = 0
        self.last_error: Optional[str] = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._kick = threading.Event()  # cuts a backoff short: flush() and stop()
        self._idle = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="onbox-heartbeat-%s" % self.sink.name, daemon=True)
        self._thread.start()

    def notify(self) -> None:
        self._idle.clear()
        self._wake.set()

    def push_once(self) -> Tuple[int, bool]:
        """Try to deliver the head of the spool. Returns (beats delivered, ok)."""
        batch = self.spool.pending(self.batch_size)
        if not batch:
            return 0, True
        seqs = [s for s, _ in batch]
        docs = [d for _, d in batch]
        try:
            self.sink.send(docs)
        except Rejected as e:
            if len(batch) > 1:  # find the bad one: fall back to one at a time
                return self._push_singly(batch)
            log.warning("onbox heartbeat: %s; dropping seq %s", e, seqs[0])
            self.rejected += 1
            self.spool.ack(seqs)
            return 0, True
        except SinkError as e:
            self.last_error = str(e)
            return 0, False
        self.spool.ack(seqs)
        self.last_error = None
        return len(seqs), True

    def _push_singly(self, batch: List[Tuple[int, Dict[str, Any]]]) -> Tuple[int, bool]:
        sent = 0
        for seq, doc in batch:
            try:
                self.sink.send([doc])
            except Rejected as e:
                log.warning("onbox heartbeat: %s; dropping seq %s", e, seq)
                self.rejected += 1
            except SinkError as e:
                self.last_error = str(e)
                return sent, False
            else:
                sent += 1
            self.spool.ack([seq])
        return sent, True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # push_once's errors are caught below; this is everything else (the spool
            self.last_error = repr(e)  # dir vanished, a bug): the thread's last word, never silence
            log.exception("onbox heartbeat: the sender for %s died", self.sink.name)
            if self.on_death is not None and not self._stop.is_set():
                self.on_death(e)

    def _loop(self) -> None:
        delay = 0.0
        while not self._stop.is_set():
            if delay > 0:
                self._kick.wait(delay)  # a new beat does not cut a backoff short; a flush does
                self._kick.clear()
                if self._stop.is_set():
                    break
            try:
                sent, ok = self.push_once()
            except Exception as e:  # never let the sender die: the spool keeps everything
                log.exception("onbox heartbeat: sender error")
                sent, ok = 0, False
                self.last_error = repr(e)
            self._note(ok)
            if not ok:
                delay = self.backoff.next_delay()
                continue
            self.backoff.reset()
            delay = 0.0
            if sent == 0 or self.spool.backlog() == 0:
                self._idle.set()
                self._wake.wait()
                self._wake.clear()

    def _note(self, ok: bool) -> None:
        if ok:
            self.failures = 0
            changed, self.down = self.down, False
        else:
            self.failures += 1
            changed = not self.down and self.failures >= self.down_after
            self.down = self.down or changed
        if changed and self.on_health is not None:
            try:
                self.on_health(ok, None if ok else self.last_error)
            except Exception:  # reporting must not stop delivery
                log.exception("onbox heartbeat: reporting the health of %s failed", self.sink.name)

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) until the spool is empty; True when it is."""
        deadline = self.clock.monotonic() + timeout
        while self.spool.backlog() > 0:
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return False
            self._wake.set()
            self._kick.set()
            self.clock.sleep(min(0.02, left))
        return True

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._kick.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.sink.close()
