"""Signals and cloud notices become one PreemptionNotice(source, deadline).

Signals: SIGTERM (docker stop, Kubernetes, RunPod, systemd), SIGINT, and the scheduler's signal (USR1 by default;
NCCL catches USR1, so USR2 is allowed). Cloud notices, as each provider documents them: AWS IMDSv2 spot/instance-action (token flow),
GCP instance/preempted, Azure Scheduled Events `Preempt`. The metadata poller runs in a daemon thread so a slow or
absent metadata service never delays the loop; it wakes the loop through a pipe. Uses urllib (stdlib, cheap to
import) with proxies disabled: the metadata service is link-local and must never go through an HTTP proxy.
"""
from __future__ import annotations

import calendar
import dataclasses
import os
import select
import signal
import threading
import time
from email.utils import parsedate_tz
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from onbox import untrusted

AWS_BASE = "http://169.254.169.254"
GCP_BASE = "http://metadata.google.internal"
AZURE_BASE = "http://169.254.169.254"

AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_EVENTS_PATH = "/metadata/scheduledevents?api-version=2019-01-01"

DEFAULT_NOTICE_LEAD = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}  # seconds from notice to kill, per the providers' docs
ANSWER_MAX_BYTES = 64 * 1024  # a notice document is a few hundred bytes; more is not a notice we can read


class MalformedAnswer(ValueError):
    """The metadata service answered, but with a document that says nothing readable (not JSON, nested too deep,
    not the documented shape): no notice in it, and no reason to stop asking."""

# `onbox stop` asks the agent with this signal when it cannot write stop.request (a full or read-only disk). A
# real-time signal nothing else sends an agent, and none a run can name as its preemption signal (those are
# signal.Signals members: SIGRTMIN+2 is not). Its default action ends a process: `onbox stop` sends it only to an
# agent whose /proc status says it catches it.
STOP_SIGNAL = signal.SIGRTMIN + 2


@dataclasses.dataclass
class PreemptionNotice:
    """The one shape every warning takes. `deadline` is a monotonic time; received_at is wall time."""

    source: str  # "signal:SIGTERM", "aws", "gcp", "azure", "stop", "session_limit" (deadline.py)
    deadline: float
    received_at: float
    detail: str = ""
    # a session limit's: when the final commit must be done (monotonic), later than `deadline` (the child's KILL);
    # None: the commit keeps to `deadline` (the reserve, stop.py)
    commit_by: Optional[float] = None

    def to_dict(self, now_mono: float, now_wall: float) -> Dict[str, Any]:
        return {"source": self.source, "received_at": self.received_at, "detail": self.detail,
                "deadline": now_wall + (self.deadline - now_mono)}  # wall-clock for readers


