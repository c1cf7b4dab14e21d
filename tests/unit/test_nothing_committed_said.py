"""The truth on every screen (issue 32, items 5 and 7), through the controller's real readers: the "box" is this
machine, its agent's own `--json` commands run for real (test_controller_contract.LocalBox), the tracker is the
real app in-process on a real store.

- `onboxctl status` over ssh shows the box's warnings as alerts (a WARN line under the run), and DURABLE CKPT says
  `none` when nothing is committed, never the durable dir's last part (the run's own name);
- `onboxctl stop --wait` (its `onbox status RUN --json`), `pull` and `down` say why nothing was committed;
- work at risk is measured from the durable checkpoint's step time, and the dashboard's run list and run page show
  the figure `onboxctl status` shows, with the agent's alerts in full.
"""
from __future__ import annotations

import json
import warnings

import pytest

from controller.commands.status import box_rows
from controller.launch import stop as st
from controller.results.pull import PullsRecord, pull_run, remote_run
from controller.results.teardown import judge_run
from controller.tracker.app import create_app
from controller.tracker.runview import at_risk_label, render_table, row_from_heartbeat, rows_from_tracker
from controller.tracker.store import open_store
from onbox.errors import JobFailed
from tests.unit.test_controller_contract import BOX, LocalBox

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

WARNING = "3 files in /ck, none a checkpoint: state_000040.txt, state_000060.txt and 1 more are *.txt, a name onbox " \
          "ignores by default (logs, notes, tables, images) — if they are the trainer's saves, pass --ckpt-pattern '*.txt'"


def _box_with_a_run_that_committed_nothing(tmp_path, state="stopped"):
    """A run on the "box" whose trainer saved state_*.txt into its checkpoint dir: nothing counted, nothing was
    committed; the agent's checkpoint status holds its `no_checkpoint` warning."""
    home, durable, ckpt = tmp_path / "home", tmp_path / "durable", tmp_path / "ck"
    rd = home / "runs" / "r"
    rd.mkdir(parents=True)
    ckpt.mkdir()
    for step in (20, 40, 60):
        (ckpt / ("state_%06d.txt" % step)).write_text(json.dumps({"step": step}))
    (rd / "config.json").write_text(json.dumps({"name": "r", "durable": str(durable), "ckpt_dir": str(ckpt)}))
    (rd / "state.json").write_text(json.dumps({"run": "r", "state": state, "attempt": 0, "ckpt_dir": str(ckpt)}))
    (rd / "checkpoint_status.json").write_text(json.dumps({
        "schema": "onbox.checkpoint_status/1", "run": "r", "latest_local": None, "latest_durable": None,
        "durable": str(durable / "r"), "warning": WARNING, "warning_code": "no_checkpoint",
        "warning_hint": "until one counts nothing is committed"}))
    return LocalBox(str(home)), str(durable / "r"), str(ckpt)


def test_status_over_ssh_shows_the_boxs_warning_and_none_for_nothing_committed(tmp_path):
    box, _, _ = _box_with_a_run_that_committed_nothing(tmp_path, state="running")
    [row] = box_rows(box, BOX)  # type: ignore[arg-type]
    assert row.checkpoint == "none"  # not "r", the last part of its durable dir
    assert row.alerts == ["no_checkpoint"]
    assert row.alert_details == [{"code": "no_checkpoint", "severity": "warning", "message": WARNING,
                                  "hint": "until one counts nothing is committed"}]
    lines = render_table([row]).splitlines()
    assert lines[1].split()[9] == "none" and lines[1].endswith("! no_checkpoint")
    assert lines[2] == "  WARN no_checkpoint: %s — until one counts nothing is committed" % WARNING


