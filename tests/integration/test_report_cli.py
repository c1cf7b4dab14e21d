"""`onboxctl report` in a subprocess against a real tracker (`onboxctl tracker serve`) holding the beats of recorded
scenarios (tests/fixtures/goodput/): a line per run, box, profile or pool whose parts sum to its wall time, priced from
the inventory and prices.toml, the same figures in --json; and each bad input one line with its exit code, no
traceback: a bad --since or --by, no tracker, a tracker that does not answer, a refused token, a tracker older than
the ledgers, a run it does not know."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env
from tests.goodput_timeline import load_fixture
from tests.unit.test_tracker_goodput import doc_of

pytestmark = pytest.mark.integration


@pytest.fixture
def filled(tracker, tmp_path):
    """The tracker with two recorded runs (a crash loop on g1, a recovery from b0 onto s0) and a config dir whose
    inventory says each box's profile, pool and price."""
    for name, run, rename in (("crash_loop", "loop", {"vm": "g1"}), ("recovery_onto_a_spare", "moved", {})):
        beats = load_fixture(name)["beats"]
        docs = [doc_of(run, dataclasses.replace(b, box=rename.get(b.box, b.box))) for b in beats]
        assert tracker.post(docs).status_code == 200
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "boxes.toml").write_text('[boxes.g1]\nhost = "h"\nprofile = "runpod"\npool = "a100"\nprice = 3.6\n'
                                    '[boxes.b0]\nhost = "h"\nprofile = "vastai"\npool = "a100"\n'
                                    '[boxes.s0]\nhost = "h"\nprofile = "vastai"\npool = "spare"\n')
    (cfg / "prices.toml").write_text("[profiles]\nvastai = 36.0\n")
    return tracker, cfg


def report(tracker, cfg, *args, token=None, url=None):
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(cfg), "ONBOX_TRACKER": url or tracker.url,
                          "ONBOX_TRACKER_TOKEN": tracker.token if token is None else token})
    return subprocess.run([sys.executable, "-m", "controller", "report", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_report_by_run_box_profile_and_pool_adds_up_and_prices_each_box(filled):
    tracker, cfg = filled
    doc = json.loads(report(tracker, cfg, "--json").stdout)
    runs = {r["run"]: r for r in doc["runs"]}
    assert set(runs) == {"loop", "moved"}
    for g in doc["groups"]:
        assert sum(g["parts"].values()) == pytest.approx(g["wall_s"], abs=0.01)
    loop = next(g for g in doc["groups"] if g["key"] == "loop")
    assert loop["parts"] == runs["loop"]["parts"] and loop["losses"] == 3 and loop["recomputed_steps"] == 15
    assert loop["money"]["total"] == pytest.approx(runs["loop"]["wall_s"] / 3600 * 3.6, abs=1e-3)
    moved = next(g for g in doc["groups"] if g["key"] == "moved")  # b0 and s0 at vastai's price from prices.toml
    assert moved["money"]["total"] == pytest.approx(runs["moved"]["wall_s"] / 3600 * 36.0, abs=1e-3)
    # each figure is rounded to 4 places: their difference may differ from the rounded one by a unit of the last
    assert moved["money"]["lost"] == pytest.approx(moved["money"]["total"] - moved["money"]["parts"]["productive"],
                                                   abs=2e-4)
    by_profile = {g["key"]: g for g in json.loads(report(tracker, cfg, "--by", "profile", "--json").stdout)["groups"]}
    assert set(by_profile) == {"runpod", "vastai"}
    assert by_profile["runpod"]["wall_s"] == pytest.approx(runs["loop"]["wall_s"], abs=0.01)
    by_pool = {g["key"]: g for g in json.loads(report(tracker, cfg, "--by", "pool", "--json").stdout)["groups"]}
    spare, s0 = by_pool["spare"]["parts"], runs["moved"]["by_box"]["s0"]  # (the run waits, preempted: its down
    assert {k: v for k, v in spare.items() if k != "down"} == pytest.approx(  # time grows between two reads)
        {k: v for k, v in s0.items() if k != "down"}, abs=1e-3) and spare["down"] >= s0["down"]
    text = report(tracker, cfg, "--by", "box")
    assert text.returncode == 0 and not text.stderr, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("goodput since the runs began (tracker http://127.0.0.1:")
    assert lines[1].split()[:3] == ["BOX", "WALL", "GOODPUT"] and {x.split()[0] for x in lines[2:]} >= {
        "g1", "b0", "s0", "total"}
    one = report(tracker, cfg, "loop")
    assert one.returncode == 0 and [x.split()[0] for x in one.stdout.splitlines()[2:]] == ["loop"]


def test_report_since_a_window_takes_the_time_inside_it(filled):
    tracker, cfg = filled
    whole = json.loads(report(tracker, cfg, "--json").stdout)
    recent = json.loads(report(tracker, cfg, "--since", "1s", "--json").stdout)
    # the recorded runs ended long before the last second: nothing of them is in it
    assert all(g["wall_s"] == 0 for g in recent["groups"]) and whole["groups"][0]["wall_s"] > 0


@pytest.mark.parametrize("args,code,says", [
    (["--since", "soon"], 2, "--since 'soon' is not a duration"),
    (["--by", "colour"], 2, "Invalid value for '--by'"),
    (["no-such-run"], 2, "has no beats of run 'no-such-run'"),
    (["../x"], 2, "invalid run name"),
])
def test_a_bad_input_is_one_line_and_its_exit_code(filled, args, code, says):
    tracker, cfg = filled
    r = report(tracker, cfg, *args)
    assert r.returncode == code and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_no_tracker_a_silent_one_a_refused_token_and_an_older_tracker(filled, tmp_path):
    tracker, cfg = filled
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(cfg)})
    r = subprocess.run([sys.executable, "-m", "controller", "report"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "no tracker to read the ledgers from" in r.stderr, r.stderr
    r = report(tracker, cfg, url="http://127.0.0.1:9")  # nothing listens on port 9
    assert r.returncode == 3 and "cannot read the tracker at http://127.0.0.1:9" in r.stderr
    r = report(tracker, cfg, token="wrong")
    assert r.returncode == 2 and "refused the token (HTTP 401)" in r.stderr
    r = report(tracker, cfg, token="")  # none sent: said so, not "refused the token"
    assert r.returncode == 2 and "asks for a token and none was sent (HTTP 401)" in r.stderr, r.stderr
    from tests.hosts.tracker_stub import TrackerStub

    stub = TrackerStub().start()  # a tracker older than the ledgers: 404 to everything but its run list
    try:
        older = report(tracker, cfg, url=stub.url)
        stub.answer(200, b"<html>a proxy's page</html>")
        garbage = report(tracker, cfg, url=stub.url)
    finally:
        stub.stop()
    assert older.returncode == 3 and "older than `onboxctl report`" in older.stderr, older.stderr
    for res in (r, older):
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 2, res.stderr
    assert garbage.returncode == 3 and "Traceback" not in garbage.stderr
    assert sorted(os.listdir(str(cfg))) == ["boxes.toml", "prices.toml"]  # nothing written
