"""The dashboard over HTTP against a real `onboxctl tracker serve`: the login and its cookie, what the cookie may
and may not do, --public-read, the pulls record it reads, and the incremental data endpoints with their bad
inputs. (tests/integration/test_dashboard_browser.py drives the page itself in a real browser.)"""
from __future__ import annotations

import json
import os
import time

import pytest
import requests

from tests.hosts.tracker import TrackerProcess

pytestmark = pytest.mark.integration


def beat(run, seq, box="gpu1", **extra):
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": box, "attempt": 0, "seq": seq, "time": time.time(),
           "state": "running", "interval_s": 30.0, "progress": {"step": seq, "loss": 1.0 / (1 + seq)}}
    doc.update(extra)
    return doc


def test_login_sets_a_cookie_that_reads_but_never_writes(tracker):
    url = tracker.url
    r = requests.get(url + "/run/exp1", allow_redirects=False, timeout=10)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=/run/exp1"
    form = requests.get(url + r.headers["location"], timeout=10)
    assert form.status_code == 200 and 'name="token"' in form.text and 'value="/run/exp1"' in form.text
    assert "script-src 'self'" in form.headers["content-security-policy"]

    wrong = requests.post(url + "/login", data={"token": "not-it", "next": "/"}, allow_redirects=False, timeout=10)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers and 'id="login-error"' in wrong.text
    for body, ctype in (("a=1&" * 20, "application/x-www-form-urlencoded"), ('{"token": "x"}', "application/json")):
        bad = requests.post(url + "/login", data=body, headers={"Content-Type": ctype}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]
    other_site = requests.post(url + "/login", data={"token": tracker.token}, headers={"Origin": "http://evil.example"},
                               allow_redirects=False, timeout=10)
    assert other_site.status_code == 403 and "set-cookie" not in other_site.headers

    s = requests.Session()
    ok = s.post(url + "/login", data={"token": tracker.token, "next": "/run/exp1"},
                headers={"Origin": url}, allow_redirects=False, timeout=10)
    assert ok.status_code == 303 and ok.headers["location"] == "/run/exp1"
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie  # plain HTTP here
    assert tracker.token not in cookie and tracker.token not in ok.headers["location"]
    # an offsite `next` is never followed
    evil = s.post(url + "/login", data={"token": tracker.token, "next": "//evil.example/x"}, allow_redirects=False,
                  timeout=10)
    assert evil.headers["location"] == "/"

    assert tracker.post([beat("exp1", 1)]).status_code == 200
    page = s.get(url + "/", timeout=10)
    assert page.status_code == 200 and "/static/dashboard.js" in page.text
    assert s.get(url + "/api/v1/runs", timeout=10).json()["runs"][0]["run"] == "exp1"
    assert s.get(url + "/api/v1/overview", timeout=10).json()["runs"][0]["run"] == "exp1"
    # a write with the cookie alone is refused: only the bearer header writes
    assert s.post(url + "/api/v1/heartbeats", json={"heartbeats": [beat("exp1", 2)]}, timeout=10).status_code == 401
    assert requests.get(url + "/api/v1/overview", timeout=10).status_code == 401
    assert requests.get(url + "/api/v1/overview", headers=tracker.headers(), timeout=10).status_code == 200

    out = s.post(url + "/logout", allow_redirects=False, timeout=10)
    assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
    assert s.get(url + "/api/v1/overview", timeout=10).status_code == 401
    # static files need no login and nothing outside the vendored set is served
    js = requests.get(url + "/static/uPlot.iife.min.js", timeout=10)
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert requests.get(url + "/static/VENDORED.md", timeout=10).status_code == 404
    assert requests.get(url + "/static/..%2fstore.py", timeout=10).status_code == 404


def test_public_read_serves_the_page_without_login_and_still_guards_writes(tmp_path):
    t = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()
    try:
        assert t.post([beat("pub", 1)]).status_code == 200
        assert requests.get(t.url + "/", allow_redirects=False, timeout=10).status_code == 200
        assert requests.get(t.url + "/api/v1/overview", timeout=10).json()["runs"][0]["run"] == "pub"
        r = requests.post(t.url + "/api/v1/heartbeats", json={"heartbeats": [beat("pub", 2)]}, timeout=10)
        assert r.status_code == 401
    finally:
        t.stop()


def test_the_data_endpoints_are_incremental_and_refuse_bad_input(tmp_path):
    home = tmp_path / "pulled" / "r1" / "checkpoints" / "c-2"
    home.mkdir(parents=True)
    (home / "MANIFEST.json").write_text(json.dumps({"name": "c-2", "digest": "sha256:abc"}))
    pulls = tmp_path / "pulls.json"
    pulls.write_text(json.dumps({"pulls": {"gpu1/r1": {"box": "gpu1", "run": "r1", "checkpoints": {
        "c-2": {"name": "c-2", "ok": True, "path": str(home), "verified_at": 1.0}}}}}))
    t = TrackerProcess(str(tmp_path / "tracker"), extra_args=["--pulls-record", str(pulls)]).start()
    h = t.headers()

    def get(path, **params):
        return requests.get(t.url + path, params=params, headers=h, timeout=10)

    try:
        ckpt = {"latest_durable": {"name": "c-2", "step": 2, "digest": "sha256:abc"}, "verified": True}
        assert t.post([beat("r1", 1), beat("r1", 2, checkpoint=ckpt), beat("r2", 1, box="gpu2")]).status_code == 200
        full = get("/api/v1/overview").json()
        assert [r["run"] for r in full["runs"]] == ["r1", "r2"] and full["full"]
        assert full["live"]["r1"]["pulled"]["status"] == "verified"
        assert full["live"]["r2"]["pulled"]["status"] == "no_checkpoint"
        assert t.post([beat("r2", 2, box="gpu2")]).status_code == 200
        inc = get("/api/v1/overview", after=full["cursor"]).json()
        assert [r["run"] for r in inc["runs"]] == ["r2"] and set(inc["live"]) == {"r1", "r2"}
        assert inc["cursor"] > full["cursor"]

        s = get("/api/v1/runs/r1/series").json()
        assert s["points"]["seq"] == [1, 2] and s["points"]["step"] == [1, 2]
        assert [e["kind"] for e in s["events"]] == ["commit"] and s["summary"]["durable"]["name"] == "c-2"
        assert get("/api/v1/runs/r1/series", after=s["next_after"]).json()["points"]["seq"] == []
        assert get("/api/v1/runs/none/series").json()["summary"] is None
        for path, params in (("/api/v1/overview", {"after": "x"}), ("/api/v1/overview", {"after": "-2"}),
                             ("/api/v1/runs/r1/series", {"limit": "0"}),
                             ("/api/v1/runs/r1/series", {"limit": "20001"}),
                             ("/api/v1/runs/-bad/series", {})):
            r = get(path, **params)
            assert r.status_code == 400 and r.json()["error"], (path, params, r.text)
    finally:
        t.stop()


