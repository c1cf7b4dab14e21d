"""The dashboard in a real browser: Debian's chromium driven by Playwright (no browser download: build/sysdeps.sh
installs chromium, the `dev` extra Playwright), against a real `onboxctl tracker serve` fed by a real `onbox run`.

The trainer is a tiny real training loop (linear regression by gradient descent) that prints `step=N loss=X ...`
lines, which the agent parses and sends in heartbeats. It goes in lockstep with the tracker (the next step once a
beat of this one is stored), so every printed step is in some beat, and the curve must hold exactly the trainer's
points. Checked without a reload: the run appears in the list, new points reach the open run page, and once the
agent is SIGKILLed (beats stop) the run is marked SILENT. The login refuses a wrong token and sets an HttpOnly,
SameSite=Strict cookie; the token is in no URL; the page raises no script error or CSP violation. A recovery by
the real keeper (its boxes scripted, its events posted to the tracker) is listed in the events row and drawn on
every chart (read back from the canvas' pixels), over steps and over time; a tracker without events leaves the page
quiet and without such marks. Screenshots go to the test's tmp dir.
"""
from __future__ import annotations

import json
import os
import re
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
                 "--secret", "WANDB_API_KEY", "--deadline", "2h", "--",
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
        # -- the run's deadline (--deadline 2h) as its beats carry it: when, from where, the time left, the ask
        facts = page.inner_text("#facts")
        assert re.search(r"^deadline .+ \(flag\), (2\.0h|1\.9h) left; checkpoint asked for at .+$", facts, re.M), facts
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


# -- the keeper's recoveries on a run page -------------------------------------------------------------------------
RECOVERY_RGB = (0x0F, 0x8B, 0x8D)  # EVENT_COLORS.recovery in dashboard.js
FAILED_RGB = (0x82, 0x07, 0x1E)  # EVENT_COLORS.failed_max_recoveries


def keeper_world(tracker, t0):
    """The real keeper's World with its boxes scripted (no ssh): gpu1 stops answering, spare s0 of pool a100 takes
    the run and trains from step 1351 (restored from durable step 1350), then s0 stops answering too. What the
    tracker says (beats) and where the events go (POST /api/v1/events) are the real ones."""
    from controller.boxes.inventory import Box
    from controller.keeper.decide import Observation
    from controller.keeper.world import World
    from controller.launch.start import LaunchResult

    class Scripted(World):
        def __init__(self):
            super().__init__(ssh=None, inventory=None, tracker=tracker.url, token=tracker.token)
            self.inventory = {"gpu1": Box(name="gpu1", host="10.0.0.1"),
                              "s0": Box(name="s0", host="10.0.0.2", pool="a100")}
            self.state = {"gpu1": "down", "s0": "idle"}  # down, idle (answers, without the run), running
            self.launched = []

        def box(self, name):
            return self.inventory[name]

        def boxes(self):
            return dict(self.inventory)

        def observe(self, box, run):
            if self.state[box] == "down":
                return Observation(box, run, reached=False, error="cannot reach box %s: Connection refused" % box)
            if self.state[box] == "idle":
                return Observation(box, run, reached=True, known=False)
            return Observation(box, run, reached=True, known=True, state="running", agent_alive=True, step=1351,
                               step_time=t0 + 341.0, attempt_started=t0 + 335.0, durable_step=1350,
                               resumed_step=1350)

        def spare_problem(self, name, rec):
            return None

        def push(self, box, rec, code=True):
            pass

        def launch(self, rec, boxes, take_over=False):
            self.launched.append(([b.name for b in boxes], take_over))
            self.state.update({b.name: "running" for b in boxes})
            return [LaunchResult(box=b.name, name=rec.run, ok=True, state="running") for b in boxes]

    return Scripted()


