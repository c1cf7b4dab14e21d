"""The tracker's half of the bad-input sweep: every row is sent to a real `onboxctl tracker serve` process.

Each row: a request (method, path, body, the Host it names, with or without the token), the status it must get and
a piece of its one-line `{"error": ...}`. For every row: that status; that piece; the tracker still serves; its run
list still reads, through the controller's own reader (controller/tracker/runview.py), with the good run and its newest
beat in it; a refused beat stored nothing. Rows with status 200 are the false positives: the legitimate request
beside each refusal (a beat at the bound, an agent through an ssh tunnel, a name given with --allowed-host).

Then what one bad beat used to do to the whole controller (issue 30, item 2), a row planted by an older tracker,
and text from beats that `onboxctl status` prints (item 11).
"""
from __future__ import annotations

import http.server
import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
from typing import Any, Dict, NamedTuple, Optional

import pytest
import requests

from controller.tracker.runview import read_tracker
from tests.conftest import subprocess_env
from tests.hosts.tracker import TrackerProcess

pytestmark = pytest.mark.integration

ALLOWED = ["tracker.example", "Trusted.Example."]


def beat(seq: int, run: str = "good", **extra: Any) -> Dict[str, Any]:
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": "b", "attempt": 0, "seq": seq, "time": 1.9e9 + seq,
           "state": "running", "interval_s": 30.0, "progress": {"step": seq, "loss": 2.0}}
    doc.update(extra)
    return doc


def nest(levels: int) -> Any:
    """A value that nests `levels` levels deep ({"x": {"x": ... {}}})."""
    doc: Dict[str, Any] = {}
    for _ in range(levels - 1):
        doc = {"x": doc}
    return doc


def beats(*docs: Dict[str, Any]) -> bytes:
    return json.dumps({"heartbeats": list(docs)}).encode()


class Row(NamedTuple):
    id: str
    method: str
    path: str
    code: int
    says: str
    body: Optional[bytes] = None
    host: Optional[str] = None  # the Host header (PORT: the tracker's port); None: what requests sends
    token: bool = True
    headers: Dict[str, str] = {}
    stored: Optional[str] = None  # a run this request must (200) or must not (4xx) have stored


def R(id, method, path, code, says, body=None, host=None, token=True, headers=None, stored=None):
    return Row(id, method, path, code, says, body, host, token, dict(headers or {}), stored)


BEATS = "/api/v1/heartbeats"
RUNS = "/api/v1/runs"
FOREIGN = "refused: this tracker answers only"

