"""The dashboard in a real browser: Debian's chromium driven by Playwright (no browser download: build/sysdeps.sh
installs chromium, the `dev` extra Playwright), against a real `onboxctl tracker serve` fed by a real `onbox run`.

The trainer is a tiny real training loop (linear regression by gradient descent) that prints `step=N loss=X ...`
lines, which the agent parses and sends in heartbeats. It goes in lockstep with the tracker (the next step once a
beat of this one is stored), so every printed step is in some beat, and the curve must hold exactly the trainer's
points. Checked without a reload: the run appears in the list, new points reach the open run page, and once the
agent is SIGKILLed (beats stop) the run is marked SILENT. The login refuses a wrong token and sets an HttpOnly,
SameSite=Strict cookie; the token is in no URL; the page raises no script error or CSP violation. Screenshots go
to the test's tmp dir.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.hosts.tracker import TrackerProcess
from tests.integration.supervisor_helpers import env_for, state
from tests.polling import wait_for
from tests.processes import Started

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STEPS = 12  # printed in two halves: the second after the run page is open

TRAINER = r'''
import json, os, sys, time, urllib.request
tracker, token_file, run, record, go = sys.argv[1:6]
steps = int(sys.argv[6])
token = open(token_file).read().strip()

def stored_step():
    req = urllib.request.Request(tracker + "/api/v1/runs", headers={"Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            runs = json.load(r)["runs"]
    except (OSError, ValueError):
        return -1
    for e in runs:
        if e["run"] == run and e.get("latest"):
            return (e["latest"].get("progress") or {}).get("step") or -1
    return -1

data = [(x / 10.0, 3.0 * x / 10.0 + 1.0) for x in range(10)]  # fit y = 3x + 1
w = b = 0.0
lr = 0.05
print("loaded WANDB_API_KEY=%s from the environment" % os.environ["WANDB_API_KEY"], flush=True)  # as trainers do
printed = []
for step in range(1, steps + 1):
    if step == steps // 2 + 1:
        while not os.path.exists(go):
            time.sleep(0.02)
    gw = gb = loss = 0.0
    for x, y in data:
        err = w * x + b - y
        loss += err * err
        gw += 2 * err * x
        gb += 2 * err
    n = len(data)
    w, b, loss = w - lr * gw / n, b - lr * gb / n, loss / n
    line = "step=%d loss=%.6f lr=%g tok/s=%.1f" % (step, loss, lr, 1000.0 + step)
    print(line, flush=True)
    printed.append([step, float("%.6f" % loss)])
    with open(record + ".tmp", "w") as f:
        json.dump(printed, f)
    os.replace(record + ".tmp", record)
    deadline = time.monotonic() + 30  # lockstep: every printed step reaches a stored beat
    while stored_step() < step and time.monotonic() < deadline:
        time.sleep(0.02)
while True:  # trained: idle until stopped
    time.sleep(1)
'''


@pytest.fixture
def browser(tmp_path):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip("Debian's chromium is missing: run build/sysdeps.sh")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the dev extra (playwright) is not installed")
    profile = tmp_path / "chromium-profile"  # a fresh --user-data-dir
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                   args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
        try:
            yield ctx
        finally:
            ctx.close()


def js(page, expr):
    return page.evaluate("() => (%s)" % expr)


def test_a_real_run_on_the_page_with_its_curve_and_silent_when_its_beats_stop(tmp_path, browser):
    tracker = TrackerProcess(str(tmp_path / "tracker"),
                             extra_args=["--pulls-record", str(tmp_path / "pulls.json")]).start()
    home, record, go = tmp_path / "home", tmp_path / "printed.json", tmp_path / "go"
    (tmp_path / "train.py").write_text(TRAINER)
    secret = "wandb-" + os.urandom(12).hex()  # the job's secret, printed by the trainer: never in the page
    (home / "secrets").mkdir(parents=True)
    (home / "secrets" / "WANDB_API_KEY").write_text(secret + "\n")
    (home / "secrets" / "WANDB_API_KEY").chmod(0o600)
    page = browser.new_page()
    problems, urls = [], []
    page.on("pageerror", lambda e: problems.append("pageerror: %s" % e))
    page.on("console", lambda m: problems.append("console %s: %s" % (m.type, m.text)) if m.type == "error" else None)
    page.on("request", lambda r: urls.append(r.url))
    started = Started(home)  # the end (a failed test too) stops the agent and the job it started
    try:
        # -- login: a wrong token is refused, the right one sets the cookie, the token is in no URL
        page.goto(tracker.url + "/")
        assert page.url == tracker.url + "/login?next=/"
        page.fill("#token", "not-the-token")
        page.click("#login")
        assert page.inner_text("#login-error").startswith("That is not the tracker")
        assert browser.cookies() == []
        assert [p for p in problems if "401" not in p] == []  # the browser logs the refused login's 401, only it
        problems.clear()
        page.fill("#token", tracker.token)
        page.click("#login")
        wait_for(lambda: page.url == tracker.url + "/", 10, "the run list after the login")
        [cookie] = browser.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and tracker.token not in cookie["value"]
        page.goto(tracker.url + "/?poll=0.2")
        wait_for(lambda: js(page, "window.onboxDashboard.polls >= 1"), 10, "the first poll of the list")

        # -- a real `onbox run` starts while the list is open: its row appears without a reload
        env = env_for(home, ONBOX_TRACKER=tracker.url, ONBOX_TRACKER_TOKEN_FILE=tracker.token_file,
                      ONBOX_HEARTBEAT_INTERVAL="0.05", ONBOX_BOX="gpu-test")
        with open(tmp_path / "onbox.log", "wb") as log:
            proc = started.popen(
                [sys.executable, "-m", "onbox", "run", "--foreground", "--name", "dash", "--restart", "never",
                 "--secret", "WANDB_API_KEY", "--",
                 sys.executable, str(tmp_path / "train.py"), tracker.url, tracker.token_file, "dash", str(record),
                 str(go), str(STEPS)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        row = 'tr[data-run="dash"]'
        wait_for(lambda: page.query_selector(row + '[data-state="running"]'), 30, "the run's row in the list")
        assert page.inner_text(row + " td:nth-child(2)") == "gpu-test"

        # -- the run page while the trainer waits half-way; the second half arrives live
        page.goto(tracker.url + "/run/dash?poll=0.2")
        half = STEPS // 2
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length === 5 && "
                                  "window.onboxDashboard.charts[0].data[0].length") == half, 30, "the first half")
        go.write_text("")
        wait_for(lambda: js(page, "window.onboxDashboard.charts[0].data[0].length") == STEPS, 30,
                 "every step on the open page")
        printed = json.loads(record.read_text())
        assert [s for s, _ in printed] == list(range(1, STEPS + 1))
        drawn = js(page, "[window.onboxDashboard.charts[0].data[0], window.onboxDashboard.charts[0].data[1]]")
        assert [list(p) for p in zip(*drawn)] == printed  # the loss curve is exactly what the trainer printed
        tps = js(page, "window.onboxDashboard.charts[2].data")
        assert tps[0] == list(range(1, STEPS + 1)) and tps[1] == [1000.0 + s for s in tps[0]]
        assert js(page, "document.querySelector('#run-state .state').textContent") == "running"
        # -- the log tail the agent sent: the trainer's last lines, its secret replaced
        wait_for(lambda: "step=%d loss=" % STEPS in page.inner_text("#log-tail"), 30, "the last step in the log tail")
        tail = page.inner_text("#log-tail").splitlines()
        assert tail[0] == "loaded WANDB_API_KEY=[secret] from the environment"
        assert tail[1:] == ["step=%d loss=%.6f lr=0.05 tok/s=%.1f" % (s, loss, 1000.0 + s) for s, loss in printed]
        assert page.inner_text("#log-count") == " (the last %d of %d lines)" % (STEPS + 1, STEPS + 1)
        assert secret not in page.content()
        page.screenshot(path=str(tmp_path / "dashboard-run-live.png"), full_page=True)

        # -- the agent dies (SIGKILL, no final beat): the open page marks the run SILENT
        started.add(state(home, "dash").get("child_pid"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        started.kill()  # and the job it ran
        wait_for(lambda: page.query_selector("#run-state .mark-SILENT"), 30, "SILENT on the run page")
        assert page.get_attribute("#run-state", "data-liveness") == "silent"
        page.screenshot(path=str(tmp_path / "dashboard-run.png"), full_page=True)
        page.goto(tracker.url + "/?poll=0.2")
        wait_for(lambda: page.query_selector(row + '[data-liveness="silent"] .mark-SILENT'), 30, "SILENT in the list")
        page.screenshot(path=str(tmp_path / "dashboard-list.png"), full_page=True)
        for shot in ("dashboard-run.png", "dashboard-list.png"):
            with open(tmp_path / shot, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert problems == []
        assert urls and not [u for u in urls if tracker.token in u]
        stored = b""
        for path in (tracker.db, tracker.db + "-wal"):
            if os.path.exists(path):
                with open(path, "rb") as f:
                    stored += f.read()
        assert b"WANDB_API_KEY=[secret]" in stored and secret.encode() not in stored  # nor in what the tracker keeps
    finally:
        started.stop()
        tracker.stop()


def test_runs_the_tracker_no_longer_has_leave_the_open_list(tmp_path, browser):
    """The tracker restarted on another database (same port and token) while the list was open: the next poll gets
    every run again (`full`), and the runs the new database lacks are taken off the page without a reload."""
    import time

    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()

    def beat(run, seq):
        return {"schema": "onbox.heartbeat/1", "run": run, "box": "gpu1", "attempt": 0, "seq": seq,
                "time": time.time(), "state": "running", "interval_s": 30.0, "progress": {"step": seq}}

    try:
        assert tracker.post([beat("old-a", 1), beat("old-a", 2), beat("old-b", 1)]).status_code == 200
        page = browser.new_page()
        page.goto(tracker.url + "/?poll=0.2")
        wait_for(lambda: page.query_selector('tr[data-run="old-a"]') and page.query_selector('tr[data-run="old-b"]'),
                 30, "both runs in the list")
        tracker.stop()
        tracker.db = str(tmp_path / "tracker" / "another.db")
        tracker.start()
        assert tracker.post([beat("new-c", 1)]).status_code == 200
        wait_for(lambda: page.query_selector('tr[data-run="new-c"]'), 30, "the new database's run")
        wait_for(lambda: not page.query_selector('tr[data-run="old-a"]'), 30, "the old runs gone")
        assert not page.query_selector('tr[data-run="old-b"]')
        assert sorted(js(page, "Object.keys(window.onboxDashboard.runs)")) == ["new-c"]
    finally:
        tracker.stop()
