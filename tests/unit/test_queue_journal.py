"""The queue's journal (append-only JSONL under a flock; the last record of an entry wins), its compaction, the
agents' environment (U32), and `onbox queue ls` against a golden file."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from onbox.errors import UnfitError, UsageError
from onbox.queue.journal import Journal
from onbox.queue.render import render_queue
from onbox.queue.slots import CONFIG_VARS, agent_env
from tests.golden import check_golden


def add(j, i, name):
    with j.locked():
        j.append({"op": "add", "id": i, "name": name, "config": {"command": ["train", name]}, "at": 100.0 + i})


def test_the_last_state_record_of_an_entry_wins_and_a_torn_line_is_skipped(tmp_path):
    j = Journal(str(tmp_path / "q"))
    add(j, 1, "a")
    add(j, 2, "b")
    with j.locked():
        entries, next_id = j.read()
        j.set_state(entries[1], "running", agent_pid=42, agent_start=7, gpu=0, launches=1)
        j.set_state(entries[1], "preempted", message="stopped after its final commit")
        j.set_state(entries[2], "removed")
    with open(j.path, "ab") as f:
        f.write(b'{"op": "state", "id": [1], "state": "done"}\n')  # hand edits: an id that is no id,
        f.write(b'{"op": "state", "id": true, "state": "done"}\n')
        f.write(b"[" * 100000 + b"\n")  # nesting the JSON decoder cannot follow
        f.write(b'{"op": "state", "id": 1, "sta')  # a crash in the middle of a write
    with j.locked(exclusive=False):
        entries, next_id = j.read()
    assert next_id == 3 and (entries[1].state, entries[1].launches, entries[1].agent_pid) == ("preempted", 1, None)
    assert entries[2].state == "removed" and len(j.problems) == 4 and "line 6" in j.problems[0]
    assert "line 9" in j.problems[3]
    with pytest.raises(UsageError, match="no queue entry 'b'"):
        j.find(entries, "b")  # removed
    assert j.find(entries, "1") is entries[1] and j.find(entries, "a") is entries[1]


def test_compaction_is_atomic_keeps_each_entry_and_never_reuses_an_id(tmp_path):
    j = Journal(str(tmp_path / "q"))
    for i, n in ((1, "a"), (2, "b"), (3, "c")):
        add(j, i, n)
    with j.locked():
        entries, _ = j.read()
        for state in ("running", "done"):
            j.set_state(entries[1], state, launches=1)
        j.set_state(entries[3], "removed")
        inode = os.stat(j.path).st_ino
        assert j.compact() == 2  # 6 lines -> a meta line, a and its last state, b
    assert os.stat(j.path).st_ino != inode  # a new file renamed over the old one, never rewritten in place
    with j.locked(exclusive=False):
        entries, next_id = j.read()
    assert sorted((e.id, e.state, e.launches) for e in entries.values()) == [(1, "done", 1), (2, "pending", 0)]
    assert next_id == 4  # entry 3 is gone, its id is not handed out again
    assert oct(os.stat(j.path).st_mode & 0o777) == "0o600" and oct(os.stat(j.root).st_mode & 0o777) == "0o700"


def _append_many(root, start, n):
    j = Journal(root)
    for i in range(start, start + n):
        with j.locked():
            _, next_id = j.read()
            j.append({"op": "add", "id": next_id, "name": "w%d" % i, "config": {"command": ["x" * 3000]}, "at": 0})


def test_concurrent_writers_in_separate_processes_lose_nothing(tmp_path):
    root = str(tmp_path / "q")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(root, k * 100, 40)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    j = Journal(root)
    entries, next_id = j.read()
    assert len(entries) == 160 and sorted(entries) == list(range(1, 161)) and next_id == 161 and not j.problems
    with open(j.path, "rb") as f:
        assert all(json.loads(line)["op"] == "add" for line in f)  # whole lines only, each one parsed


def test_a_lock_held_too_long_is_an_unfit_error_not_a_hang(tmp_path):
    j = Journal(str(tmp_path / "q"))
    with j.locked():
        other = Journal(j.root)
        with pytest.raises(UnfitError, match="stayed locked"), other.locked(wait=0.1):
            pass


def test_entry_agents_never_get_the_runners_own_settings_and_get_their_gpu():
    environ = {"ONBOX_HOME": "/h", "ONBOX_GRACE": "1", "ONBOX_TRACKER_TOKEN": "t", "ONBOX_DURABLE": "/d",
               "PATH": "/bin"}
    env = agent_env(environ, 1)
    assert env == {"ONBOX_HOME": "/h", "ONBOX_TRACKER_TOKEN": "t", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1",
                   "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert "ONBOX_PHASES" in CONFIG_VARS and "CUDA_VISIBLE_DEVICES" not in agent_env(environ, None)


def test_queue_ls_text():
    doc: dict = {"runner": {"alive": True, "pid": 4242, "state": "running", "mode": "one per GPU (2)"},
           "entries": [
               {"id": 1, "state": "done", "name": "q1-train", "run_state": "done", "gpu": 0,
                "command": ["python", "train.py", "--lr", "3e-4"]},
               {"id": 2, "state": "running", "name": "det-50ep", "run_state": "backoff", "gpu": 1,
                "command": ["python", "train.py", "--task", "det", "--epochs", "50", "--data", "/data/coco 2017",
                            "--batch-size", "64"]},
               {"id": 3, "state": "preempted", "name": "seg", "run_state": "preempted", "gpu": None,
                "command": ["python", "seg.py"], "message": "stopped after its final commit; `onbox queue run` "
                                                           "resumes it from its newest checkpoint"},
               {"id": 4, "state": "pending", "name": "q4-recon", "run_state": None, "gpu": None,
                "command": ["python", "recon.py"]},
               {"id": 5, "state": "running", "agent_alive": False, "name": "q5-lost", "run_state": "running",
                "gpu": None, "command": ["python", "lost.py"]}],
           "problems": ["/q/journal.jsonl line 9 is not a queue record; skipped"]}
    stopped = dict(doc, runner={"alive": False, "state": "preempted", "exit": 75})
    check_golden("queue/ls.txt", render_queue(doc) + "---\n" + render_queue(stopped))