ROWS = [
    # -- item 2: a beat the readers could not read is refused at the door, naming the beat and the problem
    R("beat-unknown-key-100-deep", "POST", BEATS, 400, "heartbeats[0] (run 'deep', seq 3): extra nests 101 levels",
      body=beats(beat(3, run="deep", extra=nest(100))), stored="deep"),
    R("beat-unknown-key-64-deep", "POST", BEATS, 400, "nests 65 levels deep, more than 64",
      body=beats(beat(3, run="deep64", extra=nest(64))), stored="deep64"),
    R("beat-section-deep", "POST", BEATS, 400, "preemption nests",
      body=beats(beat(3, run="deeppre", preemption=nest(80))), stored="deeppre"),
    R("beat-alert-data-deep", "POST", BEATS, 400, "alerts nests",
      body=beats(beat(3, run="deepalert", alerts=[{"code": "x", "data": nest(70)}])), stored="deepalert"),
    R("beat-second-of-batch-deep", "POST", BEATS, 400, "heartbeats[1] (run 'deep2', seq 4)",
      body=beats(beat(4, run="batchmate"), beat(4, run="deep2", x=[nest(99)])), stored="batchmate"),
    R("beat-unknown-keys-large", "POST", BEATS, 400, "keys the schema does not name (extra) hold 70.0 KiB",
      body=beats(beat(3, run="big", extra="x" * 71680)), stored="big"),
    R("beat-unknown-keys-many", "POST", BEATS, 400, "keys the schema does not name (k0, k1, k2, ...)",
      body=beats(beat(3, run="many", **{"k%d" % i: "v" * 40 for i in range(2000)})), stored="many"),
    R("event-deep", "POST", "/api/v1/events", 400, "events[0]: data nests",
      body=json.dumps({"events": [{"run": "good", "time": 1.9e9, "kind": "detected", "data": nest(100)}]}).encode()),
    # ... and what must still pass: a beat at the bound, unknown keys within theirs
    R("beat-at-the-depth-bound", "POST", BEATS, 200, '"accepted":1',
      body=beats(beat(3, run="deep63", extra=nest(63))), stored="deep63"),
    R("beat-unknown-keys-within", "POST", BEATS, 200, '"accepted":1',
      body=beats(beat(3, run="unknownok", extra="x" * 60000, future={"a": [1, 2, {"b": None}]})),
      stored="unknownok"),
    # -- item 8: a Host that is none of the tracker's names (DNS rebinding) is refused, whoever asks
    R("host-foreign-public-read", "GET", RUNS, 421, FOREIGN, host="evil.example:PORT", token=False),
    R("host-foreign-with-token", "GET", RUNS, 421, "--allowed-host evil.example", host="evil.example:PORT"),
    R("host-foreign-dashboard", "GET", "/", 421, FOREIGN, host="evil.example:PORT", token=False),
    R("host-foreign-overview", "GET", "/api/v1/overview", 421, FOREIGN, host="evil.example", token=False),
    R("host-foreign-healthz", "GET", "/healthz", 421, FOREIGN, host="evil.example:PORT", token=False),
    R("host-foreign-login", "POST", "/login", 421, FOREIGN, host="evil.example:PORT", token=False,
      body=b"token=x&next=/", headers={"Content-Type": "application/x-www-form-urlencoded"}),
    R("host-foreign-beat", "POST", BEATS, 421, FOREIGN, host="evil.example:PORT",
      body=beats(beat(3, run="rebound")), stored="rebound"),
    R("host-localhost-suffix", "GET", RUNS, 421, "with --allowed-host localhost.evil.example", host="localhost.evil.example:PORT"),
    R("host-forwarded-host", "GET", RUNS, 421, "'evil.example'", host="evil.example",
      headers={"X-Forwarded-Host": "127.0.0.1", "X-Forwarded-For": "127.0.0.1", "X-Forwarded-Proto": "https"}),
    R("host-empty", "GET", RUNS, 421, "an empty Host", host=""),
    R("host-port-only", "GET", RUNS, 421, "':8787'", host=":8787"),
    R("host-bracket", "GET", RUNS, 421, "'[::1'", host="[::1"),
    # ... and what must still pass: an agent through its ssh tunnel (another port), the loopback names, an address
    # (no DNS name, so nothing to rebind), the names given with --allowed-host (any case, a final dot)
    R("host-tunnel-port", "POST", BEATS, 200, '"accepted":1', host="127.0.0.1:40000", body=beats(beat(3, run="tun")),
      stored="tun"),
    R("host-loopback", "GET", RUNS, 200, '"runs"', host="127.0.0.1:PORT"),
    R("host-localhost", "GET", RUNS, 200, '"runs"', host="localhost:PORT", token=False),
    R("host-ipv6-loopback", "GET", RUNS, 200, '"runs"', host="[::1]:40000"),
    R("host-address", "GET", RUNS, 200, '"runs"', host="10.1.2.3:8787"),
    R("host-allowed", "GET", RUNS, 200, '"runs"', host="tracker.example:PORT", token=False),
    R("host-allowed-case-dot", "GET", "/healthz", 200, '"ok"', host="TRUSTED.example:443"),
    R("host-dashboard", "GET", "/", 200, "<html", host="localhost:PORT", token=False),
]


@pytest.fixture(scope="module")
def public_tracker(tmp_path_factory):
    """One tracker for the table: --public-read (the surface of item 8) and two --allowed-host names."""
    extra = [a for name in ALLOWED for a in ("--allowed-host", name)]
    t = TrackerProcess(str(tmp_path_factory.mktemp("tracker")), public_read=True, extra_args=extra)
    t.start()
    try:
        assert t.post([beat(1)]).status_code == 200, t.log()
        yield t
    finally:
        t.stop()


