"""Which run a launch belongs to (`onboxctl run` without --name): the matching rules of the agent (onbox/launch/
match.py, `onbox match`), the controller's decision over the box's answer and its launch log (controller/
relaunch.py: resume, new, refused), the words it says, and the launch log itself (controller/launch/launchlog.py).
The whole story against real sshd boxes and agents: tests/integration/test_relaunch_ssh.py."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import pytest
from click.testing import CliRunner

from controller.boxes.inventory import Box
from controller.launch.launchlog import MAX_ENTRIES, LaunchLog
from controller.launch.relaunch import Choice, candidate_names, decide, free_name
from onbox.config import RunConfig
from onbox.errors import UsageError
from onbox.launch.match import differences

NOW = 1_800_000_000.0
CMD = ["python", "train.py"]
WD = "/root/.onbox/code/proj"
DUR = "/workspace/durable"
GPU1 = Box(name="gpu1", host="203.0.113.7")
SPARE = Box(name="spare1", host="203.0.113.8")


# -- the agent's side: what makes a run the one a launch continues -------------------------------------------------
def cfg(**kw: Any) -> RunConfig:
    return RunConfig(**dict({"command": CMD, "workdir": WD, "durable": DUR}, **kw))


@pytest.mark.parametrize("saved, differ", [
    ({"command": CMD, "workdir": WD, "durable": DUR}, []),
    ({"command": CMD, "workdir": WD, "durable": DUR, "ckpt_dir": None, "name": "other"}, []),  # the name is not it
    ({"command": CMD, "workdir": WD, "durable": "/elsewhere"}, ["durable"]),
    ({"command": CMD, "workdir": "/srv/other", "durable": DUR}, ["workdir"]),
    ({"command": CMD, "workdir": WD, "durable": DUR, "ckpt_dir": "/ckpt"}, ["ckpt_dir"]),
    ({"command": ["python", "train.py", "--lr", "3"], "workdir": WD, "durable": DUR}, ["command"]),
])
def test_a_run_is_the_launchs_when_command_workdir_durable_and_ckpt_dir_are_the_same(saved, differ):
    assert differences(saved, cfg()) == differ


def test_no_durable_on_both_sides_is_the_same_run_on_the_box():
    """Unset and empty are the same: without --durable the run's checkpoints are in its run dir on this box, so a
    relaunch there resumes from them (and a launch on another box never matches: nothing to resume there)."""
    assert differences({"command": CMD, "workdir": WD, "durable": None}, cfg(durable=None)) == []
    assert differences({"command": CMD, "workdir": WD, "durable": ""}, cfg(durable=None)) == []
    assert differences({"command": CMD, "workdir": WD}, cfg()) == ["durable"]


def _run_dir(home: Any, name: str, config: Dict[str, Any], state: Optional[Dict[str, Any]] = None) -> None:
    rd = os.path.join(str(home), "runs", name)
    os.makedirs(rd)
    with open(os.path.join(rd, "config.json"), "w") as f:
        json.dump(dict(config, name=name), f)
    if state is not None:
        with open(os.path.join(rd, "state.json"), "w") as f:
            json.dump(dict(state, run=name), f)


def test_onbox_match_lists_the_runs_of_the_same_command_resolved_as_onbox_run_would(tmp_path, monkeypatch):
    from onbox.commands.match import match

    home, work, durable = tmp_path / "home", tmp_path / "work", tmp_path / "durable"
    work.mkdir()
    monkeypatch.setenv("ONBOX_HOME", str(home))
    monkeypatch.chdir(work)
    cmd = ["true", "x"]
    _run_dir(home, "same", {"command": cmd, "workdir": str(work), "durable": str(durable)},
             {"state": "preempted", "started_at": 1.0, "updated_at": 2.0})
    _run_dir(home, "other-durable", {"command": cmd, "workdir": str(work), "durable": "/elsewhere"},
             {"state": "done"})
    _run_dir(home, "other-cmd", {"command": ["true", "y"], "workdir": str(work), "durable": str(durable)})
    # a relative --durable and the cwd as the workdir: made absolute as `onbox run` makes them
    r = CliRunner().invoke(match, ["--json", "--durable", "durable", "--candidate", "elsewhere-run",
                                   "--candidate", "same", "--", *cmd], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["schema"] == "onbox.match/1"
    assert doc["launch"] == {"command": cmd, "workdir": str(work), "durable": str(work / "durable"),
                             "ckpt_dir": None}
    assert doc["names"] == ["other-cmd", "other-durable", "same"]
    runs = {x["run"]: x for x in doc["runs"]}
    assert set(runs) == {"same", "other-durable"}  # the other command is not listed at all
    assert runs["other-durable"]["differ"] == ["durable"] and runs["other-durable"]["recorded"]["durable"] == \
        "/elsewhere"
    assert runs["same"]["differ"] == ["durable"]  # /tmp/.../durable is not /tmp/.../work/durable
    r = CliRunner().invoke(match, ["--json", "--durable", str(durable), "--candidate", "elsewhere-run",
                                   "--candidate", "same", "--", *cmd], catch_exceptions=False)
    doc = json.loads(r.output)
    same = next(x for x in doc["runs"] if x["run"] == "same")
    assert same["differ"] == [] and same["state"] == "preempted" and not same["agent_alive"]
    assert same["durable"]["exists"] is False and same["step"] is None  # nothing committed yet
    cands = {c["run"]: c for c in doc["candidates"]}
    assert cands["same"]["on_box"] and cands["same"]["durable"] is None  # the box's own record counts
    assert not cands["elsewhere-run"]["on_box"] and cands["elsewhere-run"]["durable"]["exists"] is False
    assert not os.path.exists(durable) and sorted(os.listdir(home / "runs")) == doc["names"]  # nothing made
    r = CliRunner().invoke(match, ["--json", "--candidate", "../x", "--", *cmd])  # (onbox's run_cli: exit 2)
    assert isinstance(r.exception, UsageError) and "invalid --candidate run name '../x'" in r.exception.message


# -- the controller's decision ---------------------------------------------------------------------------------------
def box_run(name: str, state: str = "preempted", updated: float = NOW - 100, step: Optional[int] = 40,
            alive: bool = False, differ: Optional[List[str]] = None, lease: Optional[Dict[str, Any]] = None,
            step_from: str = "durable") -> Dict[str, Any]:
    return {"run": name, "differ": differ or [], "state": state, "agent_alive": alive, "agent_pid": 4242 if alive
            else None, "started_at": updated - 1000, "updated_at": updated, "step": step, "step_from": step_from,
            "recorded": {"workdir": WD, "durable": "/old" if differ else DUR, "ckpt_dir": None},
            "durable": {"exists": True, "step": step, "lease": lease}}


def answer(runs: List[Dict[str, Any]] = (), candidates: List[Dict[str, Any]] = (), durable: Optional[str] = DUR,
           names: List[str] = ()) -> Dict[str, Any]:
    return {"schema": "onbox.match/1", "launch": {"command": CMD, "workdir": WD, "durable": durable,
                                                  "ckpt_dir": None},
            "runs": list(runs), "candidates": list(candidates), "names": list(names) or [r["run"] for r in runs]}


def logged(name: str, box: str = "gpu1", at: float = NOW - 3600, **kw: Any) -> Dict[str, Any]:
    return dict({"run": name, "box": box, "command": CMD, "workdir": WD, "durable": DUR, "ckpt_dir": None,
                 "at": at}, **kw)


def facts(name: str, step: Optional[int] = 1351, exists: bool = True, **lease: Any) -> Dict[str, Any]:
    return {"run": name, "on_box": False, "durable": {
        "durable": DUR, "exists": exists, "step": step, "checkpoint": None if step is None else "step_%d" % step,
        "lease": dict({"epoch": 3, "holder": "gpu1-aa-bb", "host": "gpu1", "renewed_at": NOW - 60,
                       "released_at": NOW - 60, "ended": "preempted", "live": False, "blocks": False}, **lease)}}


def choose(box: Box, ans: Dict[str, Any], log: List[Dict[str, Any]] = (), take_over: bool = False,
           claimed: Optional[set] = None) -> Choice:
    return decide(box, ans, list(log), "train-20261126-090000", take_over, claimed or set(), now=NOW)


def test_nothing_found_is_a_new_run_saying_so():
    c = choose(GPU1, answer())
    assert (c.decision, c.run, c.found) == ("new", "train-20261126-090000", None)
    assert c.line() == ("new run train-20261126-090000: no earlier run of this command with this working dir and "
                        "durable target on gpu1 or in this machine's launch log")


def test_the_box_s_preempted_run_is_resumed_from_its_newest_durable_step():
    c = choose(GPU1, answer([box_run("train-20261125-114657", step=1351)]))
    assert (c.decision, c.run, c.step, c.found) == ("resume", "train-20261125-114657", 1351, "box")
    assert c.line() == "resuming train-20261125-114657 from step 1351: the run of this command on gpu1 (preempted)"
    assert c.to_dict()["decision"] == "resume" and "box" not in c.to_dict()


def test_from_scratch_and_from_a_local_checkpoint_are_said_so():
    assert "resuming a from scratch:" in choose(GPU1, answer([box_run("a", step=None)])).line()
    local = choose(GPU1, answer([box_run("a", step=12, step_from="local")], durable=None))
    assert "resuming a from step 12 (its local checkpoint: the run has no --durable)" in local.line()


def test_a_live_run_of_the_same_command_is_refused_with_what_to_do():
    with pytest.raises(UsageError) as e:
        choose(GPU1, answer([box_run("a", state="running", alive=True)]))
    assert int(e.value.exit_code) == 2
    assert e.value.message == "run a of this command is still running on gpu1 (running, agent pid 4242)"
    assert "`onboxctl stop gpu1 a`" in e.value.hint and "--new" in e.value.hint and "onboxctl status" in e.value.hint


def test_several_runs_the_newest_is_resumed_and_the_others_named():
    c = choose(GPU1, answer([box_run("old", updated=NOW - 9000), box_run("newer", state="stopped", step=70),
                             box_run("oldest", updated=NOW - 90000)]))
    assert (c.run, c.step, c.others) == ("newer", 70, ["old", "oldest"])
    assert c.line().endswith("; not resumed (older, same command): old, oldest")


def test_a_run_that_ended_done_gives_a_new_run():
    c = choose(GPU1, answer([box_run("a", state="done")]))
    assert (c.decision, c.run) == ("new", "train-20261126-090000")
    assert c.why == "the newest run of this command, a, ended done"
    # an older preempted run behind a newer done one is not picked up either: the newest says what was last meant
    c = choose(GPU1, answer([box_run("a", state="done"), box_run("b", updated=NOW - 9000)]))
    assert c.decision == "new" and c.others == ["b"]


def test_a_run_of_the_same_command_elsewhere_is_named_with_what_differs():
    c = choose(GPU1, answer([box_run("a", differ=["durable"])]))
    assert c.decision == "new" and c.why == "a ran this command with another durable target (/old)"
    c = choose(GPU1, answer(), [logged("b", workdir="/srv/x")])
    assert c.decision == "new" and c.why == "b (on gpu1) ran this command with another workdir (/srv/x)"


def test_a_replacement_box_resumes_the_run_from_the_launch_log_and_the_durable_target():
    c = choose(SPARE, answer(candidates=[facts("train-20261125-114657")]), [logged("train-20261125-114657")])
    assert (c.decision, c.run, c.step, c.found) == ("resume", "train-20261125-114657", 1351, "launch log")
    assert c.line() == ("resuming train-20261125-114657 from step 1351: launched on gpu1 at 2027-01-15 07:00:00 "
                        "UTC, found in this machine's launch log and on the durable target")


def test_a_replacement_box_with_the_old_lease_live_needs_take_over():
    held = facts("r", live=True, blocks=True, released_at=None, ended=None, renewed_at=NOW - 4)
    with pytest.raises(UsageError) as e:
        choose(SPARE, answer(candidates=[held]), [logged("r")])
    assert int(e.value.exit_code) == 2
    assert e.value.message == ("run r of this command (launched on gpu1) is held by another agent: its lease on "
                               "/workspace/durable was renewed 4 s ago by gpu1")
    assert "--take-over" in e.value.hint and "fenced" in e.value.hint and "--new" in e.value.hint
    c = choose(SPARE, answer(candidates=[held]), [logged("r")], take_over=True)
    assert (c.decision, c.run) == ("resume", "r") and "--take-over: the live lease of gpu1 is superseded" in c.why
    # a box run whose lease another agent holds (fenced here, the run went on elsewhere): the same refusal
    fenced = box_run("r", state="fenced", lease={"live": True, "blocks": True, "renewed_at": NOW - 2, "host": "s0"})
    with pytest.raises(UsageError, match="held by another agent"):
        choose(GPU1, answer([fenced]))


@pytest.mark.parametrize("why, log, cand, durable", [
    ("nothing of it on the durable target", [logged("r")], facts("r", exists=False), DUR),
    ("the box holds a run of that name", [logged("r")], dict(facts("r"), on_box=True), DUR),
    ("no durable target: nothing to resume on another box", [logged("r", durable=None)], facts("r"), None),
    ("another checkpoint dir", [logged("r", ckpt_dir="/c")], facts("r"), DUR),
    ("not asked about", [logged("r")], facts("q"), DUR),
])
def test_launch_log_runs_that_are_not_this_launchs_give_a_new_run(why, log, cand, durable):
    assert choose(SPARE, answer(candidates=[cand], durable=durable), log).decision == "new", why


def test_a_logged_run_that_ended_done_gives_a_new_run():
    c = choose(SPARE, answer(candidates=[facts("r", ended="done")]), [logged("r")])
    assert c.decision == "new" and c.why == "the newest run of this command, r, ended done (on gpu1)"


def test_the_box_s_run_and_the_launch_log_s_compare_by_their_last_sign_of_life():
    newer = facts("moved", renewed_at=NOW - 5, released_at=NOW - 5)
    c = choose(GPU1, answer([box_run("here", updated=NOW - 500)], [newer]), [logged("moved", box="spare1")])
    assert (c.run, c.found, c.others) == ("moved", "launch log", ["here"])


def test_a_run_another_box_of_the_same_launch_resumes_is_not_taken_twice():
    ans = answer(candidates=[facts("a"), facts("b", step=9)])
    log = [logged("a", at=NOW - 10), logged("b", box="gpu2", at=NOW - 20)]
    first = choose(SPARE, ans, log)
    second = choose(SPARE, ans, log, claimed={first.run})
    assert (first.run, second.run, second.step) == ("a", "b", 9)


def test_a_new_run_never_takes_a_name_the_box_has():
    assert free_name("t-1", set()) == "t-1"
    assert free_name("t-1", {"t-1", "t-1-2"}) == "t-1-3"
    c = choose(GPU1, answer(names=["train-20261126-090000"]))
    assert c.run == "train-20261126-090000-2"


def test_the_launch_log_runs_a_replacement_box_is_asked_about():
    log = [logged("mine", box="spare1"), logged("fellow", box="gpu2"), logged("a"), logged("nodur", durable=None),
           logged("a")] + [logged("r%d" % i) for i in range(30)]
    names = candidate_names(log, "spare1", {"gpu2", "spare1"})
    # this box's own (it may have been reset, or rented again under its name), never a fellow box's, never twice
    assert names[:3] == ["mine", "a", "r0"] and len(names) == 20


# -- the launch log ------------------------------------------------------------------------------------------------
def test_the_launch_log_keeps_the_newest_launches_of_each_command(tmp_path):
    log = LaunchLog(str(tmp_path))
    assert log.load() == [] and log.of_command(CMD) == []
    row = {"run": "a", "box": "gpu1", "command": CMD, "workdir": WD, "durable": DUR, "ckpt_dir": None}
    assert log.record([row], now=1.0) is None
    assert log.record([dict(row, run="b"), dict(row, run="c", command=["x"])], now=2.0) is None
    assert [e["run"] for e in log.of_command(CMD)] == ["b", "a"]
    assert os.stat(log.path).st_mode & 0o777 == 0o600
    for i in range(MAX_ENTRIES):
        log.record([dict(row, run="n%d" % i)], now=3.0 + i) if i % 100 == 0 else None
    big = [dict(row, run="m%d" % i) for i in range(MAX_ENTRIES + 5)]
    log.record(big, now=10.0)
    kept = log.load()
    assert len(kept) == MAX_ENTRIES and kept[-1]["run"] == "m%d" % (MAX_ENTRIES + 4)


@pytest.mark.parametrize("content, says", [
    ("{not json", "Expecting property name"),
    ('{"launches": 5}', 'not {"launches": [...]}'),
    ('{"launches": [{"run": "../x", "box": "b", "command": ["x"], "at": 1}]}', "is not a run name"),
    ('{"launches": [{"run": "a", "box": "b", "command": "x", "at": 1}]}', "command is not a list"),
    ('{"launches": [{"run": "a", "box": "b", "command": ["x"], "durable": 5, "at": 1}]}', "durable 5 is not a path"),
    ('{"launches": [{"run": "a", "box": "b", "command": ["x"], "at": "now"}]}', "is not a time"),
    ('{"launches": %s%s}' % ("[" * 1000, "]" * 1000), "nests more than"),
])
def test_a_damaged_launch_log_is_named_and_left_alone(tmp_path, content, says):
    log = LaunchLog(str(tmp_path))
    with open(log.path, "w") as f:
        f.write(content)
    with pytest.raises(UsageError) as e:
        log.load()
    assert says in e.value.message and log.path in e.value.message and "move it aside" in e.value.hint
    problem = log.record([{"run": "a", "box": "b", "command": ["x"]}])
    assert problem and "is damaged" in problem
    with open(log.path) as f:
        assert f.read() == content  # never rewritten