def _opener() -> Any:
    import urllib.request

    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, headers: Dict[str, str], timeout: float) -> Tuple[Optional[int], bytes]:
    """One request; (status, body), or (None, b"") when nothing answers. Never raises for network trouble."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method, headers=headers, data=b"" if method == "PUT" else None)
    try:
        with _opener().open(req, timeout=timeout) as resp:
            return resp.status, resp.read(ANSWER_MAX_BYTES)
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (OSError, ValueError):
        return None, b""


class MetadataClient:
    """Asks one cloud's metadata service whether this instance is about to be taken away."""

    def __init__(self, provider: str, base: Optional[str] = None, timeout: float = 0.5) -> None:
        self.provider = provider
        self.base = (base or {"aws": AWS_BASE, "gcp": GCP_BASE, "azure": AZURE_BASE}[provider]).rstrip("/")
        self.timeout = timeout
        self._token: Optional[str] = None  # AWS IMDSv2 session token (valid for its TTL)

    def available(self) -> bool:
        """True when this provider's metadata service answers (detection for notice_source=auto)."""
        if self.provider == "aws":
            self._token = self._aws_token()
            return self._token is not None
        if self.provider == "gcp":
            status, _ = http("GET", self.base + GCP_PREEMPTED_PATH, {"Metadata-Flavor": "Google"}, self.timeout)
            return status == 200
        status, _ = http("GET", self.base + AZURE_EVENTS_PATH, {"Metadata": "true"}, self.timeout)
        return status == 200

    def _aws_token(self) -> Optional[str]:
        status, body = http("PUT", self.base + AWS_TOKEN_PATH,
                            {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, self.timeout)
        return body.decode("ascii", "replace").strip() if status == 200 and body else None

    def check(self, now_wall: float) -> Optional[Tuple[float, str]]:
        """(seconds until the instance goes, detail) when a notice is out, else None."""
        if self.provider == "aws":
            token = self._token or self._aws_token()
            if token is None:
                return None
            status, body = http("GET", self.base + AWS_ACTION_PATH, {"X-aws-ec2-metadata-token": token},
                                self.timeout)
            self._token = token if status != 401 else None  # reuse the token until it expires (401)
            if status != 200:  # 404: no action scheduled
                return None
            # 200 is the notice itself (the item exists only once an action is scheduled): a document we cannot
            # read (garbage, nested 100,000 deep) still means "going away", at the documented lead
            try:
                doc = untrusted.loads_json(body, "aws spot instance-action")
                when = calendar.timegm(time.strptime(doc["time"], "%Y-%m-%dT%H:%M:%SZ"))
                return max(0.0, when - now_wall), "aws spot %s at %s" % (doc.get("action"), doc["time"])
            except (ValueError, KeyError, TypeError) as e:
                return DEFAULT_NOTICE_LEAD["aws"], "aws spot instance-action (its time unreadable: %s)" % (
                    untrusted.reason(e) if isinstance(e, ValueError) else "no usable time in it")
        if self.provider == "gcp":
            status, body = http("GET", self.base + GCP_PREEMPTED_PATH, {"Metadata-Flavor": "Google"}, self.timeout)
            if status == 200 and body.strip().upper() == b"TRUE":
                return DEFAULT_NOTICE_LEAD["gcp"], "gcp instance preempted"
            return None
        status, body = http("GET", self.base + AZURE_EVENTS_PATH, {"Metadata": "true"}, self.timeout)
        if status != 200:
            return None
        try:  # a deep document must not end the poller in a RecursionError (loads_json bounds the nesting)
            doc = untrusted.loads_json(body, "azure scheduled events")
        except ValueError as e:
            raise MalformedAnswer("azure scheduled events answer unreadable: %s" % untrusted.reason(e))
        if not isinstance(doc, dict) or not isinstance(doc.get("Events") or [], list):
            raise MalformedAnswer("azure scheduled events answer unreadable: not an object with an Events list")
        for ev in doc.get("Events") or []:
            if isinstance(ev, dict) and ev.get("EventType") == "Preempt":
                lead = DEFAULT_NOTICE_LEAD["azure"]
                parsed = parsedate_tz(str(ev.get("NotBefore") or ""))
                if parsed:
                    lead = max(0.0, calendar.timegm(parsed[:9]) - (parsed[9] or 0) - now_wall)
                return lead, "azure Preempt event %s" % ev.get("EventId", "")
        return None


class MetadataPoller:
    """A daemon thread polling the metadata service; on a notice it calls `on_notice(lead_s, source, detail)`.

    notice_source=auto probes aws, gcp and azure once with a short timeout and stays silent (and stops) when
    none answers: absent metadata costs one probe round in the background, nothing in the loop.

    A poll that raises (the service answers something that is not HTTP) is retried; after MAX_POLL_ERRORS in a
    row the thread ends and `on_death(error)` says so: notices are off, and the supervisor turns that into an
    event, an alert and a status line instead of silence. An answer the client cannot read (MalformedAnswer: not
    JSON, nested 100,000 deep) is no notice and no reason to stop: it is logged once, and polling goes on (a real
    notice may come next; a spoofed or broken service must not switch notices off).
    """

    MAX_POLL_ERRORS = 3

    def __init__(self, source: str, base: Optional[str], interval: float,
                 on_notice: Callable[[float, str, str], None], timeout: float = 0.5,
                 log: Optional[Callable[[str], None]] = None,
                 on_death: Optional[Callable[[BaseException], None]] = None) -> None:
        self.source = source
        self.base = base
        self.interval = interval
        self.on_notice = on_notice
        self.timeout = timeout
        self.log = log or (lambda _m: None)
        self.on_death = on_death
        self.died: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.provider: Optional[str] = None

    def start(self) -> None:
        if self.source == "none":
            return
        self._thread = threading.Thread(target=self._run, name="onbox-metadata", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _detect(self) -> Optional[MetadataClient]:
        providers = ["aws", "gcp", "azure"] if self.source == "auto" else [self.source]
        for p in providers:
            client = MetadataClient(p, self.base, self.timeout)
            if self.source != "auto":
                return client
            try:
                found = client.available()
            except Exception as e:  # probing: something that answers garbage is not this provider's service
                self.log("%s metadata probe failed: %r" % (p, e))
                found = False
            if found:
                return client
        return None

    def _run(self) -> None:
        try:
            self._poll()
        except BaseException as e:  # the thread's last word: never end silently
            self.died = e
            if self.on_death is not None and not self._stop.is_set():
                self.on_death(e)

    def _poll(self) -> None:
        client = self._detect()
        if client is None:
            self.log("no cloud metadata service answered; cloud preemption notices are off")
            return
        self.provider = client.provider
        self.log("polling %s metadata for preemption notices every %.1f s" % (client.provider, self.interval))
        errors = 0
        malformed = False  # logged once per run of unreadable answers, not once a poll
        while not self._stop.is_set():
            try:
                found = client.check(time.time())
            except MalformedAnswer as e:
                errors = 0
                if not malformed:
                    self.log("%s; no notice in it, polling on (said once until a readable answer)" % e)
                malformed = True
                self._stop.wait(self.interval)
                continue
            except Exception as e:
                errors += 1
                self.log("metadata poll %d/%d failed: %r" % (errors, self.MAX_POLL_ERRORS, e))
                if errors >= self.MAX_POLL_ERRORS:
                    raise
                self._stop.wait(self.interval)
                continue
            errors, malformed = 0, False
            if found is not None:
                self.on_notice(found[0], client.provider, found[1])
                return
            self._stop.wait(self.interval)


class NoticePipe:
    """Hands notices from the poller thread to the loop: a queue plus a pipe the loop's select() watches."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._lock = threading.Lock()
        self._items: list = []
        self._closed = False

    def put(self, item: Any) -> None:
        with self._lock:  # under the lock: after close() the fd number may belong to another file
            if self._closed:
                return
            self._items.append(item)
            try:
                os.write(self.write_fd, b"n")
            except (BlockingIOError, OSError):
                pass

    def drain(self) -> list:
        try:
            while os.read(self.read_fd, 512):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            items, self._items = self._items, []
        return items

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self.read_fd, self.write_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass


class SignalInbox:
    """Signal handlers that only record; the loop takes what arrived and acts.

    The handlers share a wakeup fd (signal.set_wakeup_fd) that `wait()` selects on, so a signal ends the wait at
    once (milliseconds) while an idle wait costs nothing: no polling.
    """

    def __init__(self, signals: Iterable[int]) -> None:
        self.signals = sorted(set(int(s) for s in signals))
        self.pending: List[int] = []
        self._old: Dict[int, Any] = {}
        self._old_wakeup = -1
        self._r = self._w = -1

    def record(self, signum: int, _frame: Any = None) -> None:
        self.pending.append(signum)

    def take(self) -> List[int]:
        items, self.pending = self.pending, []
        return items

    def install(self) -> None:
        """Must run in the main thread."""
        self._r, self._w = os.pipe()
        for fd in (self._r, self._w):
            os.set_blocking(fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        for s in self.signals:
            self._old[s] = signal.signal(s, self.record)

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._old = {}
        signal.set_wakeup_fd(self._old_wakeup)
        for fd in (self._r, self._w):
            if fd >= 0:
                os.close(fd)
        self._r = self._w = -1

    def wait(self, timeout: float, other_fds: Sequence[int] = ()) -> None:
        """Block until a signal arrives, one of `other_fds` is readable, or `timeout` seconds pass."""
        if timeout <= 0 or self.pending:
            return
        ready, _, _ = select.select([self._r, *other_fds], [], [], timeout)
        if self._r in ready:
            try:
                while os.read(self._r, 512):
                    pass
            except (BlockingIOError, OSError):
                pass
