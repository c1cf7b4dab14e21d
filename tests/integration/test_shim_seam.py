"""The keeper's process seam on its own, with real processes: a child's exit (a code, a signal) reported by its
keeper and kept in the exit record of that very process; a start the keeper cannot make raised as Popen raises it,
with nothing left behind; a record of another process (pid, start time, boot), or a malformed one, never read."""
from __future__ import annotations

import errno
import json
import os
import signal

import pytest

from onbox.proc import Child, ExitStatus, boot_id
from onbox.supervisor.shim import Keeper, KeptChild, KeptProcessSeam, read_record, recorded_child
from onbox.supervisor.shimproc import SCHEMA
from tests.polling import wait_for
from tests.processes import pid_alive

pytestmark = pytest.mark.integration


def _seam(tmp_path):
    return KeptProcessSeam(str(tmp_path / "child-exit.json"))


def _ended(seam, child):
    return wait_for(lambda: seam.poll(child), 20, "the child's exit")


def test_an_exit_code_and_a_signal_come_from_the_keeper_and_stay_in_the_record(tmp_path):
    seam = _seam(tmp_path)
    log = str(tmp_path / "out.log")
    child = seam.spawn(["sh", "-c", "echo hello; exit 7"], dict(os.environ), str(tmp_path), log)
    assert isinstance(child, KeptChild) and child.sid == child.pgid == child.pid and child.keeper is not None
    assert _ended(seam, child) == ExitStatus(code=7)
    wait_for(lambda: read_record(seam.record, child, boot_id()), 20, "the exit record")
    doc = json.loads((tmp_path / "child-exit.json").read_text())
    assert (doc["pid"], doc["start_time"], doc["code"], doc["signal"]) == (child.pid, child.start_time, 7, None)
    assert doc["boot_id"] == boot_id() and "hello" in (tmp_path / "out.log").read_text()
    wait_for(lambda: not pid_alive(child.keeper.pid), 20, "the keeper to finish")

    killed = seam.spawn(["sh", "-c", "kill -TERM $$"], dict(os.environ), None, log)
    assert _ended(seam, killed) == ExitStatus(signal=signal.SIGTERM)
    assert wait_for(lambda: read_record(seam.record, killed, boot_id()), 20, "its record") == \
        ExitStatus(signal=signal.SIGTERM)


def test_a_start_the_keeper_cannot_make_raises_as_popen_does_and_leaves_nothing(tmp_path):
    seam = _seam(tmp_path)
    log = str(tmp_path / "out.log")
    before = _children()
    with pytest.raises(OSError) as e:
        seam.spawn(["/nonexistent/train.sh"], dict(os.environ), None, log)
    assert e.value.errno == errno.ENOENT
    with pytest.raises(ValueError):
        seam.spawn(["sh", "-c", "true\0"], dict(os.environ), None, log)
    assert _children() <= before  # each keeper was waited for: no zombie, nothing running


def _children():
    """This process's children, zombies included."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        with open("/proc/self/task/%s/children" % tid) as f:
            out.update(int(x) for x in f.read().split())
    return out


def test_an_adopter_reads_the_record_of_that_very_child_only(tmp_path):
    seam = _seam(tmp_path)
    child = seam.spawn(["sh", "-c", "exit 3"], dict(os.environ), None, str(tmp_path / "out.log"))
    assert _ended(seam, child) == ExitStatus(code=3)
    wait_for(lambda: read_record(seam.record, child, boot_id()), 20, "the exit record")
    keeper = child.keeper
    # an agent that did not start it: no pipe, only the record (its keeper is gone by now)
    state = {"child_pid": child.pid, "child_start_time": child.start_time,
             "attempts": [{"pid": child.pid, "start_time": child.start_time, "sid": child.sid, "pgid": child.pgid,
                           "boot_id": boot_id(), "exit": None, "keeper": keeper.to_dict()}]}
    adopted = recorded_child(state, seam.record, None)
    assert isinstance(adopted, KeptChild) and adopted.ours is False
    assert KeptProcessSeam(seam.record).poll(adopted) == ExitStatus(code=3)
    # the exit already recorded in state.json: nothing to adopt; an attempt without a keeper: as before
    assert recorded_child(dict(state, attempts=[dict(state["attempts"][0], exit={"code": 3})]), seam.record,
                          None) is None
    no_keeper = {k: v for k, v in state["attempts"][0].items() if k != "keeper"}
    assert recorded_child(dict(state, attempts=[no_keeper]), seam.record, None) is None
    # another process (pid or start time), another boot, a torn or foreign document: not that child's exit
    other = Child(pid=child.pid, sid=child.pid, pgid=child.pid, start_time=(child.start_time or 0) + 1)
    assert read_record(seam.record, other, boot_id()) is None
    assert read_record(seam.record, child, "another-boot") is None
    doc = json.loads((tmp_path / "child-exit.json").read_text())
    for bad in ({**doc, "schema": "x"}, {**doc, "code": 0, "signal": 9}, {**doc, "code": "0"}, [doc]):
        (tmp_path / "child-exit.json").write_text(json.dumps(bad))
        assert read_record(seam.record, child, boot_id()) is None, bad
    (tmp_path / "child-exit.json").write_text("{not json")
    assert read_record(seam.record, child, boot_id()) is None
    # with no record and its keeper gone, the exit is unknown, and says why (the keeper writes the record, then
    # exits: under load the test can read the record before the keeper is gone)
    wait_for(lambda: not pid_alive(keeper.pid), 20, "the keeper's own exit")
    lost = KeptProcessSeam(seam.record).poll(KeptChild(pid=child.pid, sid=child.pid, pgid=child.pid,
                                                       start_time=child.start_time, ours=False,
                                                       keeper=Keeper(keeper.pid, keeper.start_time, seam.record)))
    assert lost is not None and lost.code is None and lost.signal is None
    assert "keeper (pid %d)" % keeper.pid in getattr(lost, "why", "")
    assert doc["schema"] == SCHEMA