def run_beats(box, steps, t_of, interval_s=0.05):
    return [{"schema": "onbox.heartbeat/1", "run": "gpt", "box": box, "attempt": 0, "seq": 10_000 * (box == "s0") + s,
             "time": t_of(s), "state": "running", "interval_s": interval_s,
             "progress": {"step": s, "loss": round(4.0 / (1 + s / 200.0) + (0.01 if box == "s0" else 0.0), 6)}}
            for s in steps]


def column_share(page, chart, x, rgb):
    """The share of the plot's height whose pixels in canvas column x are exactly colour rgb."""
    return js(page, """((id, x, rgb) => {
        const u = window.onboxDashboard.charts.find(c => c.onboxId === id);
        const top = Math.round(u.bbox.top), h = Math.round(u.bbox.height);
        const px = u.ctx.getImageData(x, top, 1, h).data;
        let n = 0;
        for (let i = 0; i < px.length; i += 4) n += px[i] === rgb[0] && px[i + 1] === rgb[1] && px[i + 2] === rgb[2];
        return n / h;
    })(%s, %d, %s)""" % (json.dumps(chart), x, json.dumps(list(rgb))))


def drawn(page, chart="loss"):
    return js(page, "window.onboxDashboard.drawn[%s]" % json.dumps(chart))


