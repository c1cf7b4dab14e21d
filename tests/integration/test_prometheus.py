"""The tracker's /metrics against a real Prometheus (Debian's 2.42, tests/hosts/prometheus.py): started on loopback
with its own config and data dir, it scrapes a real tracker (`onboxctl tracker serve`) with the bearer token from a
credentials file, its query API returns the runs' and GPUs' series, and the example rules shipped in
profiles/prometheus/onbox-rules.yml pass `promtool check rules` and fire on the runs that should fire them (a run
silent, a run with half an hour at risk, a run whose last day was mostly down, a crash loop) and not on a healthy
one. The rules are the shipped file's, with its durations shortened: `for:` to 1 s, the silence to 3 s, the day and
the half hour to seconds. A scrape with the wrong token is refused (the target is down, 401)."""
from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from tests.conftest import REPO_ROOT
from tests.hosts.prometheus import PrometheusProcess, missing
from tests.hosts.tracker import TrackerProcess
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RULES = os.path.join(REPO_ROOT, "profiles", "prometheus", "onbox-rules.yml")
SHORT = [("> 300", "> 3"), ("[1d]", "[15s]"), ("[30m]", "[1m]"), ("for: 1m", "for: 1s"), ("for: 5m", "for: 1s"),
         ("for: 1h", "for: 1s")]
GPU = {"available": True, "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-%d" % i,
                                    "util_percent": 90.0 + i, "memory_used_bytes": 70 * 2**30,
                                    "memory_total_bytes": 80 * 2**30, "temperature_c": 65, "power_w": 612.5,
                                    "sm_clock_mhz": 1980, "throttle_mask": 4, "xid_events": [{"xid": 79}] if i else [],
                                    "ecc": {"corrected_volatile": 2, "uncorrected_volatile": 0}} for i in range(2)]}


@pytest.fixture(scope="module", autouse=True)
def _prometheus_installed():
    why = missing()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)


def beat(run, seq, t, state="running", attempt=0, step=None, step_time=None, durable=None, durable_at=None,
         interval=0.5, gpus=None, alerts=None, agent=None):
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": "gpu-" + run, "attempt": attempt, "seq": seq,
           "time": t, "state": state, "interval_s": interval,
           "progress": {"step": step, "loss": 2.5, "tokens_per_s": 51234.5, "time": step_time},
           "times": {"agent_started_at": agent, "setup_at": agent, "child_started_at": agent}}
    if durable is not None:
        doc["checkpoint"] = {"latest_durable": {"name": "step-%d" % durable, "step": durable,
                                                "committed_at": durable_at}}
    if gpus:
        doc["gpus"] = gpus
    if alerts:
        doc["alerts"] = alerts
    return doc


class Beating(threading.Thread):
    """Beats of live runs, every 0.5 s until stopped (one request each, bounded)."""

    def __init__(self, tracker, runs):
        super().__init__(daemon=True)
        self.tracker, self.runs, self.halt = tracker, runs, threading.Event()
        self.seq = int(time.time() * 1000)

    def run(self):
        while not self.halt.wait(0.5):
            now = time.time()
            self.seq += 1
            batch = [make(self.seq, now) for make in self.runs]
            self.tracker.post(batch).raise_for_status()