def test_stop_pull_and_down_say_why_nothing_was_committed(tmp_path):
    box, durable, ckpt = _box_with_a_run_that_committed_nothing(tmp_path)
    why = ("nothing committed to %s: 3 files in %s, none a checkpoint: state_000040.txt, state_000060.txt and 1 more "
           "are *.txt, a name onbox ignores by default" % (durable, ckpt))
    # onboxctl stop --wait: the run's status once it has ended, read as the stop reads it
    doc = st.run_status(box, BOX, "r")  # type: ignore[arg-type]
    assert doc["nothing_committed"].startswith(why), doc.get("nothing_committed")
    report = st.StopReport(box="b1", run="r", outcome="ended", durable=durable,
                           nothing_committed=doc["nothing_committed"])
    assert st.checkpoint_line(report).startswith(why)
    # onboxctl pull: a stopped run is not told to "wait for the first sync"
    info = remote_run(box, BOX, "r")  # type: ignore[arg-type]
    assert info["nothing_committed"].startswith(why)
    with pytest.raises(JobFailed) as e:
        pull_run(box, BOX, "r", str(tmp_path / "results"))  # type: ignore[arg-type]
    assert e.value.message.startswith("run r on b1 (stopped) has no committed checkpoint: " + why)
    assert "wait for the first sync" not in e.value.message + (e.value.hint or "")
    # onboxctl down: the gate's reason names it
    verdict = judge_run("b1", info, PullsRecord(str(tmp_path / "pulls.json")))
    assert verdict.blocking and why in verdict.reason


NOW = 1_800_000_000.0


def _beat(seq, **kw):
    beat = {"schema": "onbox.heartbeat/1", "run": "r", "box": "gpu1", "attempt": 0, "seq": seq, "time": NOW,
            "state": "running", "interval_s": 5.0, "progress": {"step": 1200, "loss": 0.5, "time": NOW - 1},
            # step 1000 was reported at NOW-301 and committed a sync interval later, at NOW-241
            "checkpoint": {"latest_durable": {"name": "state_001000.json", "step": 1000, "committed_at": NOW - 241,
                                              "step_time": NOW - 301}, "durable": "/d/r"}}
    beat.update(kw)
    return beat


def test_work_at_risk_is_measured_from_the_checkpoints_step_not_its_commit():
    row = row_from_heartbeat(_beat(1), now=NOW)
    assert (row.at_risk["steps"], row.at_risk["seconds"]) == (200, 300.0)
    assert at_risk_label(row) == "5m/200"
    older = _beat(1)  # an agent that does not say the step time: from the commit, as before
    del older["checkpoint"]["latest_durable"]["step_time"]
    assert row_from_heartbeat(older, now=NOW).at_risk["seconds"] == 240.0


class _Clock:
    t = NOW

    def __call__(self):
        return self.t


def test_the_dashboard_shows_what_onboxctl_status_shows(tmp_path):
    store = open_store(str(tmp_path / "t.db"), now=_Clock())
    auth = {"Authorization": "Bearer tok"}
    alert = {"code": "no_checkpoint", "severity": "warning", "message": WARNING, "hint": "until one counts"}
    nothing = _beat(1, run="fresh", checkpoint={"latest_durable": None, "durable": "/d/fresh"}, alerts=[alert])
    try:
        with TestClient(create_app(store, "tok", thin_every_s=0)) as c:
            assert c.post("/api/v1/heartbeats", json={"heartbeats": [_beat(1), nothing]}, headers=auth).status_code \
                == 200
            rows = {r.run: r for r in rows_from_tracker(c.get("/api/v1/runs", headers=auth).json(), now=NOW)}
            listed = {r["run"]: r for r in c.get("/api/v1/overview?after=-1", headers=auth).json()["runs"]}
            for run in ("r", "fresh"):  # the run list: the same AT RISK, durable cell and alerts
                assert listed[run]["at_risk_text"] == at_risk_label(rows[run])
                assert listed[run]["checkpoint"] == rows[run].checkpoint
            assert listed["r"]["at_risk_text"] == "5m/200" and listed["fresh"]["checkpoint"] == "none"
            assert listed["fresh"]["alerts"] == [alert]  # "Open alerts" and the list's count read these
            page = c.get("/api/v1/runs/r/series", headers=auth).json()["summary"]["page"]
            assert page["at_risk"] == {"steps": 200, "seconds": 300.0, "durable_step": 1000, "text": "5m/200"}
    finally:
        store.close()


@pytest.mark.parametrize("state", ["running", "preempted"])
def test_pull_of_a_run_with_nothing_committed_names_its_state(tmp_path, state):
    box, _, _ = _box_with_a_run_that_committed_nothing(tmp_path, state=state)
    with pytest.raises(JobFailed) as e:
        pull_run(box, BOX, "r", str(tmp_path / "results"))  # type: ignore[arg-type]
    assert e.value.message.startswith("run r on b1 (%s) has no committed checkpoint: nothing committed to " % state)
    assert "a live run commits a complete checkpoint at its next sync" in e.value.hint
