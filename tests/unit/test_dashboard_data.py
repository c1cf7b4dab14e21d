"""The dashboard's data, in-process on a real SQLite store with a moved clock: the run list's rows and cursors
(controller/tracker/overview.py), a run's curves and events (series.py), what the tracker knows of a pull
(pulled.py), the session cookie (session.py), and an older database getting the new columns."""
from __future__ import annotations

import json
import math
import sqlite3

from controller.tracker.overview import Overview
from controller.tracker.pulled import PullsView
from controller.tracker.runview import LIVENESS_MARK, row_from_heartbeat
from controller.tracker.series import _read_sql, series_body
from controller.tracker.series import read_series as _read_series
from controller.tracker.session import Auth, same_origin
from controller.tracker.store import Store, liveness


def read_series(st, run, after=-1, limit=5000):
    """Both paths (SQLite's and Python's) must give one answer; the points parsed from their JSON."""
    sql, py = (_read_series(st, run, after, limit, python=python) for python in (False, True))
    a, b = json.loads(sql.pop("points_json")), json.loads(py.pop("points_json"))
    assert sql == py and a.keys() == b.keys()
    for col in a:
        assert len(a[col]) == len(b[col]) and all(
            x == y or (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-14)) for x, y in zip(a[col], b[col])), col
    return dict(py, points=b)


class Now:
    def __init__(self, t: float = 10000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def beat(seq, run="r1", box="gpu1", attempt=0, state="running", step=None, loss=None, ckpt=None, interval=1.0,
         **extra):
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": box, "attempt": attempt, "seq": seq,
           "time": 5000.0 + seq, "state": state, "interval_s": interval,
           "progress": {"step": seq * 10 if step is None else step, "loss": 2.0 / (1 + seq) if loss is None else loss,
                        "lr": 3e-4, "tokens_per_s": 1000.0 + seq},
           "gpus": {"available": True, "gpus": [
               {"index": 0, "util_percent": 90.0, "memory_used_bytes": 10 << 30, "memory_total_bytes": 80 << 30},
               {"index": 1, "util_percent": 70.0, "memory_used_bytes": 6 << 30, "memory_total_bytes": 80 << 30}]}}
    if ckpt:
        doc["checkpoint"] = {"latest_durable": {"name": ckpt, "step": 100, "digest": "sha256:" + ckpt},
                             "verified": True, "last_sync": {"ok": True, "error": None, "at": 4999.0}}
    doc.update(extra)
    return doc


def test_series_has_every_point_as_columns_and_the_events_between_them(tmp_path):
    st = Store(str(tmp_path / "t.db"), now=Now())
    beats = [beat(0), beat(1), beat(2, ckpt="c-20"), beat(3, attempt=1, ckpt="c-20"),
             beat(4, attempt=2, box="gpu2", ckpt="c-20"), beat(5, attempt=2, box="gpu2", ckpt="c-40"),
             beat(6, attempt=2, box="gpu2", state="preempted", ckpt="c-40"),
             beat(7, attempt=3, box="gpu2", state="failed", ckpt="c-40")]
    for i in (5, 0, 7, 2, 1, 6, 3, 4):  # stored out of order (a spool's backlog): the curve is in seq order
        st.add([beats[i], beat(i, run="other")])
    assert _read_sql(st, "r1", -1, 5000) is not None  # SQLite's path is the one taken here
    d = read_series(st, "r1")
    p = d["points"]
    assert p["seq"] == list(range(8)) and p["step"] == [i * 10 for i in range(8)]
    assert p["loss"] == [2.0 / (1 + i) for i in range(8)] and p["lr"] == [3e-4] * 8
    assert p["gpu_util"] == [80.0] * 8 and p["gpu_mem"] == [float(16 << 30)] * 8  # mean %, bytes summed
    assert p["attempt"] == [0, 0, 0, 1, 2, 2, 2, 3] and p["time"] == [5000.0 + i for i in range(8)]
    assert [(e["seq"], e["kind"], e["text"]) for e in d["events"]] == [
        (2, "commit", "c-20"), (3, "restart", "attempt 1"), (4, "restart", "attempt 2 on gpu2"),
        (4, "box", "now on gpu2 (was gpu1)"), (5, "commit", "c-40"), (6, "preempted", "preempted on gpu2"),
        (7, "restart", "attempt 3"), (7, "failed", "failed")]
    assert d["next_after"] == 7 and d["more"] is False

    # paged: the beat at the cursor is compared with the first new one, so no event falls between pages
    first = read_series(st, "r1", after=-1, limit=4)
    assert first["more"] is True and first["next_after"] == 3
    rest = read_series(st, "r1", after=first["next_after"], limit=100)
    assert first["points"]["seq"] + rest["points"]["seq"] == list(range(8))
    assert first["events"] + rest["events"] == d["events"]
    assert read_series(st, "r1", after=7)["points"]["seq"] == []
    assert read_series(st, "nobody")["points"]["seq"] == []


