"""The tracker's goodput ledgers and /metrics, through the real app in-process on a real store: the recorded scenarios
(tests/fixtures/goodput/) posted as beats give, through the tracker's SQL fold, the ledger the pure function gives;
a beat arriving below its run's newest seq folds the run again; reads take the token; bad query values are a 400;
the exposition's families, samples and escapes; a run page's facts from the launch records and the inventory."""
from __future__ import annotations

import json
import os
import warnings

import pytest

from controller.goodput.fold import fold
from controller.goodput.ledger import ledger_of
from controller.tracker.app import create_app
from controller.tracker.metrics import label
from controller.tracker.store import open_store
from tests.goodput_timeline import load_fixture

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

TOKEN = "t0ken"
AUTH = {"Authorization": "Bearer " + TOKEN}
OM = dict(AUTH, Accept="application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5")


def doc_of(run, b):
    """A heartbeat document carrying what a recorded Beat holds."""
    doc = {"schema": "onbox.heartbeat/1", "run": run, "box": b.box, "attempt": b.attempt, "seq": b.seq,
           "time": b.time, "state": b.state, "interval_s": b.interval,
           "progress": {"step": b.step, "time": b.step_time},
           "times": {"agent_started_at": b.agent_at, "setup_at": b.setup_at, "child_started_at": b.child_at},
           "checkpoint": {"latest_durable": {"name": "c", "step": b.durable_step, "committed_at": b.durable_at}
                          if b.durable_step is not None else None,
                          "latest_local": {"name": "l", "step": b.local_step} if b.local_step is not None else None},
           "alerts": [{"code": "stall", "severity": "warning"}] if b.stalled else [],
           "preemption": {"source": "signal:SIGTERM"} if b.preempted else None,
           "phase": {"index": b.phase, "count": 9} if b.phase is not None else None}
    if b.first_point is not None:
        doc["points"] = {"time": [b.first_point[0]], "step": [b.first_point[1]]}
    return doc


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def app(tmp_path):
    clock = Clock()
    store = open_store(str(tmp_path / "t.db"), now=clock)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    with TestClient(create_app(store, TOKEN, thin_every_s=0, pulls_record=str(cfg / "pulls.json"))) as c:
        c.clock, c.cfg = clock, cfg
        yield c
    store.close()


def post(client, run, beats):
    r = client.post("/api/v1/heartbeats", json={"heartbeats": [doc_of(run, b) for b in beats]}, headers=AUTH)
    assert r.status_code == 200, r.text


SCENARIOS = ["crash_loop", "fenced_box", "preempted_mid_interval", "recovery_onto_a_spare", "slurm_requeue"]


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_trackers_ledger_of_a_recorded_scenario_is_the_pure_functions(app, name):
    sc = load_fixture(name)
    beats = sorted(sc["beats"], key=lambda b: b.seq)
    newest = beats[-1]
    app.clock.t = newest.time  # received when sent; a run's "now" is its box's clock: its newest beat plus the age
    post(app, sc["run"], beats)
    if sc["now"] is not None:
        app.clock.t = sc["now"]
    got = app.get("/api/v1/goodput", params={"run": sc["run"], "segments": 1}, headers=AUTH).json()["runs"][0]
    want = ledger_of(fold(beats).contexts, sc["now"] if sc["now"] is not None else newest.time).to_dict()
    for key in ("parts", "kept_steps", "recomputed_steps", "restarts", "preemptions", "by_box", "overlap_s"):
        assert got[key] == want[key], key
    assert [x["why"] for x in got["losses"]] == sc["expect"]["losses"]
    assert sum(got["parts"].values()) == pytest.approx(got["wall_s"], abs=0.01)