def stored_runs(t: TrackerProcess) -> Dict[str, Any]:
    return {r["run"]: r for r in t.runs()}


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_request_is_one_clear_4xx_and_the_list_stays_readable(public_tracker, row):
    t = public_tracker
    headers = dict(row.headers)
    if row.token:
        headers.update(t.headers())
    if row.body is not None:
        headers.setdefault("Content-Type", "application/json")
    if row.host is not None:
        headers["Host"] = row.host.replace("PORT", str(t.port))
    r = requests.request(row.method, t.url + row.path, data=row.body, headers=headers, timeout=30,
                         allow_redirects=False)
    assert r.status_code == row.code, (r.status_code, r.text[:500])
    assert row.says in r.text, r.text[:500]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert "\n" not in error and row.says in error
    assert "Traceback" not in t.log()
    # the list still reads, through the controller's own reader, and the good run is in it with its newest beat
    view = read_tracker(t.url, t.token)
    assert view.problem is None, view.problem
    good = {e["run"]: e for e in view.runs}["good"]
    assert good["latest"]["seq"] == 1 and view.skipped == []
    if row.stored:
        assert (row.stored in stored_runs(t)) == (row.code == 200), row.stored


@pytest.mark.parametrize("value,says", [
    ("", "--allowed-host '' is not a host name"),
    ("http://tracker.example", "without a scheme"),
    ("tracker.example:8787", "without a port"),
    ("a b", "is not a host name"),
    ("evil\x1b]0;x\x07", "is not a host name"),
    ("*", "is not a host name"),
])
def test_a_bad_allowed_host_is_one_line_exit_2_before_anything_is_made(tmp_path, value, says):
    db = str(tmp_path / "t" / "t.db")
    r = subprocess.run([sys.executable, "-m", "controller", "tracker", "serve", "--port", "0", "--db", db,
                        "--allowed-host", value], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr and "\x1b" not in r.stderr, r.stderr
    assert not os.path.exists(os.path.dirname(db))


# -- item 2: what one bad beat did to every reader ---------------------------------------------------------------
def status(t_url: str, token_file: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", "status", *args, "--tracker", t_url,
                           "--tracker-token-file", token_file], env=subprocess_env({"COLUMNS": "200"}),
                          capture_output=True, text=True, timeout=60)


def _plant(db: str, run: str, doc_text: str, seq: int = 7) -> None:
    """What an older tracker left: a row it accepted then, written straight into SQLite."""
    con = sqlite3.connect(db)
    with con:
        con.execute("INSERT INTO beats (run, attempt, seq, time, received, state, doc) VALUES (?,?,?,?,?,?,?)",
                    (run, 0, seq, 1.9e9, 1.9e9, "running", doc_text))
        con.execute("INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?)",
                    (run, "b", 0, seq, 1.9e9, 1.9e9, 30.0, "running"))
    con.close()


def test_a_deep_row_stored_by_an_older_tracker_marks_its_run_and_every_other_run_reads(tmp_path):
    t = TrackerProcess(str(tmp_path / "tr")).start()
    try:
        assert t.post([beat(1), beat(1, run="other")]).status_code == 200
    finally:
        t.stop()
    _plant(t.db, "poisoned", json.dumps(beat(7, run="poisoned", extra=nest(100))))
    t.start()
    try:
        r = requests.get(t.url + RUNS, headers=t.headers(), timeout=10)
        assert r.status_code == 200
        runs = {x["run"]: x for x in r.json()["runs"]}
        assert set(runs) == {"good", "other", "poisoned"}
        assert runs["poisoned"]["latest"] is None and runs["poisoned"]["liveness"] in ("ok", "late", "silent")
        assert "nests more than 64 levels deep" in runs["poisoned"]["problem"]
        assert runs["good"]["latest"]["seq"] == 1 and "problem" not in runs["good"]

        res = status(t.url, t.token_file)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert any(line.split()[:2] == ["b", "good"] for line in lines), res.stdout
        assert any(line.split()[:2] == ["b", "other"] for line in lines), res.stdout
        assert any("poisoned" in line and "nests more than 64 levels deep" in line for line in lines), res.stdout
        doc = json.loads(status(t.url, t.token_file, "--json").stdout)
        assert {x["run"] for x in doc["runs"]} >= {"good", "other"}
        assert [s["run"] for s in doc["skipped"]] == ["poisoned"]
    finally:
        t.stop()