def test_a_nan_loss_is_a_gap_and_a_bad_row_is_skipped_not_fatal(tmp_path):
    st = Store(str(tmp_path / "t.db"), now=Now())
    st.add([beat(0), beat(1, loss="NaN"), beat(2)])
    st._db.execute("UPDATE beats SET attempt='x' WHERE seq=2")  # a row this store would never write
    d = read_series(st, "r1")
    assert d["points"]["seq"] == [0, 1] and d["points"]["loss"] == [2.0, None]
    assert d["skipped_rows"] == 1 and d["next_after"] == 2  # the cursor moves past it


def test_an_older_database_gets_the_new_columns_and_its_rows_still_draw(tmp_path):
    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE beats (id INTEGER PRIMARY KEY, run TEXT NOT NULL, attempt INTEGER NOT NULL, seq INTEGER NOT NULL,
            time REAL, received REAL NOT NULL, state TEXT, step INTEGER, loss REAL, eval_loss REAL, lr REAL,
            tokens_per_s REAL, samples_per_s REAL, doc TEXT);
        CREATE UNIQUE INDEX beats_key ON beats (run, seq, attempt);
        CREATE TABLE runs (run TEXT PRIMARY KEY, box TEXT, attempt INTEGER, seq INTEGER, time REAL, received REAL,
            interval_s REAL, state TEXT);""")
    old = beat(0, ckpt="c-0")
    db.execute("INSERT INTO beats (run, attempt, seq, time, received, state, step, loss, doc) VALUES "
               "('r1', 0, 0, 5000.0, 9999.0, 'running', 0, 2.0, ?)", (json.dumps(old),))
    db.execute("INSERT INTO runs VALUES ('r1', 'gpu1', 0, 0, 5000.0, 9999.0, 1.0, 'running')")
    db.commit()
    db.close()
    st = Store(path, now=Now())
    cols = {r[1] for r in st.query("PRAGMA table_info(beats)")}
    assert {"box", "gpu_util", "gpu_mem", "ckpt"} <= cols
    st.add([beat(1, box="gpu2", ckpt="c-10")])
    assert _read_sql(st, "r1", -1, 5000) is None  # the old row needs its document: Python's path
    d = read_series(st, "r1")
    assert d["points"]["gpu_util"] == [80.0, 80.0]  # the old row's from its document, the new one's column
    assert [(e["kind"], e["text"]) for e in d["events"]] == [("box", "now on gpu2 (was gpu1)"), ("commit", "c-10")]


def test_overview_sends_only_the_runs_with_new_beats_and_every_runs_liveness(tmp_path):
    now = Now()
    st = Store(str(tmp_path / "t.db"), now=now)
    ov = Overview(st, PullsView(None))
    st.add([beat(0, run="a"), beat(0, run="b", interval=10.0, alerts=[
        {"code": "stall", "severity": "warning", "message": "no output for 30 min", "hint": "look at the log"}],
        log_tail=["step 1", "step 2"])])
    full = ov.overview(-1)
    assert full["full"] is True and [r["run"] for r in full["runs"]] == ["a", "b"]
    b = full["runs"][1]
    assert b["alerts"] == [{"code": "stall", "severity": "warning", "message": "no output for 30 min",
                            "hint": "look at the log"}]
    assert "log_tail" not in b and b["has_log"] is True  # the list never carries logs
    # the same row as `onboxctl status --json`, field for field
    want = row_from_heartbeat(st.heartbeats("b")[-1], box="gpu1", run="b", liveness="ok", age_s=0.0).to_dict()
    assert {k: b[k] for k in want if k not in ("alerts", "age_s")} == {k: v for k, v in want.items()
                                                                     if k not in ("alerts", "age_s")}
    assert b["gpu_util"] == 80.0 and b["gpu_mem_used"] == 16 << 30 and b["step"] == 0

    quiet = ov.overview(full["cursor"])
    assert quiet["runs"] == [] and set(quiet["live"]) == {"a", "b"} and quiet["cursor"] == full["cursor"]
    st.add([beat(1, run="a")])
    now.t += 3.0  # a: fresh; b: 3 s of a 10 s interval
    one = ov.overview(quiet["cursor"])
    assert [r["run"] for r in one["runs"]] == ["a"] and one["runs"][0]["seq"] == 1
    now.t += 30.0  # 33 s: a (1 s interval) SILENT, b (10 s) LATE: the rules of `onboxctl status`
    live = ov.overview(one["cursor"])["live"]
    for name, interval in (("a", 1.0), ("b", 10.0)):
        lv = liveness("running", live[name]["received"], interval, now.t)
        assert live[name]["liveness"] == lv and live[name]["mark"] == LIVENESS_MARK.get(lv)
    assert (live["a"]["mark"], live["b"]["mark"]) == ("SILENT", "LATE")
    assert ov.overview(10**9)["full"] is True  # a cursor from another database: everything again
    run = ov.run("b")
    assert run["log_tail"] == ["step 1", "step 2"] and run["liveness"] == "late" and ov.run("nobody") is None


def test_pulled_and_verified_only_with_the_same_digest_as_the_box(tmp_path):
    record = tmp_path / "pulls.json"
    local = tmp_path / "home" / "r1" / "checkpoints"

    def pulled(name, ok=True, digest=None, error=None):
        d = local / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "MANIFEST.json").write_text(json.dumps({"name": name, "digest": digest or "sha256:" + name}))
        return {"name": name, "ok": ok, "path": str(d), "verified_at": 4000.0, "error": error}

    view = PullsView(str(record))
    durable = {"name": "c-40", "step": 40, "digest": "sha256:c-40"}
    view.refresh()
    assert view.verdict("gpu1", "r1", durable)["status"] == "not_pulled"
    assert view.verdict("gpu1", "r1", None)["status"] == "no_checkpoint"

    def write(checkpoints):
        record.write_text(json.dumps({"pulls": {"gpu1/r1": {"box": "gpu1", "run": "r1", "checkpoints": checkpoints}}}))
        view.refresh()
        return view.verdict("gpu1", "r1", durable)

    assert write({"c-20": pulled("c-20")})["status"] == "older"
    v = write({"c-40": pulled("c-40")})
    assert v["status"] == "verified" and "same digest" in v["text"]
    assert write({"c-40": pulled("c-40", digest="sha256:re-committed")})["status"] == "stale"
    assert write({"c-40": pulled("c-40", ok=False, error="sha256 mismatch in model.pt")})["text"].endswith(
        "sha256 mismatch in model.pt")
    (local / "c-40" / "MANIFEST.json").unlink()
    assert write({"c-40": {"name": "c-40", "ok": True, "path": str(local / "c-40")}})["status"] == "stale"
    assert view.verdict("gpu9", "r1", durable)["status"] == "not_pulled"  # another box's run of that name
    record.write_text("{not json")
    view.refresh()
    assert view.verdict("gpu1", "r1", durable)["status"] == "unknown"
    assert PullsView(None).verdict("gpu1", "r1", durable)["status"] == "unknown"


class FakeRequest:
    def __init__(self, cookie=None, bearer=None, origin=None, scheme="http", host="127.0.0.1:8787"):
        from starlette.datastructures import URL

        self.cookies = {"onbox_session_8787": cookie} if cookie else {}
        self.headers = {"host": host}
        if bearer:
            self.headers["authorization"] = "Bearer " + bearer
        if origin:
            self.headers["origin"] = origin
        self.url = URL("%s://%s/" % (scheme, host))


def test_the_session_cookie_reads_never_writes_and_dies_with_time_or_a_new_token():
    now = Now(1000.0)
    auth = Auth("s3cret", now=now, max_age=100)
    set_cookie = auth.cookie(FakeRequest())
    value = set_cookie.split(";")[0].split("=", 1)[1]
    assert "s3cret" not in set_cookie and "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
    assert "Secure" not in set_cookie and "Secure" in auth.cookie(FakeRequest(scheme="https"))
    r = FakeRequest(cookie=value)
    assert auth.can_read(r) and not auth.can_write(r)  # a cookie never writes (no CSRF through it)
    assert auth.can_write(FakeRequest(bearer="s3cret")) and not auth.can_write(FakeRequest(bearer="wrong"))
    expiry, mac = value.split(".")
    assert not auth.can_read(FakeRequest(cookie="%d.%s" % (int(expiry) + 1000, mac)))  # a longer life: forged
    assert not Auth("another", now=now).can_read(r)  # a new token logs every page out
    now.t += 60
    assert auth.needs_renewal(r)
    now.t += 41
    assert not auth.can_read(r)
    assert Auth("s3cret", public_read=True, now=now).can_read(FakeRequest())
    assert same_origin(FakeRequest()) and same_origin(FakeRequest(origin="http://127.0.0.1:8787"))
    assert not same_origin(FakeRequest(origin="http://evil.example"))
    assert not same_origin(FakeRequest(origin="null"))
    assert not auth.can_read(FakeRequest(cookie=value, host="127.0.0.1:8788"))  # another tracker's port


def test_a_cookie_with_a_digit_that_int_does_not_take_is_no_login_not_an_error():
    # str.isdigit() is true for "²" (a Latin-1 byte a browser or curl can send); int("²") raises: that was a 500
    # on every read endpoint for a request carrying it
    auth = Auth("s3cret", now=Now(1000.0))
    for expiry in ("\u00b2", "9\u00b3", "\u00b9" * 5):
        assert auth.session_expiry(FakeRequest(cookie="%s.%s" % (expiry, "0" * 64))) is None
        assert not auth.can_read(FakeRequest(cookie="%s.%s" % (expiry, "0" * 64)))


def test_a_diverged_loss_infinity_is_sent_as_a_string_and_the_list_stays_up(tmp_path):
    # the agent writes a loss of inf as "Infinity" (JSON has no inf): the row parses it to a float, and one run's
    # float inf made every overview poll (every run's row) and its run page answer 500
    st = Store(str(tmp_path / "t.db"), now=Now())
    ov = Overview(st, PullsView(None))
    st.add([beat(0, run="ok"), beat(0, run="gone", progress={"step": 5, "loss": "Infinity", "tokens_per_s": "-Infinity"}),
            beat(0, run="nan", loss="NaN")])
    rows = {r["run"]: r for r in json.loads(json.dumps(ov.overview(-1), allow_nan=False))["runs"]}
    assert (rows["gone"]["loss"], rows["gone"]["tokens_per_s"]) == ("Infinity", "-Infinity")
    assert rows["nan"]["loss"] == "NaN" and rows["ok"]["loss"] == 2.0
    body = json.loads(series_body(_read_series(st, "gone"), {"summary": ov.run("gone")}))
    assert body["summary"]["loss"] == "Infinity" and body["points"]["loss"] == [None]
