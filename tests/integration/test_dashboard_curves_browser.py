"""Curves at the trainer's resolution, in a real browser (Debian's chromium through Playwright) against a real
`onboxctl tracker serve`: the agent's own heartbeat hook (FakeClock, the real tracker sink over HTTP) sees a
trainer print 1,300 steps while it beats every 30 s, and the loss curve on the run page holds every one of those
steps, not one point per beat; new steps arrive live. Charts with nothing to draw (no GPU on this box) are not
shown; each axis is labelled; each legend shows the newest values without the pointer over it (and the hovered
one while it is); another run's loss goes on the same chart by the "compare loss with" picker or `?compare=`.
A tracker older than the trainer's points (its answers without `trainer`) and a run of an older agent (beats
without points) still draw from the beats. Screenshots go to the test's tmp dir."""
from __future__ import annotations

import json
import math
import time

import pytest

from onbox.clock import FakeClock
from onbox.heartbeat.collect import BoxReaders
from onbox.heartbeat.hook import HeartbeatHook
from onbox.heartbeat.sinks import TrackerSink
from tests.fakes.run_context import run_context
from tests.fakes.supervisor import loop_step
from tests.hosts.tracker import TrackerProcess
from tests.integration import test_dashboard_browser
from tests.polling import wait_for

pytestmark = pytest.mark.integration
browser = test_dashboard_browser.browser  # the fixture: Debian's chromium, a fresh profile
js = test_dashboard_browser.js

STATE = {"state": "running", "attempt": 0, "child_pid": None, "restarts": 0}
NO_GPU = {"available": False, "reason": "no NVIDIA driver", "gpus": []}


def loss_at(step, run):
    return round(4.0 / (1 + step / 150.0) + (0.05 if run == "b" else 0.0) + 0.01 * math.sin(step), 6)


def lr_at(step):
    return round(3e-4 * min(1.0, step / 200.0), 8)


class Trainer:
    """A trainer printing a metric line per step (and an eval line every 250), watched by the agent's real
    heartbeat hook on a FakeClock whose beats go to the real tracker through the real tracker sink."""

    def __init__(self, tmp_path, tracker, run, seconds_per_step=0.125, t0=None):
        self.run = run
        self.clock = FakeClock(start_wall=t0 if t0 is not None else time.time() - 600.0)
        ctx = run_context(tmp_path / run, name=run, clock=self.clock, durable=None, heartbeat_interval=30.0)
        readers = BoxReaders(gpu=lambda: NO_GPU, host=lambda: {}, disks=lambda paths: [])
        self.hook = HeartbeatHook(ctx, readers=readers, sinks=[TrackerSink(tracker.url, tracker.token_file)],
                                  close_timeout=30.0)
        self.dt = seconds_per_step
        self.step = 0
        self.printed = []  # [step, loss] as printed
        self.evals = []
        self.hook.tick(STATE)  # the start beat

    def train(self, steps):
        for _ in range(steps):
            self.step += 1
            self.clock.advance(self.dt)
            s, loss = self.step, loss_at(self.step, self.run)
            loop_step(self.hook, "step=%d loss=%.6f lr=%s tok/s=%.1f" % (s, loss, lr_at(s), 52000.0 + s % 97))
            self.printed.append([s, loss])
            if s % 250 == 0:
                ev = round(loss + 0.2, 6)
                loop_step(self.hook, "{'eval_loss': %s, 'epoch': %s}" % (ev, s / 1000.0))
                self.evals.append([s, ev])
            self.hook.tick(STATE)  # a beat every 30 s of the box's clock

    def delivered(self):
        assert self.hook.senders[0].flush(60), "the beats did not reach the tracker"

    def close(self):
        self.hook.close(dict(STATE, state="done"))


def beats_stored(tracker, run):
    return tracker.all_heartbeats(run)


def series(page, chart="loss"):
    return js(page, "(() => { const u = window.onboxDashboard.charts.find(c => c.onboxId === %s);"
                    " return u.data.map(a => Array.from(a, v => v === undefined ? null : v)); })()"
              % json.dumps(chart))


def ink(page, chart, box):
    """How many pixels of the chart's canvas inside box (x0, y0, x1, y1; CSS pixels, from the canvas' top left;
    negative: from its right/bottom) are drawn (not transparent)."""
    return js(page, """((id, box) => {
        const u = window.onboxDashboard.charts.find(c => c.onboxId === id), cv = u.ctx.canvas, r = devicePixelRatio;
        const at = (v, size) => Math.round((v < 0 ? size / r + v : v) * r);
        const x0 = at(box[0], cv.width), y0 = at(box[1], cv.height), x1 = at(box[2], cv.width), y1 = at(box[3], cv.height);
        const px = u.ctx.getImageData(x0, y0, x1 - x0, y1 - y0).data;
        let n = 0;
        for (let i = 3; i < px.length; i += 4) n += px[i] > 0;
        return n;
    })(%s, %s)""" % (json.dumps(chart), json.dumps(list(box))))