def test_a_recovery_by_the_keeper_is_marked_on_the_curves_and_listed_with_the_events(tmp_path, browser):
    """A run's beats (gpu1 to step 1400; spare s0 from step 1351 on), and the real keeper (its boxes scripted)
    recovering it while the run page is open: its events reach the page by the events endpoint's cursor, and the
    recovery is one mark, at the time gpu1 was declared lost over time and at step 1350 (where it resumed) over
    steps; the failure after it (s0 lost too, past --max-recoveries 1) a mark of its own."""
    import time

    from controller.keeper.loop import Keeper
    from controller.keeper.policy import LaunchRecord, RecoveryPolicy
    from controller.keeper.records import RecordStore
    from onbox.clock import FakeClock

    tracker = TrackerProcess(str(tmp_path / "tracker")).start()
    t0 = round(time.time() - 3600.0)
    gpu1 = run_beats("gpu1", range(50, 1401, 50), lambda s: t0 + s * 0.2)  # step 1400 at t0 + 280
    s0 = run_beats("s0", [1351, *range(1400, 1601, 50)], lambda s: t0 + 341.0 + (s - 1351) * 0.2)
    store = RecordStore(str(tmp_path / "config"))
    store.save_launch(LaunchRecord(run="gpt", boxes=["gpu1"], command=["python", "train.py"],
                                   policy=RecoveryPolicy(pool="a100", lost_after=0.0, max_recoveries=1),
                                   durable="/d", tracker=tracker.url))
    clock = FakeClock(start_wall=t0 + 300.0)  # the keeper's clock: gpu1 is declared lost at t0 + 300
    world = keeper_world(tracker, t0)
    said = []
    keeper = Keeper(store, world, clock=clock, say=said.append)
    page = browser.new_page()
    problems, asked = [], []
    page.on("pageerror", lambda e: problems.append("pageerror: %s" % e))
    page.on("console", lambda m: problems.append("console %s: %s" % (m.type, m.text)) if m.type == "error" else None)
    page.on("request", lambda r: asked.append(r.url) if "/events?" in r.url else None)
    try:
        assert tracker.post(gpu1).status_code == 200
        page.goto(tracker.url + "/")  # the login: the events are read with the session cookie, like the beats
        page.fill("#token", tracker.token)
        page.click("#login")
        wait_for(lambda: page.url == tracker.url + "/", 10, "the run list after the login")
        page.goto(tracker.url + "/run/gpt?poll=0.2")
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length === 5 && "
                                  "window.onboxDashboard.keeper.served === true"), 30, "the run page")
        assert js(page, "window.onboxDashboard.marks") == [] and drawn(page) == []
        time.sleep(0.3)  # gpu1's beats (every 0.05 s) are silent now: with its box down, it is lost

        # -- pass 1: gpu1 lost, the run relaunched on spare s0; no new step yet
        keeper.tick()
        assert world.launched == [(["s0"], True)], said
        rec_ev = '#events .ev-recovery[data-recovery="1"]'
        wait_for(lambda: page.query_selector(rec_ev), 30, "the recovery in the events row")
        assert page.inner_text(rec_ev) == "recovery 1: gpu1 lost → spare s0, relaunched, waiting for its first new step"
        [mark] = js(page, "window.onboxDashboard.marks")
        assert (mark["kind"], mark["time"], mark["step"], mark["resumed"]) == ("recovery", t0 + 300.0, 1400, False)
        assert [(d["kind"], d["at"]) for d in drawn(page)] == [("recovery", 1400)]  # the newest step before it

        # -- pass 2: s0's beats arrive, and the keeper sees its first new step
        assert tracker.post(s0).status_code == 200
        clock.advance(41.5)
        keeper.tick()
        want = "recovery 1: gpu1 lost → spare s0, resumed at step 1350 (41.5 s to the first new step)"
        wait_for(lambda: page.inner_text(rec_ev) == want, 30, "the recovery done, with its resume step")
        wait_for(lambda: [(d["kind"], d["at"]) for d in drawn(page)] == [("recovery", 1350)], 30, "the mark moved")
        title = page.get_attribute(rec_ev, "title").splitlines()
        assert [re.search(r" ([a-z_]+): ", ln).group(1) for ln in title] == [  # "3:41:07 PM detected: ..."
            "detected", "declared_lost", "box_chosen", "pushed", "relaunched", "first_new_step"]
        assert "trains again on s0: step 1351 (resumed after durable step 1350), 41.5 s after it was detected" in title[-1]
        for chart in ("loss", "lr", "tps", "gpu", "mem"):  # every chart marks it, at step 1350
            [d] = drawn(page, chart)
            x = js(page, "Math.round(window.onboxDashboard.charts.find(c => c.onboxId === %s)"
                         ".valToPos(1350, 'x', true))" % json.dumps(chart))
            assert d["x"] == x
        x = drawn(page)[0]["x"]
        assert column_share(page, "loss", x, RECOVERY_RGB) > 0.95  # a solid line from top to bottom
        assert column_share(page, "loss", x - 40, RECOVERY_RGB) == 0  # and only there
        # the beats' own events are still there: the run moved to another box
        assert "box: now on s0 (was gpu1)" in page.inner_text("#events")

        # -- pass 3: s0 stops answering too: one more recovery is past --max-recoveries 1
        world.state["s0"] = "down"
        time.sleep(0.3)
        clock.advance(78.5)  # t0 + 420, after s0's last beat (t0 + 390.8)
        keeper.tick()
        fail_ev = "#events .ev-failed_max_recoveries"
        wait_for(lambda: page.query_selector(fail_ev), 30, "the failure in the events row")
        assert page.inner_text(fail_ev).startswith("max recoveries: needed a recovery after 1 (--max-recoveries 1): ")
        assert page.get_attribute(fail_ev, "data-recovery") is None  # not part of a recovery
        wait_for(lambda: len(drawn(page)) == 2, 30, "both marks drawn")
        assert [(d["kind"], d["at"]) for d in drawn(page)] == [("recovery", 1350), ("failed_max_recoveries", 1600)]
        assert len(world.launched) == 1  # nothing more was launched
        page.screenshot(path=str(tmp_path / "dashboard-recovery-steps.png"), full_page=True)

        # -- over time: at the keeper's times; the x axis reaches the failure after the last beat
        page.click("#x-time")
        wait_for(lambda: js(page, "window.onboxDashboard.xmode") == "time" and len(drawn(page)) == 2, 10, "time")
        rec, fail = drawn(page)
        assert (rec["kind"], rec["at"], fail["kind"], fail["at"]) == ("recovery", t0 + 300.0,
                                                                    "failed_max_recoveries", t0 + 420.0)
        scale = js(page, "[window.onboxDashboard.charts[0].scales.x.min, window.onboxDashboard.charts[0].scales.x.max]")
        assert scale == [t0 + 10.0, t0 + 420.0]  # the first beat's time .. the failure's
        assert column_share(page, "loss", rec["x"], RECOVERY_RGB) > 0.95
        assert 0.6 < column_share(page, "loss", fail["x"] - 1, FAILED_RGB) < 0.95  # dashed
        page.screenshot(path=str(tmp_path / "dashboard-recovery-time.png"), full_page=True)

        # the cursor: every poll asks for the events after the newest one it has. The poll after the one that
        # brought the newest event may still be on its way (a poll every 0.2 s): wait for it, bounded
        def cursors():
            js(page, "true")  # the page's request events are delivered while playwright talks to it
            return [int(u.split("after=")[1].split("&")[0]) for u in asked]

        newest = js(page, "window.onboxDashboard.keeper.after")
        wait_for(lambda: cursors()[-1:] == [newest], 10, "a poll that asks for the events after the newest one")
        afters = cursors()
        assert afters[0] == 0 and afters == sorted(afters) and afters[-1] == newest
        assert afters[-1] > 0 and js(page, "window.onboxDashboard.keeper.events.length") == 7
        assert js(page, "document.getElementById('banner').hidden") is True
        assert problems == []
    finally:
        tracker.stop()