def test_a_beat_below_the_newest_folds_the_run_again(app):
    sc = load_fixture("fenced_box")
    beats = sorted(sc["beats"], key=lambda b: b.seq)
    b0 = [b for b in beats if b.box == "b0"]
    s0 = [b for b in beats if b.box == "s0"]
    app.clock.t = s0[-1].time
    post(app, sc["run"], b0[:3] + s0)  # the spare's beats first: b0's spooled ones arrive after the heal
    first = app.get("/api/v1/goodput", params={"run": sc["run"]}, headers=AUTH).json()["runs"][0]
    post(app, sc["run"], b0[3:])
    again = app.get("/api/v1/goodput", params={"run": sc["run"]}, headers=AUTH).json()["runs"][0]
    want = ledger_of(fold(beats).contexts, sc["now"] if sc["now"] is not None else s0[-1].time).to_dict()
    assert first["kept_steps"] != again["kept_steps"] or first["losses"] != again["losses"]
    assert again["kept_steps"] == want["kept_steps"] and again["recomputed_steps"] == want["recomputed_steps"]
    assert [x["why"] for x in again["losses"]] == ["fenced", "preempted"]


def test_reads_take_the_token_and_bad_values_are_a_400(app):
    assert app.get("/api/v1/goodput").status_code == 401
    assert app.get("/metrics").status_code == 401
    assert app.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    for q in ({"since": "yesterday"}, {"since": "-5"}, {"until": "1e400"}, {"run": "../etc"}, {"since": "nan"}):
        r = app.get("/api/v1/goodput", params=q, headers=AUTH)
        assert r.status_code == 400 and "error" in r.json(), (q, r.text)
    assert app.get("/api/v1/goodput", params={"run": "nobody"}, headers=AUTH).json()["runs"] == []


def test_a_window_cuts_every_runs_ledger(app):
    sc = load_fixture("preempted_mid_interval")
    beats = sorted(sc["beats"], key=lambda b: b.seq)
    app.clock.t = beats[-1].time
    post(app, "w", beats)
    whole = app.get("/api/v1/goodput", headers=AUTH).json()["runs"][0]
    mid = (whole["start"] + whole["end"]) / 2
    half = app.get("/api/v1/goodput", params={"since": mid}, headers=AUTH).json()["runs"][0]
    assert half["wall_s"] == pytest.approx(whole["end"] - mid, abs=0.01)
    assert sum(half["parts"].values()) == pytest.approx(half["wall_s"], abs=0.01)


def test_metrics_families_samples_and_label_escapes(app):
    app.clock.t = 1000.0
    odd = 'gpu "1"\\\nx'
    beat = {"schema": "onbox.heartbeat/1", "run": "r1", "box": odd, "attempt": 0, "seq": 1, "time": 1000.0,
            "state": "running", "interval_s": 30, "progress": {"step": 7, "loss": "NaN", "time": 999.0},
            "checkpoint": {"latest_durable": {"name": "s5", "step": 5, "committed_at": 990.0}},
            "alerts": [{"code": "nan_loss", "severity": "critical"}],
            "gpus": {"available": True, "gpus": [{"index": 0, "name": "H100", "util_percent": 50.0,
                                                  "memory_used_bytes": 2 * 2**20, "memory_total_bytes": 8 * 2**20,
                                                  "xid_events": [{"xid": 48}, {"xid": 79}]}]}}
    assert app.post("/api/v1/heartbeats", json={"heartbeats": [beat]}, headers=AUTH).status_code == 200
    r = app.get("/metrics", headers=OM)
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    text = r.text
    assert text.endswith("# EOF\n")
    lines = text.splitlines()
    assert 'onbox_run_info{run="r1",box="%s",profile="",pool="",state="running"} 1' % label(odd) in lines
    assert label(odd) == 'gpu \\"1\\"\\\\\\nx'  # backslash, quote and newline escaped: one line, one label
    assert 'onbox_run_loss{run="r1"} NaN' in lines and 'onbox_run_step{run="r1"} 7' in lines
    assert 'onbox_run_work_at_risk_steps{run="r1"} 2' in lines and 'onbox_run_work_at_risk_seconds{run="r1"} 9.0' \
        in lines
    assert 'onbox_run_alert{run="r1",code="nan_loss",severity="critical"} 1' in lines
    assert 'onbox_run_restarts_total{run="r1"} 0' in lines and "# TYPE onbox_run_restarts counter" in lines
    gpu = '{gpu="0",modelName="H100",Hostname="%s",run="r1"}' % label(odd)
    assert "DCGM_FI_DEV_FB_USED%s 2.0" % gpu in lines and "DCGM_FI_DEV_FB_FREE%s 6.0" % gpu in lines
    assert "DCGM_FI_DEV_XID_ERRORS%s 79" % gpu in lines  # the last Xid, as DCGM's field says
    # every sample belongs to the family declared above it, each family once
    families, current = [], None
    for line in lines:
        if line.startswith("# TYPE "):
            current = line.split()[2]
            families.append(current)
        elif line and not line.startswith("#"):
            assert current and line.startswith(current), line
    assert len(families) == len(set(families))
    plain = app.get("/metrics", headers=AUTH)  # curl's Accept: the classic format of the same samples
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# EOF" not in plain.text and "# TYPE onbox_run_info gauge" in plain.text