def legend(page, chart):
    return js(page, "Array.from(document.querySelectorAll('#chart-%s .u-legend .u-series'), r => "
                    "[r.querySelector('.u-label').textContent, r.querySelector('.u-value').textContent])" % chart)


def shown(page):
    return js(page, "Array.from(document.querySelectorAll('#charts .chart'), c => [c.id, !c.hidden])")


def fmt4(v):
    """dashboard.js fmtNum(v, 4): four significant digits, as JavaScript prints the number."""
    return ("%.4g" % v).rstrip("0").rstrip(".") if "e" not in "%.4g" % v else "%.4g" % v


def test_the_loss_curve_holds_every_step_the_trainer_printed_and_empty_charts_are_not_shown(tmp_path, browser):
    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()
    page = browser.new_page()
    problems = []
    page.on("pageerror", lambda e: problems.append("pageerror: %s" % e))
    page.on("console", lambda m: problems.append("console %s: %s" % (m.type, m.text)) if m.type == "error" else None)
    a = Trainer(tmp_path, tracker, "a")
    try:
        a.train(1300)  # 162.5 s of the box's clock: a beat every 30 s (240 steps), 1,300 steps printed
        a.delivered()
        stored = beats_stored(tracker, "a")
        assert [bt["progress"]["step"] for bt in stored] == [None, 240, 480, 720, 960, 1200]  # a handful of points
        n_beats = len(stored)
        page.goto(tracker.url + "/run/a?poll=0.2")
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length === 5"), 30, "the run page")
        # the beats sent so far hold the points up to their newest beat (step 1,200); the rest come with the next
        x, losses, evals = series(page)
        assert x == list(range(1, 1201)) and losses == [loss for _, loss in a.printed[:1200]]
        assert [[s, e] for s, e in zip(x, evals) if e is not None] == [e for e in a.evals if e[0] <= 1200]
        assert js(page, "window.onboxDashboard.points.seq.length") == n_beats  # one row per beat, a curve per step
        # -- live: the trainer goes on, the page follows without a reload
        a.train(100)
        a.close()
        wait_for(lambda: series(page)[0] == list(range(1, 1401)), 60, "every step on the open page")
        x, losses, evals = series(page)
        assert losses == [loss for _, loss in a.printed]
        assert [[s, e] for s, e in zip(x, evals) if e is not None] == a.evals
        lr = series(page, "lr")
        assert lr[0] == list(range(1, 1401)) and lr[1] == [lr_at(s) for s in range(1, 1401)]
        assert series(page, "tps")[1][:3] == [52001.0, 52002.0, 52003.0]

        # -- charts with nothing to draw are not shown (no GPU on this box); no "no readings" boxes
        assert shown(page) == [["chart-loss", True], ["chart-lr", True], ["chart-tps", True], ["chart-gpu", False],
                               ["chart-mem", False]]
        assert js(page, "document.getElementById('chart-gpu').getBoundingClientRect().height") == 0
        assert "no readings" not in page.inner_text("body")

        # -- the axes are labelled: the metric and its unit, step or time; and the labels are drawn
        labels = js(page, "window.onboxDashboard.charts.map(u => [u.onboxId, u.axes[0].label, u.axes[1].label])")
        assert labels == [["loss", "step", "loss"], ["lr", "step", "learning rate"], ["tps", "step", "tokens/s"],
                          ["gpu", "step", "GPU utilisation (%)"], ["mem", "step", "GPU memory used (GiB)"]]
        assert ink(page, "loss", (0, 40, 20, 180)) > 50  # the y label, in the leftmost 22 px
        assert ink(page, "loss", (120, -22, 400, -1)) > 30  # the x label, in the bottom 22 px

        # -- the legend shows the newest values without the pointer on the chart, the hovered ones with it
        last_loss, last_eval = a.printed[-1][1], a.evals[-1]
        want = [["step", "1400"], ["loss", fmt4(last_loss)],
                ["eval loss", "%s @ step %d" % (fmt4(last_eval[1]), last_eval[0])]]
        assert legend(page, "loss") == want
        assert legend(page, "lr")[1] == ["lr", "0.0003"]
        box = page.locator("#chart-loss .u-over").bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + box["height"] / 2)
        wait_for(lambda: legend(page, "loss")[0][1] not in ("1400", "-"), 10, "the hovered step in the legend")
        hovered = legend(page, "loss")
        step = int(hovered[0][1])
        assert 300 < step < 400 and hovered[1][1] == fmt4(loss_at(step, "a"))
        page.mouse.move(5, 5)  # away: the newest again
        wait_for(lambda: legend(page, "loss") == want, 10, "the newest values after the pointer left")
        page.screenshot(path=str(tmp_path / "curves-steps.png"), full_page=True)

        # -- over time: every record at its own time (the box's clock), the axis says so
        page.click("#x-time")
        wait_for(lambda: js(page, "window.onboxDashboard.xmode") == "time", 10, "time")
        x, losses, _ = series(page)
        assert len(x) == 1400  # an eval line is parsed at the time of its step's line
        assert x == sorted(x) and losses == [loss for _, loss in a.printed]
        assert js(page, "window.onboxDashboard.charts[0].axes[0].label") == "time (the box's clock)"
        page.screenshot(path=str(tmp_path / "curves-time.png"), full_page=True)
        assert problems == []
    finally:
        tracker.stop()


