"""The keeper's records and what it prints are outside input too (issue 30, items 11 and 13):

- a launch record's --provision-timeout of 0, a negative or an absurd one is refused when the record is read,
  naming the flag and the range (`onboxctl run` refuses it too: tests/integration/test_bad_inputs_keeper.py);
- box and run names in the records are checked when they are read: a name ssh would read as an option, or one
  holding a terminal escape, is a record problem naming the file, never a name printed or handed to ssh; a run
  directory whose name is no run name is one problem among the others, never the end of the keeper's pass;
- a launch record that others may write is refused when it names a provision command (it would run as you);
- values read back for work at risk (last_seen) that are not numbers are dropped, never a TypeError in `status`;
- every text the keeper says that came from a box, the tracker or a provision command has its control characters
  shown as escapes: `keep`'s events, its messages, recovery.json.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest

from controller.boxes.inventory import Box
from controller.keeper.decide import Observation
from controller.keeper.loop import Keeper
from controller.keeper.policy import LaunchRecord, RecoveryPolicy, check_provision_timeout
from controller.keeper.provision import ProvisionFailed
from controller.keeper.records import RecordStore
from controller.keeper.view import apply_keeper
from onbox.clock import FakeClock
from onbox.errors import UsageError
from tests.unit.test_keeper import FakeWorld, down

ESC = "\x1b]0;PWNED-TITLE\x07"


def launch_doc(**over: Any) -> Dict[str, Any]:
    policy = dict(pool="p", provision=None, lost_after=0, max_recoveries=10, max_at_risk=None, backoff=0.1,
                  backoff_max=1, tries=1, provision_timeout=600)
    policy.update(over.pop("policy", {}))
    doc = {"schema": "onboxctl.launch/1", "run": "kp", "boxes": ["b"], "command": ["python", "t.py"],
           "policy": policy, "onbox_args": [], "onbox_env": {}, "durable": "/d", "heartbeat_interval": 1.0,
           "timeout": 5.0, "created": 0}
    doc.update(over)
    return doc


def write(store: RecordStore, run: str, name: str, doc: Any, mode: int = 0o600) -> str:
    os.makedirs(store.run_dir(run) if run == "kp" else os.path.join(store.root, run), exist_ok=True)
    path = os.path.join(store.root, run, name)
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    os.chmod(path, mode)
    return path


# -- item 13: --provision-timeout ------------------------------------------------------------------------------
@pytest.mark.parametrize("seconds", [0, -5, 0.5, 86400 * 30, 1e300])
def test_a_provision_timeout_out_of_range_is_refused_naming_the_flag_and_the_range(seconds):
    with pytest.raises(UsageError) as e:
        check_provision_timeout(seconds)
    assert "--provision-timeout" in e.value.message and "1s to 24h" in e.value.message


@pytest.mark.parametrize("seconds", [1, 2.5, 600, 86400])
def test_a_provision_timeout_in_range_passes(seconds):
    assert check_provision_timeout(seconds) == seconds


@pytest.mark.parametrize("value", [0, -1, 1e9, 0.001])
def test_a_launch_record_with_such_a_provision_timeout_is_a_record_problem(tmp_path, value):
    store = RecordStore(str(tmp_path))
    write(store, "kp", "launch.json", launch_doc(policy={"provision": ["/bin/true"], "provision_timeout": value}))
    report = Keeper(store, FakeWorld(FakeClock(), {}, {})).tick()
    [p] = report.problems
    assert "provision_timeout" in p["text"] and "--provision-timeout takes 1s to 24h" in p["text"]


# -- names in the records ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("boxes", [["-oProxyCommand=touch pwned"], ["b" + ESC], ["a b"], [""], ["b\n"]])
def test_a_box_name_ssh_or_a_terminal_would_misread_is_a_record_problem(tmp_path, boxes):
    store = RecordStore(str(tmp_path))
    write(store, "kp", "launch.json", launch_doc(boxes=boxes))
    world = FakeWorld(FakeClock(), {}, {})
    report = Keeper(store, world).tick()
    [p] = report.problems
    assert "box" in p["text"] and "\x1b" not in p["text"] and "\x07" not in p["text"] and "\n" not in p["text"]
    assert world.observed == []  # never handed to ssh


def test_a_recovery_record_with_such_a_box_name_is_refused_too(tmp_path):
    store = RecordStore(str(tmp_path))
    write(store, "kp", "launch.json", launch_doc())
    write(store, "kp", "recovery.json", {"schema": "onboxctl.recovery/1", "run": "kp", "state": "recovering",
                                         "boxes": ["b"], "recoveries": 0,
                                         "current": {"id": 1, "kind": "elsewhere", "reason": "x", "from_boxes": ["b"],
                                                     "to_boxes": ["-oProxyCommand=x"], "phases": {"detected": 1.0}}})
    world = FakeWorld(FakeClock(), {}, {})
    [p] = Keeper(store, world).tick().problems
    assert "to_boxes" in p["text"] and world.observed == []


def test_a_run_directory_that_is_no_run_name_is_one_problem_and_the_other_runs_are_kept(tmp_path):
    store = RecordStore(str(tmp_path))
    write(store, "kp", "launch.json", launch_doc())
    os.makedirs(os.path.join(store.root, "bad" + ESC))
    write(store, "bad" + ESC, "launch.json", launch_doc(run="bad" + ESC))
    clock = FakeClock()
    world = FakeWorld(clock, {"b": [down("b", "kp")]}, {"b": Box(name="b", host="h")})
    report = Keeper(store, world, clock=clock).tick()
    [p] = report.problems
    assert "is not a run name" in p["text"] and "\x1b" not in p["text"]
    assert [r["run"] for r in report.runs] == ["kp"] and world.observed == ["b"]


def test_a_launch_record_others_may_write_is_refused_when_it_names_a_provision_command(tmp_path):
    store = RecordStore(str(tmp_path))
    write(store, "kp", "launch.json", launch_doc(policy={"provision": ["/bin/true"]}), mode=0o666)
    [p] = Keeper(store, FakeWorld(FakeClock(), {}, {})).tick().problems
    assert "writable by others" in p["text"] and "chmod go-w" in (p["hint"] or "")
    # beside it: the same record, the user's own (0600, or 0644 as an editor leaves it), is taken
    for mode in (0o600, 0o644):
        os.chmod(store.launch_path("kp"), mode)
        assert Keeper(store, FakeWorld(FakeClock(), {}, {})).tick().problems == []


def test_last_seen_values_that_are_not_numbers_are_dropped_not_a_traceback_in_status(tmp_path):
    store = RecordStore(str(tmp_path))
    write(store, "kp", "launch.json", launch_doc())
    write(store, "kp", "recovery.json", {"schema": "onboxctl.recovery/1", "run": "kp", "state": "watching",
                                         "boxes": ["b"], "recoveries": 0,
                                         "last_seen": {"step": "9" + ESC, "durable_step": [1], "durable_at": "x",
                                                       "state": {"a": 1}, "time": 5.0}})
    _, keep = store.load("kp")
    assert keep.last_seen == {"time": 5.0}
    rows, _kept, problems = apply_keeper([], store)
    assert problems == [] and rows[0].run == "kp"


# -- item 11: what the keeper says -------------------------------------------------------------------------------
def test_what_boxes_and_a_provision_command_said_reaches_events_and_messages_as_escapes(tmp_path):
    clock = FakeClock()
    store = RecordStore(str(tmp_path))
    rec = LaunchRecord(run="gpt", boxes=["gpu1"], command=["python", "t.py"], durable="/d",
                       policy=RecoveryPolicy(pool="a100", lost_after=0.0, tries=1, provision=["./new-box.sh"]))
    store.save_launch(rec)
    inv = {"gpu1": Box(name="gpu1", host="h1"), "spare-a": Box(name="spare-a", host="h2", pool="a100")}
    world = FakeWorld(clock, {"gpu1": [Observation("gpu1", "gpt", reached=False, error="Connection closed" + ESC)]},
                      inv, spares={"spare-a": "fails `onbox audit`: " + ESC},
                      provision=[ProvisionFailed("the provision command ./new-box.sh exited 1: " + ESC)])
    said: List[Dict[str, Any]] = []
    Keeper(store, world, clock=clock, say=said.append).tick()
    _, keep = store.load("gpt")
    texts = [e["text"] for e in said] + [e["text"] for e in keep.events] + [keep.message or ""]
    assert any("PWNED-TITLE" in t for t in texts)
    for t in texts:
        assert "\x1b" not in t and "\x07" not in t, t
    with open(store.keep_path("gpt"), "rb") as f:
        assert b"\\u001b" not in f.read()  # stored as the escape's text, not as a control character
