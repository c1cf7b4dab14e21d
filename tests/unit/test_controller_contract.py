"""The controller speaks to a box's agent only through `onbox ... --json` (issue 20): `onboxctl status` reads
`onbox status --json`, pull and the teardown gate read `onbox checkpoints [RUN|--all] --json`. Here the "box" is
this machine: a double of Ssh runs what the controller sends with the real agent (`python -m onbox`) under a
private ONBOX_HOME, and refuses anything that is not `python3 .onbox/onbox.pyz ARGS` (no script, no `-c`)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any, List

import pytest

from controller.boxes.agent import REMOTE_PYZ, agent_json
from controller.boxes.inventory import Box
from controller.boxes.ssh import Result
from controller.commands.status import box_rows
from controller.results.pull import PullsRecord, remote_run, remote_runs
from controller.results.teardown import judge_run
from onbox.errors import JobFailed, UsageError

BOX = Box(name="b1", host="h")


class LocalBox:
    """Runs what the controller sends to the box on this machine, as the box would, and records it."""

    def __init__(self, home: str) -> None:
        self.home = home
        self.sent: List[List[str]] = []

    def run(self, target: Any, argv: Any = None, *, script: Any = None, timeout: Any = None, check: bool = True,
            what: str = "", **kw: Any) -> Result:
        assert script is None and argv[:2] == [BOX.python, REMOTE_PYZ], (script, argv)  # the agent's commands only
        assert "-c" not in argv
        self.sent.append(list(argv))
        p = subprocess.run([sys.executable, "-m", "onbox", *argv[2:]], capture_output=True, timeout=timeout,
                           env={"ONBOX_HOME": self.home, "PATH": os.environ["PATH"], "HOME": self.home})
        return Result(list(argv), p.returncode, p.stdout, p.stderr)


class Answers:
    """A box that answers every command with one canned result (an older agent, a hostile box)."""

    def __init__(self, rc: int, out: str = "", err: str = "") -> None:
        self.result = Result([], rc, out.encode(), err.encode())

    def run(self, target: Any, argv: Any = None, **kw: Any) -> Result:
        return self.result


def _run(home, name, config, state=None):
    rd = home / "runs" / name
    rd.mkdir(parents=True)
    (rd / "config.json").write_text(json.dumps(dict({"name": name}, **config)))
    if state is not None:
        (rd / "state.json").write_text(json.dumps({"run": name, "state": state}))
    return rd


def _commit(durable, run, name, step, payload=b"weights"):
    """A checkpoint as the agent commits it: payload, then MANIFEST.json (its bytes returned)."""
    ck = durable / run / "checkpoints" / name
    ck.mkdir(parents=True)
    (ck / "model.pt").write_bytes(payload)
    raw = json.dumps({"name": name, "step": step, "created": 1767225600.0 + step,
                      "files": [{"path": "model.pt", "size": len(payload),
                                 "sha256": hashlib.sha256(payload).hexdigest()}]}).encode()
    (ck / "MANIFEST.json").write_bytes(raw)
    return raw


@pytest.fixture
def box(tmp_path):
    return LocalBox(str(tmp_path / "home"))


@pytest.mark.timeout(60)  # the script this replaced hung on a FIFO progress.json
def test_status_over_ssh_is_onbox_status_json_with_progress_and_checkpoint(box, tmp_path):
    home = tmp_path / "home"
    rd = _run(home, "a", {}, state="done")
    (rd / "progress.json").write_text(json.dumps({"step": 260, "loss": 1.5}))
    (rd / "checkpoint_status.json").write_text(json.dumps({"latest_durable": {"name": "step_000260", "step": 260}}))
    fifo = _run(home, "b", {}, state="failed")
    os.mkfifo(fifo / "progress.json")
    os.mkfifo(fifo / "checkpoint_status.json")
    rows = {r.run: r for r in box_rows(box, BOX)}  # type: ignore[arg-type]
    assert box.sent == [[BOX.python, REMOTE_PYZ, "status", "--json"]]
    assert (rows["a"].state, rows["a"].step, rows["a"].loss, rows["a"].checkpoint) == ("done", 260, 1.5, "step_000260")
    assert rows["b"].state == "failed" and rows["b"].step is None and rows["a"].source == "ssh"


def test_status_of_a_box_whose_agent_refuses_is_a_problem_in_its_words(tmp_path):
    (tmp_path / "file").write_text("x")
    box = LocalBox(str(tmp_path / "file"))  # ONBOX_HOME is a regular file: `onbox status` exits 2
    with pytest.raises(UsageError, match=r"^onbox status on b1: ONBOX_HOME .* is unusable: .* is not a directory$"):
        box_rows(box, BOX)  # type: ignore[arg-type]


def test_pull_and_the_gate_read_onbox_checkpoints_json(box, tmp_path):
    home, durable = tmp_path / "home", tmp_path / "durable"
    _run(home, "r1", {"durable": str(durable)}, state="preempted")
    old = _commit(durable, "r1", "step_000100", 100)
    new = _commit(durable, "r1", "step_000200", 200)
    (durable / "r1" / "logs").mkdir()
    _run(home, "remote", {"durable": "s3remote:bucket/x"}, state="running")  # never asked: off the box
    (home / "runs" / "bare").mkdir()  # a run dir without config.json: listed, with its problem
    info = remote_run(box, BOX, "r1")  # type: ignore[arg-type]
    assert box.sent[-1] == [BOX.python, REMOTE_PYZ, "checkpoints", "r1", "--json"]
    assert info["run_root"] == str(durable / "r1") and info["state"] == "preempted" and info["has_logs"]
    assert not info["has_index"]
    assert [(c.name, c.step, c.bytes, c.manifest_sha256) for c in info["checkpoints"]] == [
        ("step_000100", 100, 7, hashlib.sha256(old).hexdigest()),
        ("step_000200", 200, 7, hashlib.sha256(new).hexdigest())]

    docs = {d["run"]: d for d in remote_runs(box, BOX)}  # type: ignore[arg-type]
    assert box.sent[-1] == [BOX.python, REMOTE_PYZ, "checkpoints", "--all", "--json"]
    assert sorted(docs) == ["bare", "r1", "remote"]
    rec = PullsRecord(str(tmp_path / "pulls.json"))
    assert judge_run("b1", docs["r1"], rec).reason == "newest checkpoint step_000200 not pulled"
    assert not judge_run("b1", docs["remote"], rec).blocking  # commits off the box
    bare = judge_run("b1", docs["bare"], rec)
    assert bare.blocking and "no committed durable checkpoint" in bare.reason and "no run 'bare'" in docs["bare"][
        "problem"]
    rec.record("b1", "r1", "/d", "step_000200", {"ok": True, "manifest_sha256": hashlib.sha256(new).hexdigest()})
    assert not judge_run("b1", docs["r1"], rec).blocking


def test_a_refused_newest_manifest_still_blocks_the_gate(box, tmp_path):
    """The agent refuses a manifest that names a path outside its dir; the gate must not then take the older,
    verified checkpoint for the newest (the teardown would lose step 200)."""
    home, durable = tmp_path / "home", tmp_path / "durable"
    _run(home, "r1", {"durable": str(durable)}, state="done")
    old = _commit(durable, "r1", "step_000100", 100)
    bad = durable / "r1" / "checkpoints" / "step_000200"
    bad.mkdir()
    (bad / "MANIFEST.json").write_text(json.dumps({"step": 200, "files": [{"path": "../x", "size": 1}]}))
    [doc] = remote_runs(box, BOX)  # type: ignore[arg-type]
    assert [c.name for c in doc["checkpoints"]] == ["step_000100", "step_000200"]
    rec = PullsRecord(str(tmp_path / "pulls.json"))
    rec.record("b1", "r1", "/d", "step_000100", {"ok": True, "manifest_sha256": hashlib.sha256(old).hexdigest()})
    v = judge_run("b1", doc, rec)
    assert v.blocking and v.newest == "step_000200"


def test_a_node_of_a_group_is_named_so_the_gate_leaves_it_to_node_0(box, tmp_path):
    home = tmp_path / "home"
    group = tmp_path / "group.json"
    group.write_text(json.dumps({"schema": "onbox.node_group/1", "group": "ab" * 8, "run": "big", "rank": 1,
                                 "nnodes": 2, "master_addr": "10.0.0.2", "master_port": 29500, "key": "00" * 32,
                                 "peers": [{"rank": 0, "addr": "10.0.0.2", "port": 40000},
                                           {"rank": 1, "addr": "10.0.0.3", "port": 40001}]}))
    group.chmod(0o600)
    _run(home, "big.node1", {"node_group": str(group)}, state="running")
    [doc] = remote_runs(box, BOX)  # type: ignore[arg-type]
    assert doc["node"] == {"rank": 1, "run": "big", "nnodes": 2}
    assert not judge_run("b1", doc, PullsRecord(str(tmp_path / "pulls.json"))).blocking


def test_no_such_run_is_the_agents_usage_error(box):
    with pytest.raises(UsageError, match=r"^onbox checkpoints nope on b1: no run 'nope' on this box") as e:
        remote_run(box, BOX, "nope")  # type: ignore[arg-type]
    assert "onboxctl status --box b1" in (e.value.hint or "")


@pytest.mark.parametrize("answer, error, says", [
    (Answers(2, err="Usage: onbox checkpoints [OPTIONS] NAME\nError: No such option: --all\n"), UsageError,
     "No such option: --all"),  # an onbox.pyz older than this onboxctl
    (Answers(0, out=json.dumps({"run": "r1", "local": []})), JobFailed, "printed no onbox.checkpoints/1"),
    (Answers(1, err="Traceback ...\nKeyError: 'x'\n"), JobFailed, "exited 1: KeyError: 'x'"),
])
def test_an_answer_without_the_document_says_what_came_back_and_to_push(answer, error, says):
    with pytest.raises(error) as e:
        agent_json(answer, BOX, ["checkpoints", "r1", "--json"], "onbox.checkpoints/1")  # type: ignore[arg-type]
    assert says in e.value.message and "onboxctl push b1" in (e.value.hint or "")


@pytest.mark.parametrize("name", ["../../../home/me/.ssh", "a/b", "", None, "..", "a\x00b", 5])
def test_a_checkpoint_name_that_is_no_directory_entry_is_refused(name):
    doc = {"schema": "onbox.checkpoints_list/1", "runs": [
        {"schema": "onbox.checkpoints/1", "run": "r1", "durable_root": "/d/r1",
         "manifests": [{"name": name, "manifest_sha256": "aa", "step": 1}]}]}
    with pytest.raises(JobFailed, match="no directory entry"):
        remote_runs(Answers(0, out=json.dumps(doc)), BOX)  # type: ignore[arg-type]


def test_the_push_hash_is_sha256sum_and_says_when_the_box_has_none(tmp_path):
    """The one command push sends that is no `onbox` command (the pyz may not be there yet, and what landed must
    not vouch for itself): sha256sum's hash, nothing for a missing file, and a box without sha256sum is told, not
    read as "no pyz" (the Python fallback it had never ran: the pipeline's status was cut's)."""
    from controller.launch.push import _REMOTE_SHA

    assert "python" not in _REMOTE_SHA and " -c " not in _REMOTE_SHA
    f = tmp_path / "onbox.pyz"
    f.write_bytes(b"zip bytes")
    bare = tmp_path / "bin"
    bare.mkdir()  # a PATH without sha256sum

    def remote(path, env_path):
        return subprocess.run(["/bin/sh", "-c", _REMOTE_SHA % path], capture_output=True, text=True, timeout=30,
                              env={"PATH": env_path})

    ok = remote(str(f), os.environ["PATH"])
    assert (ok.returncode, ok.stdout) == (0, hashlib.sha256(b"zip bytes").hexdigest() + "\n")
    missing = remote(str(tmp_path / "none"), os.environ["PATH"])
    assert (missing.returncode, missing.stdout) == (0, "")
    none = remote(str(f), str(bare))
    assert none.returncode == 127 and "sha256sum" in none.stderr and none.stdout == ""