def test_prometheus_scrapes_the_tracker_queries_its_series_and_fires_the_example_alerts(tmp_path):
    r = subprocess.run(["promtool", "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 4 rules found" in r.stdout, r.stdout + r.stderr
    with open(RULES) as f:
        rules = f.read()
    for long, short in SHORT:
        assert long in rules, long
        rules = rules.replace(long, short)
    short_rules = str(tmp_path / "onbox-rules.yml")
    with open(short_rules, "w") as f:
        f.write(rules)
    tracker = TrackerProcess(str(tmp_path / "tracker")).start()
    wrong = str(tmp_path / "wrong.token")
    with open(wrong, "w") as f:
        f.write("not-the-token\n")
    prom = bad = beating = None
    try:
        now = time.time()
        t0 = now - 7200  # runs that began two hours ago (on their boxes' clocks)
        # a run that stopped beating (silent), a run preempted long ago and still waiting (its day mostly down),
        # and the first life of a run that will crash-loop
        assert tracker.post([
            beat("quiet", 1, now, step=10, step_time=now, agent=now - 5),
            beat("waiting", 1, t0, step=1, step_time=t0, agent=t0 - 1, interval=30),
            beat("waiting", 2, t0 + 600, step=600, step_time=t0 + 600, durable=600, durable_at=t0 + 600,
                 agent=t0 - 1, interval=30),
            beat("waiting", 3, t0 + 601, state="preempted", step=600, step_time=t0 + 600, durable=600,
                 durable_at=t0 + 600, agent=t0 - 1, interval=30),
            # relaunched just now, and preempted again at once: its newest beat is fresh, its run mostly down
            beat("waiting", 4, now - 3, attempt=1, step=601, step_time=now - 3, durable=600, durable_at=t0 + 600,
                 agent=now - 5, interval=30),
            beat("waiting", 5, now - 1, state="preempted", attempt=1, step=602, step_time=now - 2, durable=602,
                 durable_at=now - 1.5, agent=now - 5, interval=30),
            beat("looping", 1, now, step=5, step_time=now, agent=now - 1),
        ]).status_code == 200
        healthy_start = t0

        def healthy(seq, t):  # trains steadily since two hours ago, commits every few seconds
            step = int(t - healthy_start)
            return beat("healthy", seq, t, step=step, step_time=t, durable=step - step % 5, durable_at=t - (step % 5),
                        gpus=GPU, agent=healthy_start - 1)

        def risky(seq, t):  # trains, but nothing committed for an hour
            return beat("risky", seq, t, step=int(t), step_time=t, durable=1, durable_at=t - 3600, agent=now - 1)

        assert tracker.post([beat("healthy", 1, healthy_start, step=0, step_time=healthy_start,
                                  agent=healthy_start - 1)]).status_code == 200
        beating = Beating(tracker, [healthy, risky])
        beating.start()
        prom = PrometheusProcess(str(tmp_path / "prometheus"), ["127.0.0.1:%d" % tracker.port],
                                 token_file=tracker.token_file, rule_files=[short_rules]).start()
        bad = PrometheusProcess(str(tmp_path / "prometheus-bad"), ["127.0.0.1:%d" % tracker.port],
                                token_file=wrong).start()
        # scraped with the token; refused without it
        wait_for(lambda: [t for t in prom.targets() if t["health"] == "up"], 30, "the tracker scraped")
        refused = wait_for(lambda: [t for t in bad.targets() if t["health"] == "down"], 30, "the wrong token refused")
        assert "401" in refused[0]["lastError"], refused
        # the series, as Prometheus stored them
        got = wait_for(lambda: prom.query('onbox_run_step{run="healthy"}'), 30, "the healthy run's step")
        assert float(got[0]["value"][1]) > 7000
        info = prom.query('onbox_run_info{run="healthy"}')
        assert info and info[0]["metric"]["state"] == "running" and info[0]["metric"]["box"] == "gpu-healthy"
        gpus = prom.query('DCGM_FI_DEV_GPU_UTIL{run="healthy"}')
        assert sorted((g["metric"]["gpu"], g["metric"]["modelName"], float(g["value"][1])) for g in gpus) == [
            ("0", "NVIDIA H100 80GB HBM3", 90.0), ("1", "NVIDIA H100 80GB HBM3", 91.0)]
        assert float(prom.query('DCGM_FI_DEV_FB_FREE{run="healthy",gpu="0"}')[0]["value"][1]) == 10240.0
        assert float(prom.query('DCGM_FI_DEV_XID_ERRORS{run="healthy",gpu="1"}')[0]["value"][1]) == 79.0
        parts = {x["metric"]["part"]: float(x["value"][1])
                 for x in prom.query('onbox_run_ledger_seconds{run="waiting"}')}
        wall = float(prom.query('onbox_run_wall_seconds{run="waiting"}')[0]["value"][1])
        assert set(parts) == {"productive", "recomputed", "down", "restoring", "starting", "stalled"}
        assert sum(parts.values()) == pytest.approx(wall, abs=0.01) and parts["down"] > 6000
        assert prom.query('onbox_run_preemptions_total{run="waiting"}')[0]["value"][1] == "2"
        # the crash loop: three restarts after Prometheus saw the first life
        assert tracker.post([
            beat("looping", 2, time.time(), state="backoff", step=6, step_time=time.time(), agent=now - 1),
            beat("looping", 3, time.time(), attempt=1, step=7, step_time=time.time(), agent=now - 1),
            beat("looping", 4, time.time(), state="backoff", attempt=1, step=7, step_time=time.time(), agent=now - 1),
            beat("looping", 5, time.time(), attempt=2, step=7, step_time=time.time(), agent=now - 1),
            beat("looping", 6, time.time(), state="backoff", attempt=2, step=7, step_time=time.time(), agent=now - 1),
            beat("looping", 7, time.time(), attempt=3, step=7, step_time=time.time(), agent=now - 1),
        ]).status_code == 200

        want = {("OnboxRunSilent", "quiet"), ("OnboxWorkAtRisk", "risky"), ("OnboxLowGoodput", "waiting"),
                ("OnboxCrashLoop", "looping")}

        def firing():
            got = {(a["labels"]["alertname"], a["labels"].get("run")) for a in prom.alerts() if a["state"] == "firing"}
            return got if want <= got else None

        fired = wait_for(firing, 90, "the four alerts firing", 0.5)
        assert not [a for a in fired if a[1] == "healthy"], fired  # a healthy run fires nothing
        assert ("OnboxRunSilent", "waiting") not in fired  # a preempted run is not silent: it ended
    finally:
        if beating is not None:
            beating.halt.set()
            beating.join(10)
        for p in (prom, bad):
            if p is not None:
                p.stop()
        tracker.stop()


def test_the_shipped_rules_pass_promtool_and_the_exposition_passes_its_linter(tracker):
    r = subprocess.run(["promtool", "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    now = time.time()
    assert tracker.post([beat("lint", 1, now, step=3, step_time=now, durable=2, durable_at=now - 1, gpus=GPU,
                              alerts=[{"code": "stall", "severity": "warning", "message": "m", "hint": "h"}],
                              agent=now - 2)]).status_code == 200
    import requests

    text = requests.get(tracker.url + "/metrics", headers=tracker.headers(), timeout=30).text
    assert "# EOF" not in text and "# TYPE onbox_run_info gauge" in text  # curl's format: the classic one
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = [x for x in (lint.stdout + lint.stderr).splitlines() if x.strip()]
    # the one thing it says: DCGM's own label names (modelName, Hostname, UUID) are camelCase, kept so that DCGM's
    # dashboards read these series as they are
    assert problems and all(x.startswith("DCGM_FI_DEV_") and x.endswith(
        "label names should be written in 'snake_case' not 'camelCase'") for x in problems), problems