class _OldTracker(http.server.BaseHTTPRequestHandler):
    """What a tracker from before the bound answers: its run list with a beat nested 100 deep in it."""
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def old_tracker():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OldTracker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "http://127.0.0.1:%d" % server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_reader_skips_the_deep_run_of_an_older_tracker_and_shows_the_rest(tmp_path, old_tracker):
    entry = {"run": "good", "box": "b", "attempt": 0, "seq": 1, "state": "running", "age_s": 3.0, "liveness": "ok",
             "latest": beat(1)}
    _OldTracker.body = json.dumps({"runs": [
        entry, dict(entry, run="deep", latest=beat(2, run="deep", extra=nest(100))),
        dict(entry, run="deeper", latest=beat(2, run="deeper", extra=nest(900))), "not an entry",
        dict(entry, run="../x")], "skipped_rows": 0}).encode()
    token = tmp_path / "tok"
    token.write_text("t\n")
    res = status(old_tracker, str(token))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    lines = res.stdout.splitlines()
    assert any(line.split()[:4] == ["b", "good", "running", "0"] for line in lines), res.stdout
    for what in ("run 'deep': its newest beat nests more than 64 levels deep",
                 "run 'deeper': its newest beat nests more than 64 levels deep",
                 "runs[3]: not an object", "runs[4]: '../x' is not a run name"):
        assert any(what in line for line in lines), (what, res.stdout)
    view = read_tracker(old_tracker, "t")
    assert view.problem is None
    assert [e["run"] for e in view.runs] == ["good", "deep", "deeper"]  # a deep beat's run stays, without it
    assert [e["latest"] for e in view.runs[1:]] == [None, None]
    assert [(s.run, s.shown) for s in view.skipped] == [("deep", True), ("deeper", True), ("runs[3]", False),
                                                         ("runs[4]", False)]


def test_an_unreadable_tracker_is_told_apart_from_an_answer(tmp_path, old_tracker):
    _OldTracker.body = b'{"runs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    view = read_tracker(old_tracker, "t")
    assert view.problem is not None and view.runs == [] and not view.answered
    assert "nests more than 64 levels deep" in view.problem.message
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = "http://127.0.0.1:%d" % s.getsockname()[1]
    view = read_tracker(closed, "t")
    assert view.problem is not None and "cannot read the tracker" in view.problem.message
    _OldTracker.body = b'{"runs": []}'
    view = read_tracker(old_tracker, "t")
    assert view.answered and view.runs == [] and view.skipped == []


# -- item 11: text that arrived in beats is printed with its control characters shown, never obeyed ---------------
def test_status_shows_escapes_in_box_state_and_alert_text_from_beats(tracker):
    t = tracker
    evil = beat(1, run="esc", box="gpu1\x1b]0;PWNED\x07", state="running\x1b[2J",
                alerts=[{"code": "nan\x1b[1A\rloss", "message": "m"}],
                checkpoint={"latest_durable": {"name": "ck\nFORGED LINE", "step": 1}})
    assert t.post([evil]).status_code == 200, t.log()
    res = status(t.url, t.token_file)
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout and "\r" not in res.stdout
    assert "gpu1\\x1b]0;PWNED\\x07" in res.stdout and "running\\x1b[2J" in res.stdout
    assert "nan\\x1b[1A\\x0dloss" in res.stdout and "ck\\x0aFORGED LINE" in res.stdout
    assert not any(line.startswith("FORGED") for line in res.stdout.splitlines())
