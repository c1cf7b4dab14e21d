"""A run directory that refuses writes (ENOSPC, EROFS, ...), through a fake process seam and a FakeClock: the
supervision goes on, the newest state and the events are held in memory, said once, and written in order when the
disk takes writes again; the end of the run waits for that (bounded). Plus the heartbeat spool's share of it."""
from __future__ import annotations

import errno
import json
import os
import signal
from typing import List, Optional, Tuple

import pytest

from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.heartbeat.spool import SeqCounter, Spool
from onbox.proc import ExitStatus
from onbox.supervisor import records
from onbox.supervisor.hooks import Hooks, NoReaper, NoTelemetry
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.preempt import STOP_SIGNAL
from onbox.supervisor.records import RunRecords
from onbox.supervisor.rundir import RunDir
from tests.fakes.supervisor import Checkpoints, FakeProcs, exits_after


class FillableRunDir(RunDir):
    """A run dir on a disk that refuses every write between `full_from` and `free_at` (monotonic times)."""

    def __init__(self, path: str, clock: FakeClock, full: Tuple[float, float], err: int = errno.ENOSPC) -> None:
        super().__init__(path)
        self.clock, self.full, self.err = clock, full, err

    def _check(self, name: str) -> None:
        if self.full[0] <= self.clock.monotonic() < self.full[1]:
            raise OSError(self.err, os.strerror(self.err), self.file(name))

    def write_state(self, state):
        self._check("state.json")
        super().write_state(state)

    def write_status(self, state):
        self._check("training_status.md")
        super().write_status(state)

    def append_event(self, event):
        self._check("events.jsonl")
        super().append_event(event)

    def log_line(self, text):
        self._check("output.log")
        super().log_line(text)


def make(tmp_path, scripts, full: Tuple[float, float], err: int = errno.ENOSPC, **fields):
    clock = FakeClock()
    procs = FakeProcs(clock, scripts)
    ckpts = Checkpoints(clock)
    fields.setdefault("restart", "never")
    cfg = RunConfig(name="full", command=["train"], notice_source="none", tick_interval=1.0, **fields).validate()
    rd = FillableRunDir(str(tmp_path / "full"), clock, (clock.monotonic() + full[0], clock.monotonic() + full[1]),
                        err)
    os.makedirs(rd.path)
    lines: List[str] = []
    sup = Supervisor(cfg, rd, proc=procs, clock=clock,  # type: ignore[arg-type]
                     hooks_factory=lambda ctx: Hooks(ckpts, NoTelemetry(), NoReaper()),
                     seams=Seams(oom_reader=lambda: None, environ={}, log=lines.append, waiter=clock.sleep))
    return sup, procs, ckpts, clock, lines


def on_disk(sup: Supervisor) -> Tuple[dict, List[dict]]:
    with open(sup.rd.state_path) as f:
        state = json.load(f)
    with open(sup.rd.events_path) as f:
        return state, [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS])
def test_a_run_disk_that_refuses_writes_never_ends_the_supervision_and_the_records_catch_up(tmp_path, err):
    # the disk refuses writes from 2 s to 20 s; the child exits 0 at 5 s, in the middle of it
    sup, _procs, ckpts, clock, lines = make(tmp_path, [exits_after(5.0, 0)], full=(2.0, 20.0), err=err)
    assert sup.run() == RunState.DONE
    assert len(ckpts.finals) == 1 and round(ckpts.finals[0][0] - 1000.0) == 5  # committed at the end, at 5 s
    assert clock.monotonic() >= 1020.0  # the agent stayed until it could write how the run ended
    state, events = on_disk(sup)
    assert state["state"] == "done" and state["degraded"] is None
    assert not [w for w in state["warnings"] if w["code"] == "run_dir_unwritable"]
    kinds = [e["type"] if e["type"] != "state" else "state:" + e["new"] for e in events]
    assert kinds == ["state:running", "run_dir_unwritable", "exit", "final_checkpoint", "state:done",
                     "run_dir_writable"]
    name = errno.errorcode[err]
    assert events[1]["errno"] == name and events[-1]["errno"] == name and events[-1]["dropped_events"] == 0
    assert len([m for m in lines if m.startswith("cannot write")]) == 1  # said once, not at every write


def test_while_the_fault_lasts_state_json_and_the_beats_carry_it(tmp_path):
    sup, _procs, _ckpts, clock, _lines = make(tmp_path, [exits_after(5.0, 0)], full=(2.0, 1e9))
    seen = []
    original = clock.sleep

    def watch(seconds: float) -> None:
        original(seconds)
        seen.append(sup.state_doc())  # what telemetry.tick and the heartbeat get

    sup.waiter = watch
    sup.run()
    during = [d for d in seen if d["degraded"]]
    assert during and during[0]["degraded"]["errno"] == "ENOSPC" and during[0]["degraded"]["held_events"] >= 1
    (warning,) = [w for w in during[-1]["warnings"] if w["code"] == "run_dir_unwritable"]
    assert warning["severity"] == "critical" and "df -h" in warning["hint"]


def test_the_wait_for_a_writable_disk_at_the_end_is_bounded_by_final_sync_timeout(tmp_path):
    sup, _procs, _ckpts, clock, lines = make(tmp_path, [exits_after(5.0, 0)], full=(2.0, 1e9),
                                           final_sync_timeout=30.0)
    assert sup.run() == RunState.DONE
    assert 1035.0 <= clock.monotonic() < 1037.0
    state, _ = on_disk(sup)
    assert state["state"] == "running"  # the truth stayed in memory: said in the log
    assert any(m.startswith("gave up: the final state (done)") for m in lines)