@pytest.mark.parametrize("status", [404, 405])
def test_a_tracker_without_events_leaves_the_run_page_without_marks_and_quiet(tmp_path, browser, status):
    """A tracker older than events answers 404 (or 405) to GET /api/v1/runs/<run>/events: the page draws its curves
    and the beats' events as before, asks once, says nothing, and keeps polling the beats."""
    import time

    import requests

    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()
    t0 = round(time.time() - 3600.0)
    try:
        assert tracker.post(run_beats("gpu1", range(50, 501, 50), lambda s: t0 + s * 0.2)).status_code == 200
        # events this tracker has, which the page must not get to: the route answers like an older tracker
        ev = {"run": "gpt", "time": t0 + 50.0, "kind": "declared_lost", "text": "declared gpu1 lost", "boxes": ["gpu1"],
              "recovery": 1}
        r = requests.post(tracker.url + "/api/v1/events", json={"events": [ev]}, headers=tracker.headers(), timeout=10)
        assert r.status_code == 200 and r.json()["accepted"] == 1
        page = browser.new_page()
        problems, refused = [], []
        page.on("pageerror", lambda e: problems.append("pageerror: %s" % e))
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)

        def older(route):
            refused.append(route.request.url)
            route.fulfill(status=status, content_type="application/json",
                          body=json.dumps({"error": "not found" if status == 404 else "method not allowed"}))

        page.route("**/api/v1/runs/*/events*", older)
        page.goto(tracker.url + "/run/gpt?poll=0.2")
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length === 5 && window.onboxDashboard.polls >= 8"),
                 30, "the run page polling")
        assert js(page, "window.onboxDashboard.charts[0].data[0]") == list(range(50, 501, 50))
        assert js(page, "window.onboxDashboard.keeper") == {"after": 0, "served": False, "events": []}
        assert js(page, "window.onboxDashboard.marks") == [] and drawn(page) == []
        assert not page.query_selector("#events [data-mark]")
        assert js(page, "document.getElementById('banner').hidden") is True and js(page, "window.onboxDashboard.errors") == 0
        assert len(refused) == 1  # asked once, not on every poll
        assert [p for p in problems if str(status) not in p] == []  # the browser logs the refused request, only it
        # new beats still arrive
        assert tracker.post(run_beats("gpu1", [550], lambda s: t0 + s * 0.2)).status_code == 200
        wait_for(lambda: js(page, "window.onboxDashboard.charts[0].data[0].length") == 11, 30, "the new beat")
    finally:
        tracker.stop()