def test_a_run_page_says_how_the_run_was_launched_and_what_comes_next(app):
    cfg = app.cfg
    (cfg / "boxes.toml").write_text('[boxes.b0]\nhost = "h"\nprofile = "runpod"\npool = "a100"\nprice = 0.44\n')
    (cfg / "launches.json").write_text(json.dumps({"schema": "onboxctl.launches/1", "launches": [
        {"run": "pg", "box": "b0", "command": ["python", "train.py", "--lr", "3e-4"], "durable": "/mnt/d",
         "workdir": "/w", "ckpt_dir": "/c", "at": 100.0}]}))
    os.chmod(str(cfg / "launches.json"), 0o600)
    sc = load_fixture("preempted_mid_interval")
    beats = sorted(sc["beats"], key=lambda b: b.seq)
    first_life = [b for b in beats if b.attempt == 0]
    app.clock.t = first_life[-1].time
    post(app, "pg", [b.__class__(**dict(b.__dict__, box="b0")) for b in first_life])  # preempted, waiting
    page = app.get("/api/v1/runs/pg/series", headers=AUTH).json()["summary"]["page"]
    assert page["command"] == ["python", "train.py", "--lr", "3e-4"] and page["durable"] == "/mnt/d"
    assert (page["profile"], page["pool"], page["price"]) == ("runpod", "a100", 0.44)
    assert page["started_at"] == pytest.approx(first_life[0].setup_at) and page["elapsed_s"] > 0
    assert page["interval_s"] == first_life[-1].interval and page["at_risk"]["durable_step"] is not None
    assert page["next_step"]["by"] == "you" and "onboxctl run b0 -- python train.py --lr 3e-4" in \
        page["next_step"]["text"]
    led = page["ledger"]
    assert sum(led["parts"].values()) == pytest.approx(led["wall_s"], abs=0.01)
    assert led["money"]["parts"]["productive"] == pytest.approx(led["parts"]["productive"] / 3600 * 0.44, abs=1e-4)


def test_the_next_step_names_the_keeper_or_slurm_when_they_bring_the_run_back():
    from controller.tracker.runpage import next_step

    keeper = [{"kind": "declared_lost", "recovery": 2, "text": "declared gpu1 lost"}]
    assert next_step("r", "preempted", "ended", 40, keeper, None, None, "b")["by"] == "keeper"
    gave_up = [{"kind": "failed_no_resource", "text": "no spare"}]
    said = next_step("r", "preempted", "ended", 40, gave_up, None, None, "b")
    assert said["by"] == "you" and "--recover" in said["text"] and "from step 40" in said["text"]
    slurm = next_step("r", "preempted", "ended", 40, [], "77", None, "b")
    assert slurm["by"] == "slurm" and "job 77" in slurm["text"]
    assert next_step("r", "running", "ok", 40, [], None, None, "b") is None  # a run that trains needs nothing
    assert next_step("r", "done", "ended", 40, [], None, None, "b") is None
    assert next_step("r", "fenced", "ended", 40, [], None, None, "b")["by"] == "none"