def test_two_runs_loss_on_one_chart_and_the_pages_of_older_trackers_and_agents(tmp_path, browser):
    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()
    page = browser.new_page()
    problems = []
    page.on("pageerror", lambda e: problems.append("pageerror: %s" % e))
    a, b = Trainer(tmp_path, tracker, "a"), Trainer(tmp_path, tracker, "b", seconds_per_step=0.25)
    try:
        a.train(600)
        b.train(800)
        a.close()
        b.close()
        # a run of an older agent: beats without points (one point per beat)
        old = [{"schema": "onbox.heartbeat/1", "run": "old", "box": "gpu9", "attempt": 0, "seq": k, "time": 1e9 + k,
                "state": "running", "interval_s": 30.0, "progress": {"step": k * 100, "loss": 3.0 - k * 0.1}}
               for k in range(1, 6)]
        assert tracker.post(old).status_code == 200
        wait_for(lambda: [r["state"] for r in tracker.runs() if r["run"] in ("a", "b")] == ["done", "done"], 60,
                 "both runs' final beats")

        # -- the picker: b's loss and eval loss join a's on the loss chart, and the URL keeps the choice
        page.goto(tracker.url + "/run/a?poll=0.2")
        wait_for(lambda: js(page, "(document.getElementById('compare') || {options: []}).options.length") == 3, 30,
                 "the picker's runs")
        assert js(page, "Array.from(document.getElementById('compare').options, o => o.value)") == ["", "b", "old"]
        page.select_option("#compare", "b")
        wait_for(lambda: len(series(page)) == 5, 30, "b's curves on a's loss chart")
        assert page.inner_text("#chart-loss .u-title") == "loss: a and b"
        labels = js(page, "window.onboxDashboard.charts[0].series.map(s => s.label)")
        assert labels == ["step", "a loss", "a eval loss", "b loss", "b eval loss"]
        x, a_loss, a_eval, b_loss, b_eval = series(page)
        assert x == list(range(1, 801))
        assert [[s, v] for s, v in zip(x, a_loss) if v is not None] == a.printed
        assert [[s, v] for s, v in zip(x, a_eval) if v is not None] == a.evals
        assert [[s, v] for s, v in zip(x, b_loss) if v is not None] == b.printed
        assert [[s, v] for s, v in zip(x, b_eval) if v is not None] == b.evals
        assert page.url == tracker.url + "/run/a?poll=0.2&compare=b"
        assert [row[0] for row in legend(page, "loss")] == labels
        assert legend(page, "loss")[3][1] == fmt4(b.printed[-1][1])
        assert len(series(page, "lr")) == 2  # only the loss chart compares
        page.screenshot(path=str(tmp_path / "curves-compare.png"), full_page=True)
        page.reload()  # the same page again: ?compare= draws it at once
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length") == 5 and len(series(page)) == 5, 30,
                 "the comparison after a reload")
        assert js(page, "document.getElementById('compare').value") == "b"
        page.select_option("#compare", "")
        wait_for(lambda: len(series(page)) == 3, 30, "a alone again")
        assert page.url == tracker.url + "/run/a?poll=0.2"

        # -- a run of an older agent: its curve from its beats, one point a beat
        page.goto(tracker.url + "/run/old?poll=0.2")
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length") == 5, 30, "the old agent's run")
        assert series(page)[:2] == [[100, 200, 300, 400, 500], [2.9, 2.8, 2.7, 2.6, 2.5]]
        assert js(page, "window.onboxDashboard.served") is True  # the tracker serves points; this run has none
        assert [c for c, on in shown(page) if on] == ["chart-loss"]

        # -- a tracker older than the trainer's points: its answers carry no `trainer`; a's curves from its beats
        def older(route):
            resp = route.fetch()
            body = resp.json()
            body.pop("trainer", None)
            route.fulfill(response=resp, body=json.dumps(body))

        page.route("**/api/v1/runs/*/series*", older)
        page.goto(tracker.url + "/run/a?poll=0.2")
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length") == 5, 30, "a's page on an older tracker")
        beat_steps = [bt["progress"]["step"] for bt in beats_stored(tracker, "a") if bt["progress"]["step"]]
        assert series(page)[0] == sorted(set(beat_steps)) and js(page, "window.onboxDashboard.served") is False
        assert len(beat_steps) < 10
        page.unroute("**/api/v1/runs/*/series*")
        assert problems == []
    finally:
        tracker.stop()