def test_each_recovery_and_failure_reads_as_one_line_whatever_the_keeper_s_version(tmp_path, browser):
    """Events posted as the keeper would: a relaunch on the same box; one from a keeper older than the `to_boxes` and
    `resume_step` fields (where it went read from the first new step's boxes, the mark at the newest beat's step
    before it, the time to the first new step from the events' times); a provisioned box whose launches all failed;
    no box found; a person needed; and another source's event, which is not the keeper's."""
    import time

    import requests

    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()
    t0 = round(time.time() - 3600.0)

    def ev(dt, kind, rec=None, boxes=("gpu1",), **kw):
        return dict({"run": "gpt", "time": t0 + dt, "kind": kind, "source": "keeper", "text": "the keeper's %s" % kind,
                     "boxes": list(boxes), "recovery": rec}, **kw)

    events = [
        ev(100, "detected", 1), ev(100, "box_chosen", 1, to_boxes=["gpu1"], provisioned=[]), ev(101, "pushed", 1),
        ev(102, "relaunched", 1, to_boxes=["gpu1"]),
        ev(108.2, "first_new_step", 1, to_boxes=["gpu1"], first_step=401, resume_step=400, took_s=8.2),
        ev(200, "detected", 2), ev(200, "declared_lost", 2), ev(201, "box_chosen", 2), ev(202, "pushed", 2),
        ev(203, "relaunched", 2), ev(230.46, "first_new_step", 2, boxes=["p0"]),
        ev(300, "detected", 3, boxes=["p0"]), ev(300, "declared_lost", 3, boxes=["p0"]),
        ev(301, "provisioned", 3, boxes=["p0"]),
        ev(302, "box_chosen", 3, boxes=["p0"], to_boxes=["p1"], provisioned=["p1"]),
        ev(303, "pushed", 3, boxes=["p0"]), ev(304, "launch_failed", 3, boxes=["p0"]),
        ev(305, "failed_launch", 3, boxes=["p0"]),
        ev(400, "detected", 4, boxes=["p0"]), ev(400, "declared_lost", 4, boxes=["p0"]),
        ev(401, "no_box", 4, boxes=["p0"]), ev(402, "failed_no_resource", 4, boxes=["p0"]),
        ev(500, "needs_a_person", boxes=["p0"]),
        dict(ev(510, "needs_a_person"), source="someone-else"),
    ]
    try:
        assert tracker.post(run_beats("gpu1", range(100, 1001, 100), lambda s: t0 + s * 0.5)).status_code == 200
        r = requests.post(tracker.url + "/api/v1/events", json={"events": events}, headers=tracker.headers(), timeout=10)
        assert r.status_code == 200 and r.json()["accepted"] == len(events)
        page = browser.new_page()
        page.goto(tracker.url + "/run/gpt?poll=0.2")
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length === 5 && window.onboxDashboard.marks.length"),
                 30, "the run page with its marks")
        rows = js(page, "Array.from(document.querySelectorAll('#events [data-mark]'), e => "
                        "[e.dataset.mark, e.dataset.recovery || null, e.textContent])")
        assert rows == [
            ["recovery", "1", "recovery 1: relaunched on the same box gpu1, resumed at step 400 "
                              "(8.2 s to the first new step)"],
            ["recovery", "2", "recovery 2: gpu1 lost → p0, trains again (30.5 s to the first new step)"],
            ["recovery", "3", "recovery 3: p0 lost → provisioned box p1: every launch failed"],
            ["failed_launch", "3", "launch failed: the keeper's failed_launch"],
            ["recovery", "4", "recovery 4: p0 lost → no box found"],
            ["failed_no_resource", "4", "no box: the keeper's failed_no_resource"],
            ["needs_a_person", None, "needs a person: the keeper's needs_a_person"],
        ]
        # over steps: at the resume step, else at the step of the newest beat before (beats every 50 s, 100 steps)
        assert [(d["kind"], d["at"]) for d in drawn(page)] == [
            ("recovery", 400), ("recovery", 400), ("recovery", 600), ("failed_launch", 600), ("recovery", 800),
            ("failed_no_resource", 800), ("needs_a_person", 1000)]
    finally:
        tracker.stop()