def test_a_pulls_record_nested_100000_deep_degrades_the_pull_column_not_the_overview(tmp_path):
    pulls = tmp_path / "pulls.json"
    pulls.write_text('{"pulls": %s%s}' % ("[" * 100000, "]" * 100000))
    t = TrackerProcess(str(tmp_path / "tracker"), extra_args=["--pulls-record", str(pulls)]).start()

    def overview():
        r = requests.get(t.url + "/api/v1/overview", headers=t.headers(), timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        ckpt = {"latest_durable": {"name": "c-2", "step": 2, "digest": "sha256:abc"}, "verified": True}
        assert t.post([beat("r1", 1, checkpoint=ckpt), beat("r2", 1, box="gpu2")]).status_code == 200
        got = overview()
        assert [r["run"] for r in got["runs"]] == ["r1", "r2"]  # the list is served, every run on it
        assert "pulls record %s is unreadable: it nests more than 64 levels deep" % pulls in got["pulls_problem"]
        assert got["live"]["r1"]["pulled"] == {"status": "unknown", "text": got["pulls_problem"]}
        assert got["live"]["r2"]["pulled"]["status"] == "no_checkpoint"
        series = requests.get(t.url + "/api/v1/runs/r1/series", headers=t.headers(), timeout=10)
        assert series.status_code == 200 and series.json()["summary"]["pulls_problem"] == got["pulls_problem"]
        assert "nests more than 64 levels deep" in t.log()  # the tracker's log says why, once

        pulls.unlink()
        os.mkfifo(str(pulls), 0o600)  # a FIFO without a writer: refused at once, never waited on
        assert "FIFO" in overview()["pulls_problem"]

        pulls.unlink()  # fixed: the next poll uses it
        pulls.write_text(json.dumps({"pulls": {}}))
        got = overview()
        assert got["pulls_problem"] is None and got["live"]["r1"]["pulled"]["status"] == "not_pulled"
    finally:
        t.stop()


def test_over_tls_the_cookie_is_secure(tmp_path, cert):
    crt, key = cert
    t = TrackerProcess(str(tmp_path / "tracker"), extra_args=["--tls-cert", crt, "--tls-key", key]).start()
    url = "https://127.0.0.1:%d" % t.port
    try:
        r = requests.post(url + "/login", data={"token": t.token}, headers={"Origin": url}, allow_redirects=False,
                          verify=crt, timeout=10)
        assert r.status_code == 303
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("onbox_session_%d=" % t.port) and "; Secure" in cookie and "HttpOnly" in cookie
    finally:
        t.kill()  # SIGKILL: after an HTTPS request, a SIGTERM'd tracker waits out uvicorn's 10 s graceful shutdown


def test_a_rows_phase_node_and_log_tail_come_from_its_newest_beat(tmp_path):
    t = TrackerProcess(str(tmp_path / "tracker")).start()
    try:
        phase = {"name": "finetune", "index": 1, "count": 3, "status": "running", "target_steps": 200,
                 "target_tokens": None, "start_step": 100}
        node = {"group": "ab12cd34", "run": "big", "rank": 1, "nnodes": 2}
        tail = {"lines": ["step=1 loss=2.0", "step=2 loss=1.5"], "lines_total": 40, "redacted": 0}
        assert t.post([beat("big.node1", 1, phase=phase, node=node, log_tail=tail),
                       beat("plain", 1, phase=None, node=None, log_tail=None)]).status_code == 200
        odd = t.post([beat("odd", 1, phase={"index": "one"}, node={"rank": -1}, log_tail={"lines": [1]})])
        assert odd.status_code == 400 and "phase.index" in odd.text, odd.text  # the schema says what each holds
        rows = {r["run"]: r for r in requests.get(t.url + "/api/v1/overview", headers=t.headers(),
                                                   timeout=10).json()["runs"]}
        assert rows["big.node1"]["phase"] == {"name": "finetune", "index": 1, "count": 3, "status": "running"}
        assert rows["big.node1"]["node"] == {"rank": 1, "nnodes": 2, "run": "big"}
        assert rows["big.node1"]["has_log"] is True and "log_tail" not in rows["big.node1"]  # the list stays light
        assert rows["plain"]["phase"] is None and rows["plain"]["node"] is None and rows["plain"]["has_log"] is False
        summary = requests.get(t.url + "/api/v1/runs/big.node1/series", headers=t.headers(), timeout=10).json()["summary"]
        assert summary["log_tail"] == tail["lines"] and summary["log_lines_total"] == 40
    finally:
        t.stop()
