"""The dashboard's goodput and run facts in a real browser (Debian's chromium through Playwright: the fixtures of
tests/integration/test_dashboard_browser.py), against a real `onboxctl tracker serve`:

- a run page says what the run is: its command line, durable target (the launch record `onboxctl run` wrote), start
  and elapsed time (its ledger), box profile, pool and price (the inventory), heartbeat interval, work at risk, and
  for a run that stopped short the next step; and where its time went: a bar of its ledger's segments and a row per
  part, the same figures as `GET /api/v1/goodput`, adding up to its wall time;
- a legend shows each curve's NEWEST point: after a restart from scratch the run is at step 490, not at the 836 the
  first life reached; over time the curve breaks where nothing was reported (no flat line across the gap between
  two lives); a commit's tick sits at its checkpoint's step (500), not at the step of the beat that saw it (530);
- the run list carries the fleet's ledgers: one row per run with its goodput and its split.
"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
import requests

from tests.goodput_timeline import load_fixture
from tests.hosts.tracker import TrackerProcess
from tests.integration.test_dashboard_browser import browser, js  # noqa: F401 (the fixture)
from tests.polling import wait_for
from tests.unit.test_tracker_goodput import doc_of

pytestmark = pytest.mark.integration
COMMIT_RGB = (0x1A, 0x7F, 0x37)  # EVENT_COLORS.commit in dashboard.js


def scratch_run(t0):
    """Life 0 trains steps 1-836 (a beat a second, its 10 trainer records each; step 500 committed, seen by the beat
    at step 530); 200 s later life 1 starts over from scratch and trains to step 490."""
    beats, seq = [], 0
    for life, (first, last, loss0, start) in enumerate(((1, 836, 5.0, t0), (1, 490, 3.0, t0 + 300.0))):
        steps = list(range(first, last + 1))
        for k in range(0, len(steps), 10):
            chunk = steps[k:k + 10]
            seq += 1
            t = start + k / 10.0
            durable = 500 if life == 0 and chunk[-1] >= 530 else None
            beats.append({
                "schema": "onbox.heartbeat/1", "run": "scratch", "box": "b0", "attempt": life, "seq": seq, "time": t,
                "state": "running", "interval_s": 1.0,
                "times": {"agent_started_at": start - 2, "setup_at": start - 2, "child_started_at": start - 1},
                "progress": {"step": chunk[-1], "loss": round(loss0 - chunk[-1] * 0.001, 6), "time": t},
                "points": {"time": [t - 0.1 * (len(chunk) - 1 - j) for j in range(len(chunk))], "step": chunk,
                           "loss": [round(loss0 - s * 0.001, 6) for s in chunk]},
                "checkpoint": {"latest_durable": {"name": "step-500", "step": 500, "committed_at": t0 + 50.5}}
                if durable else None})
    return beats


def test_a_run_page_says_what_the_run_is_and_where_its_time_went(tmp_path, browser):  # noqa: F811
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "boxes.toml").write_text('[boxes.b0]\nhost = "h"\nprofile = "vastai"\npool = "a100"\nprice = 2.5\n'
                                    '[boxes.s0]\nhost = "h"\nprofile = "vastai"\npool = "a100"\nprice = 2.5\n')
    (cfg / "launches.json").write_text(json.dumps({"schema": "onboxctl.launches/1", "launches": [
        {"run": "moved", "box": "b0", "command": ["python", "train.py", "--lr", "3e-4", "--out", "my dir"],
         "durable": "/mnt/durable", "workdir": "/w", "ckpt_dir": "/c", "at": 1.0}]}))
    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True,
                             extra_args=["--pulls-record", str(cfg / "pulls.json")]).start()
    try:
        sc = load_fixture("recovery_onto_a_spare")
        assert tracker.post([doc_of("moved", b) for b in sc["beats"]]).status_code == 200
        page = browser.new_page()
        problems = []
        page.on("pageerror", lambda e: problems.append("pageerror: %s" % e))
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.goto(tracker.url + "/run/moved?poll=0.5")
        wait_for(lambda: page.query_selector("#ledger-bar .seg"), 30, "the ledger's bar")
        fact = {x["f"]: x["t"] for x in js(page, "Array.from(document.querySelectorAll('#run-facts dd')).map("
                                                 "d => ({f: d.dataset.fact, t: d.textContent}))")}
        assert fact["command"] == "python train.py --lr 3e-4 --out 'my dir'"
        assert fact["durable-target"] == "/mnt/durable" and fact["profile"] == "vastai (pool a100), 2.5 an hour"
        assert fact["heartbeat"] == "every %gs" % sc["beats"][-1].interval and fact["deadline"] == "none"
        assert fact["started"] != "-" and fact["elapsed"] != "-"
        assert fact["work-at-risk"].startswith("0 steps") and "(durable)" in fact["work-at-risk"]
        nxt = page.inner_text("#next-step")
        assert page.get_attribute("#next-step", "data-by") == "you"
        assert nxt.startswith("next: relaunch it: `onboxctl run b0 -- python train.py --lr 3e-4 --out 'my dir'`")
        api = requests.get(tracker.url + "/api/v1/goodput", params={"run": "moved", "segments": 1},
                                         timeout=30).json()["runs"][0]
        segs = js(page, "Array.from(document.querySelectorAll('#ledger-bar .seg')).map(s => s.dataset.part)")
        assert segs == [s[2] for s in api["segments"]][:len(segs)] and len(segs) >= len(api["segments"]) - 1
        rows = js(page, "Array.from(document.querySelectorAll('#ledger tr[data-part]')).map(r => "
                        "[r.dataset.part, parseFloat(r.cells[3].textContent)])")
        assert [p for p, _ in rows] == ["productive", "recomputed", "down", "restoring", "starting", "stalled"]
        assert sum(share for _, share in rows) == pytest.approx(100.0, abs=0.5)
        assert page.inner_text("#ledger-note").startswith("goodput ")
        assert "62 steps kept, 11 trained again over 2 losses" in page.inner_text("#ledger-note")
        cost = float(js(page, "document.querySelector('#ledger tr[data-part=\"productive\"]').cells[4].textContent"))
        assert cost == pytest.approx(api["parts"]["productive"] / 3600 * 2.5, abs=0.01)
        page.screenshot(path=str(tmp_path / "dashboard-run-goodput.png"), full_page=True)
        assert problems == []
        # the list: the fleet's ledgers, a row per run
        page.goto(tracker.url + "/?poll=0.5")
        row = wait_for(lambda: page.query_selector('#fleet-table tr[data-run="moved"]'), 30, "the fleet's row")
        shown = float(row.query_selector("td:nth-child(3)").inner_text().rstrip("%"))
        assert 0 < shown <= 100 * api["goodput"] + 0.05  # (it waits, preempted: its down time grows, goodput drops)
        assert len(row.query_selector_all(".ledger-bar .seg")) >= 3
        page.screenshot(path=str(tmp_path / "dashboard-list-goodput.png"), full_page=True)
    finally:
        tracker.stop()


def test_the_legend_shows_the_newest_point_the_time_axis_breaks_and_commits_tick_at_their_step(tmp_path,
                                                                                               browser):  # noqa: F811
    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()
    try:
        t0 = round(time.time() - 1000.0)
        assert tracker.post(scratch_run(t0)).status_code == 200
        page = browser.new_page()
        page.goto(tracker.url + "/run/scratch?poll=0.5")
        wait_for(lambda: js(page, "window.onboxDashboard.charts.length === 5 && window.onboxDashboard.charts[0]"
                                  ".data[0].length === 836"), 30, "the loss curve over steps")
        # over steps: the newest point is step 490 of the second life (loss 3.0 - 0.49), not step 836 of the first
        loss = js(page, "window.onboxDashboard.charts[0].onboxLatest")
        assert loss[1] == "2.51 @ step 490", loss
        legend = js(page, "document.querySelector('#chart-loss .u-legend .u-series:nth-child(2) .u-value')"
                          ".textContent")
        assert legend == "2.51 @ step 490"
        # the commit's tick: at step 500 (the checkpoint's), not 530 (the beat that saw it)
        commit = js(page, "window.onboxDashboard.events.filter(e => e.kind === 'commit')")
        assert [(e["ckpt_step"], e["step"]) for e in commit] == [(500, 530)]
        at = js(page, "(() => { const u = window.onboxDashboard.charts[0]; return [500, 530].map(v => "
                      "Math.round(u.valToPos(v, 'x', true))); })()")
        assert green_at_bottom(page, at[0]) and not green_at_bottom(page, at[1])
        # over time: no line across the 200 s between the two lives, a break (null) between them
        page.click("#x-time")
        wait_for(lambda: js(page, "window.onboxDashboard.charts[0].data[0][0] > 1e9"), 10, "the time axis")
        xs, ys = js(page, "[window.onboxDashboard.charts[0].data[0], window.onboxDashboard.charts[0].data[1]]")
        gaps = [(i, xs[i]) for i in range(len(xs)) if ys[i] is None]
        assert len(gaps) == 1 and t0 + 83.5 < gaps[0][1] < t0 + 298.0, gaps
        assert js(page, "window.onboxDashboard.charts[0].onboxLatest")[1] == "2.51"  # the newest is the latest
    finally:
        tracker.stop()


def green_at_bottom(page, x):
    """Whether the loss chart's canvas column x holds the commit colour in the bottom 8 px of its plot."""
    return js(page, """((x, rgb) => {
        const u = window.onboxDashboard.charts[0];
        const bottom = Math.round(u.bbox.top + u.bbox.height), px = u.ctx.getImageData(x, bottom - 8, 1, 8).data;
        for (let i = 0; i < px.length; i += 4)
            if (px[i] === rgb[0] && px[i + 1] === rgb[1] && px[i + 2] === rgb[2]) return true;
        return false;
    })(%d, %s)""" % (x, json.dumps(list(COMMIT_RGB))))


def test_a_recorded_scenario_is_the_same_ledger_on_the_page_as_from_the_api(tmp_path, browser):  # noqa: F811
    tracker = TrackerProcess(str(tmp_path / "tracker"), public_read=True).start()
    try:
        sc = load_fixture("crash_loop")
        assert tracker.post([doc_of("loop", dataclasses.replace(b)) for b in sc["beats"]]).status_code == 200
        page = browser.new_page()
        page.goto(tracker.url + "/run/loop?poll=0.5")
        wait_for(lambda: page.query_selector("#ledger tr[data-part]"), 30, "the ledger's rows")
        note = page.inner_text("#ledger-note")
        assert "24 steps kept, 15 trained again over 3 losses" in note, note
        assert not page.is_visible("#next-step") or "relaunch" in page.inner_text("#next-step")
    finally:
        tracker.stop()
