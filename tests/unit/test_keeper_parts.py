"""The keeper's parts one by one: durations, the provision command's contract (run for real: tiny scripts, a
timeout of a fraction of a second), what `onboxctl run --recover` checks and records, how a box's `onbox status
--json` and the tracker's run list read as observations, work at risk, and the status table with the keeper's
column (golden)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from controller.boxes.inventory import Box
from controller.goodput.atrisk import format_duration, work_at_risk
from controller.keeper.answers import beats_from_tracker, observation_from_status
from controller.keeper.enrol import check_recovery, enrol
from controller.keeper.policy import RecoveryPolicy, parse_duration
from controller.keeper.provision import ProvisionFailed, box_from_line, run_provision
from controller.keeper.records import KeepState, RecordStore, Recovery
from controller.keeper.view import apply_keeper
from controller.tracker.runview import render_table, rows_from_tracker
from onbox.errors import UsageError
from tests.golden import check_golden

NOW = 1_800_000_000.0


@pytest.mark.parametrize("text, seconds", [("45", 45.0), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0),
                                           ("1d", 86400.0), ("500ms", 0.5), ("0.5s", 0.5), (" 3s ", 3.0)])
def test_durations(text, seconds):
    assert parse_duration(text, "--lost-after") == seconds


@pytest.mark.parametrize("text", ["soon", "-5m", "nan", "inf", "1e9", "3 weeks", "", "5mm", "400d"])
def test_durations_refused(text):
    with pytest.raises(UsageError, match="is not a duration"):
        parse_duration(text, "--lost-after")


def test_durations_printed_short():
    assert [format_duration(s) for s in (None, 2.5, 45, 1800, 7200)] == ["-", "2.5s", "45s", "30m", "2.0h"]


def test_lost_after_defaults_to_three_heartbeats_and_backoff_doubles_to_its_cap():
    p = RecoveryPolicy(pool="a", backoff=10, backoff_max=35)
    assert p.lost_after_s(5.0) == 15.0 and p.lost_after_s(1.0) == 5.0 and p.lost_after_s(30.0) == 90.0
    assert RecoveryPolicy(pool="a", lost_after=2.0).lost_after_s(30.0) == 2.0
    assert [p.backoff_s(n) for n in (1, 2, 3, 4)] == [10, 20, 35, 35]


# -- the provision command -------------------------------------------------------------------------------------
def script(tmp_path, body):
    path = tmp_path / "new-box.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return [str(path)]


def test_a_provision_command_that_works(tmp_path):
    argv = script(tmp_path, 'echo "renting for $ONBOX_RUN node $ONBOX_NODE" >&2; echo progress...; '
                            'echo "{\\"host\\": \\"203.0.113.9\\", \\"port\\": 2222, \\"user\\": \\"root\\", '
                            '\\"name\\": \\"$ONBOX_PROVISION_KEY\\"}"')
    box = run_provision(argv, 10, {"ONBOX_RUN": "gpt", "ONBOX_NODE": "0", "ONBOX_PROVISION_KEY": "gpt-r1-n0"}, "a100")
    assert (box.name, box.host, box.port, box.user, box.pool) == ("gpt-r1-n0", "203.0.113.9", 2222, "root", "a100")


@pytest.mark.parametrize("body, says", [
    ("echo 'no capacity' >&2; exit 3", "exited 3: no capacity"),
    ("true", "printed nothing"),
    ("echo 'Welcome to vast.ai'", "printed 'Welcome to vast.ai' as its last line, not a JSON object"),
    ("echo '[1, 2]'", "not a JSON object"),
    ("echo '{\"host\": \"h\"}'", "name None is not a box name"),
    ("echo '{\"host\": \"h\", \"name\": \"a b\"}'", "is not a box name"),
    ("echo '{\"name\": \"n\", \"host\": \"h\", \"port\": 0}'", "port 0 is not 1-65535"),
    ("echo '{\"name\": \"n\", \"host\": \"-oProxyCommand=x\"}'", "must not start with '-'"),
    ("echo '{\"name\": \"n\", \"host\": \"h\", \"hots\": 1}'", "unknown key(s) hots"),
    ("echo '{\"name\": \"n\", \"host\": \"h\", \"options\": [\"bad\"]}'", 'options must be a list of "Key=Value"'),
    ("exec sleep 30", "did not print a box within 0 s"),
])
def test_a_provision_command_that_fails_is_one_clear_line(tmp_path, body, says):
    with pytest.raises(ProvisionFailed) as e:
        run_provision(script(tmp_path, body), 0.3, {}, "a100")
    assert says in e.value.message and "\n" not in e.value.message


def test_only_the_tail_of_a_chatty_provision_command_is_read(tmp_path):
    argv = script(tmp_path, "yes x | head -c 3000000; echo; echo '{\"name\": \"n\", \"host\": \"h\"}'")
    assert run_provision(argv, 10, {}, "p").name == "n"


def test_a_provision_command_that_cannot_start(tmp_path):
    p = tmp_path / "not-exec.sh"
    p.write_text("#!/bin/sh\n")
    with pytest.raises(ProvisionFailed, match="not executable"):
        run_provision([str(p)], 5, {}, "p")
    with pytest.raises(ProvisionFailed, match="it is not there"):
        run_provision([str(tmp_path / "gone.sh")], 5, {}, "p")


def test_a_provision_line_may_say_how_to_reach_the_box():
    box = box_from_line('{"name": "n", "host": "h", "identity": "~/.ssh/k", "python": "/opt/conda/bin/python", '
                        '"options": ["StrictHostKeyChecking=accept-new"], "profile": "runpod"}', "a100")
    assert (box.identity, box.python, box.options, box.profile) == (
        "~/.ssh/k", "/opt/conda/bin/python", ["StrictHostKeyChecking=accept-new"], "runpod")


# -- onboxctl run --recover -------------------------------------------------------------------------------------
INV = {"gpu1": Box(name="gpu1", host="h"), "s1": Box(name="s1", host="h2", pool="a100")}


def test_what_run_recover_checks_before_anything_is_launched(tmp_path):
    cmd = ["python", "train.py"]
    assert check_recovery(None, {}, cmd, None, INV) is None
    with pytest.raises(UsageError, match="--provision goes with --recover"):
        check_recovery(None, {"provision": "./x"}, cmd, None, INV)
    with pytest.raises(UsageError, match="unknown pool 'h100'"):
        check_recovery("pool:h100", {}, cmd, "/d", INV)
    with pytest.raises(UsageError, match="--recover needs --durable"):
        check_recovery("pool:a100", {}, cmd, None, INV)
    with pytest.raises(UsageError, match="--recover needs the command"):
        check_recovery("pool:a100", {}, [], "/d", INV)
    p = check_recovery("pool:a100", {"lost_after": 20.0, "max_at_risk": 1800.0}, cmd, "/d", INV)
    assert (p.pool, p.lost_after, p.max_at_risk, p.max_recoveries, p.tries) == ("a100", 20.0, 1800.0, 10, 3)
    prov = script(tmp_path, "true")
    p = check_recovery("pool:h100", {"provision": prov[0] + " --gpu h100"}, cmd, "/d", INV)  # provisioned only
    assert p.provision == [prov[0], "--gpu", "h100"]


def test_run_recover_records_the_launch_and_keeps_the_runs_history(tmp_path):
    store = RecordStore(str(tmp_path))
    policy = RecoveryPolicy(pool="a100")
    opts = {"durable": "/d", "secret": ("WANDB=wandb",), "ckpt_dir": "out"}
    rec = enrol(store, policy, "gpt", ["gpu1"], ["python", "t.py"], False, ["--durable", "/d"],
                {"ONBOX_HEARTBEAT_INTERVAL": "5.0"}, None, opts, "http://127.0.0.1:8787", True, 60.0, now=NOW)
    assert store.load_launch("gpt") == rec
    assert (rec.heartbeat_interval, rec.secrets, rec.tunnel, rec.ckpt_dir) == (5.0, ["WANDB=wandb"], True, "out")
    assert rec.lost_after_s() == 15.0
    _, keep = store.load("gpt")
    assert keep.state == KeepState.WATCHING and keep.boxes == ["gpu1"] and keep.events[0]["kind"] == "launched"
    # a later life of the run (relaunched by hand): the count and history stay, the watch starts over
    keep.recoveries, keep.current = 2, Recovery(id=2, kind="elsewhere", reason="lost", from_boxes=["gpu1"])
    keep.state = KeepState.FAILED_NO_RESOURCE
    store.save_keep(keep, NOW)
    enrol(store, policy, "gpt", ["gpu2"], ["python", "t.py"], False, [], {}, None, opts, None, False, 60.0, now=NOW)
    _, keep = store.load("gpt")
    assert (keep.state, keep.boxes, keep.recoveries, [h.id for h in keep.history]) == (
        KeepState.WATCHING, ["gpu2"], 2, [2])
    # an unreadable record is moved aside, never deleted
    with open(store.keep_path("gpt"), "w") as f:
        f.write("{garbage")
    enrol(store, policy, "gpt", ["gpu2"], ["python", "t.py"], False, [], {}, None, opts, None, False, 60.0, now=NOW)
    with open(store.keep_path("gpt") + ".unreadable") as f:
        assert f.read() == "{garbage"
    assert store.load("gpt")[1].recoveries == 0


# -- what boxes and the tracker say -----------------------------------------------------------------------------
def status_doc(**kw):
    doc = {"schema": "onbox.status/1", "run": "gpt", "state": "running", "agent_alive": True,
           "attempts": [{"started_at": 100.0}], "progress": {"step": 120, "time": 160.0},
           "checkpoint": {"latest_durable": {"name": "step_000100.ckpt", "step": 100, "committed_at": 130.0}},
           "resume_from": "/root/ckpt/step_000080.ckpt"}
    doc.update(kw)
    return doc


def test_a_boxs_status_document_as_an_observation():
    o = observation_from_status("gpu1", "gpt", status_doc(), 0, "")
    assert (o.reached, o.known, o.agent_alive, o.step, o.durable_step, o.resumed_step) == (True, True, True, 120,
                                                                                           100, 80)
    assert o.step_time == 160.0 and o.attempt_started == 100.0 and o.durable_at == 130.0
    fenced = observation_from_status("gpu1", "gpt", status_doc(state="failed", agent_alive=False,
                                                               last_exit={"classification": "fenced"}), 0, "")
    assert fenced.fenced
    leased = observation_from_status("gpu1", "gpt", status_doc(lease={"epoch": 3, "holder": "gpu1-3fa2b1c4-9d0e1f2a",
                                                                      "resumed_from": "step_000095.ckpt"}), 0, "")
    assert leased.lease["epoch"] == 3 and leased.resumed_step == 95
    assert not observation_from_status("gpu1", "gpt", None, 2, "onbox: no run named gpt in /root/.onbox/runs").known
    gone = "python3: can't open file '/root/.onbox/onbox.pyz': [Errno 2] No such file or directory"
    assert not observation_from_status("gpu1", "gpt", None, 2, gone).known
    corrupt = observation_from_status("gpu1", "gpt", {"schema": "onbox.status/1", "state": "corrupt",
                                                      "corrupt": "state.json is corrupt: line 1"}, 2, "")
    assert corrupt.problem == "state.json is corrupt: line 1"
    odd = observation_from_status("gpu1", "gpt", None, 1, "Segmentation fault\n")
    assert odd.problem == "its agent did not say: Segmentation fault"


def test_the_trackers_run_list_as_beats():
    beats = beats_from_tracker({"runs": [
        {"run": "gpt", "box": "gpu1", "liveness": "late", "state": "running",
         "latest": {"progress": {"step": 7}, "checkpoint": {"latest_durable": {"step": 5, "committed_at": 9.0}}}},
        {"run": 5}, "junk"]})
    assert list(beats) == ["gpt"]
    b = beats["gpt"]
    assert (b.liveness, b.step, b.durable_step, b.durable_at, b.box, b.ok) == ("late", 7, 5, 9.0, "gpu1", False)


# -- work at risk and the status table --------------------------------------------------------------------------
def test_work_at_risk():
    r = work_at_risk(1200, 5000.0, 1000, 3200.0, bound=1500.0)
    assert (r.seconds, r.steps, r.alert, r.label()) == (1800.0, 200, True, "30m/200")
    assert work_at_risk(50, 10.0, None, None).label() == "-/50"  # no durable checkpoint: every step at risk
    assert work_at_risk(None, None, None, None).label() == "-"
    assert work_at_risk(100, 10.0, 100, 20.0).seconds == 0.0  # committed after the newest step: nothing at risk


def _beat(run, box, step, durable_step, committed_at, t):
    return {"schema": "onbox.heartbeat/1", "run": run, "box": box, "attempt": 0, "seq": 1, "time": t,
            "state": "running", "progress": {"step": step, "time": t},
            "checkpoint": {"latest_durable": {"name": "step_%06d.ckpt" % durable_step, "step": durable_step,
                                              "committed_at": committed_at}}}


def test_status_with_the_keepers_column_golden(tmp_path):
    store = RecordStore(str(tmp_path))
    policy = RecoveryPolicy(pool="a100", max_at_risk=600.0)
    for run, box in (("gpt", "spare1"), ("lost", "gpu2")):
        enrol(store, policy, run, [box], ["python", "t.py"], False, [], {}, None, {"durable": "/d"}, None, False,
              60.0, now=NOW)
    _, keep = store.load("gpt")
    keep.recoveries = 1
    store.save_keep(keep, NOW)
    _, keep = store.load("lost")
    keep.state = KeepState.RECOVERING
    keep.current = Recovery(id=1, kind="elsewhere", reason="gpu2 failed ssh", from_boxes=["gpu2"],
                            phases={"detected": NOW - 30, "declared_lost": NOW - 20})
    keep.last_seen = {"step": 900, "durable_step": 800, "state": "running"}
    store.save_keep(keep, NOW)
    rows = rows_from_tracker({"runs": [
        {"run": "gpt", "box": "spare1", "liveness": "ok", "age_s": 3,
         "latest": _beat("gpt", "spare1", 1500, 1400, NOW - 900, NOW - 3)},
        {"run": "free", "box": "gpu3", "liveness": "ok", "age_s": 3,
         "latest": _beat("free", "gpu3", 300, 250, NOW - 120, NOW - 3)},
    ]}, now=NOW)
    rows, kept, problems = apply_keeper(rows, store, default_bound=60.0)
    assert problems == [] and [k["run"] for k in kept] == ["gpt", "lost"]
    by = {r.run: r for r in rows}
    assert by["gpt"].alerts == ["at_risk"] and by["gpt"].at_risk["bound"] == 600.0  # its own bound
    assert by["free"].alerts == ["at_risk"] and by["free"].at_risk["bound"] == 60.0  # status --max-at-risk
    assert by["lost"].source == "keeper" and by["lost"].keeper["phase"] == "box_chosen"
    check_golden("status_table_keeper.txt", render_table(sorted(rows, key=lambda r: r.run)))
    doc = {r["run"]: r for r in json.loads(json.dumps([r.to_dict() for r in rows]))}  # status --json: plain JSON
    assert doc["gpt"]["keeper"]["state"] == "watching" and doc["gpt"]["at_risk"]["seconds"] == 897.0


def test_a_damaged_record_is_a_note_in_status_not_a_failure(tmp_path):
    store = RecordStore(str(tmp_path))
    os.makedirs(store.run_dir("gpt"))
    with open(store.launch_path("gpt"), "w") as f:
        f.write("[]")
    rows, kept, problems = apply_keeper([], store)
    assert rows == [] and kept == [] and "is not a launch record" in problems[0]