def test_a_term_ends_the_wait_for_a_writable_disk_at_once(tmp_path):
    sup, _procs, _ckpts, clock, _lines = make(tmp_path, [exits_after(5.0, 0)], full=(2.0, 1e9))
    original = clock.sleep

    def term_in_the_final_wait(seconds: float) -> None:
        original(seconds)
        if sup.state.terminal:
            sup._on_signal(signal.SIGTERM, None)

    sup.waiter = term_in_the_final_wait
    assert sup.run() == RunState.DONE
    assert clock.monotonic() < 1010.0


def test_a_stop_asked_by_signal_ends_the_run_stopped_without_a_stop_request_file(tmp_path):
    def dies_on_term(t: float, sigs: List[int]) -> Optional[ExitStatus]:
        return ExitStatus(signal=signal.SIGTERM) if signal.SIGTERM in sigs else None

    sup, _procs, _ckpts, clock, _lines = make(tmp_path, [dies_on_term], full=(1e9, 1e9))
    original = clock.sleep

    def stop_at_3s(seconds: float) -> None:
        original(seconds)
        if sup.state == RunState.RUNNING and clock.monotonic() >= 1003.0:
            sup._on_signal(STOP_SIGNAL, None)  # what the handler does: `onbox stop` on a full disk

    sup.waiter = stop_at_3s
    assert sup.run() == RunState.STOPPED
    assert sup.last_exit["classification"] == "stopped" and not os.path.exists(sup.rd.stop_request)


def test_records_raise_what_is_not_a_disk_fault_and_drop_the_oldest_held_events(tmp_path, monkeypatch):
    clock = FakeClock()
    rd = FillableRunDir(str(tmp_path / "r"), clock, (0.0, 1e9))
    os.makedirs(rd.path)
    rec = RunRecords(rd, clock.time)
    monkeypatch.setattr(records, "HELD_EVENTS", 3)
    assert rec.append_event({"n": 0}) is True  # starts the fault
    assert [rec.append_event({"n": n}) for n in range(1, 5)] == [False] * 4
    assert rec.snapshot()["held_events"] == 3 and rec.snapshot()["dropped_events"] == 2
    rd.full = (0.0, 0.0)
    ended = rec.recover({"run": "r", "state": "running"})
    assert ended is not None and ended["dropped_events"] == 2 and rec.snapshot() is None
    with open(rd.events_path) as f:
        assert [json.loads(line)["n"] for line in f] == [2, 3, 4]
    rd.full, rd.err = (0.0, 1e9), errno.EACCES
    with pytest.raises(PermissionError):  # a permission problem is a bug to see, not a fault to ride out
        rec.append_event({"n": 5})


def test_the_spool_and_the_seq_outlive_a_disk_that_refuses_them(tmp_path, monkeypatch):
    spool = Spool(str(tmp_path / "spool"))
    seq = SeqCounter(str(tmp_path / "seq.json"), first=100)
    faults: List[OSError] = []
    import onbox.heartbeat.spool as spool_mod

    def refuse(path, data, mode=0o600):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(spool_mod, "atomic_write", refuse)
    monkeypatch.setattr(spool_mod, "atomic_write_json", lambda path, obj, mode=0o600: refuse(path, b""))
    assert [seq.next(on_fault=faults.append) for _ in range(3)] == [100, 101, 102]
    spool.put(100, {"seq": 100}, on_fault=faults.append)
    assert spool.pending(10) == [(100, {"seq": 100})] and spool.backlog() == 1  # held in memory, still sent
    spool.ack([100])
    assert spool.pending(10) == [] and len(faults) == 4
    with pytest.raises(OSError):
        spool.put(101, {"seq": 101})  # without on_fault: raised as before


def test_a_failure_during_the_fault_is_restarted_as_usual(tmp_path):
    sup, procs, _ckpts, _clock, _lines = make(tmp_path, [exits_after(3.0, 1), exits_after(3.0, 0)],
                                              full=(2.0, 30.0), restart="on-failure", backoff_initial=1.0)
    assert sup.run() == RunState.DONE
    assert len(procs.spawned) == 2 and round(procs.spawned[1][0] - procs.spawned[0][0]) == 4  # 3 s + 1 s backoff
    state, events = on_disk(sup)
    assert state["state"] == "done" and [a["exit"]["code"] for a in state["attempts"]] == [1, 0]
    assert [e["new"] for e in events if e["type"] == "state"] == [
        "running", "backoff", "starting", "running", "done"]


def test_a_preemption_during_the_fault_is_forwarded_and_committed(tmp_path):
    def dies_on_term(t: float, sigs: List[int]) -> Optional[ExitStatus]:
        return ExitStatus(signal=signal.SIGTERM) if signal.SIGTERM in sigs else None

    sup, procs, ckpts, clock, _lines = make(tmp_path, [dies_on_term], full=(2.0, 30.0), grace=10.0)
    original = clock.sleep

    def preempt_at_5s(seconds: float) -> None:
        original(seconds)
        if sup.state == RunState.RUNNING and clock.monotonic() >= 1005.0:
            sup._on_signal(signal.SIGTERM, None)

    sup.waiter = preempt_at_5s
    assert sup.run() == RunState.PREEMPTED
    assert [s for _, s in procs.signals] == [signal.SIGTERM] and len(ckpts.finals) == 1
    state, _ = on_disk(sup)
    assert state["state"] == "preempted"
