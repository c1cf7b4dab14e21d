"""The waits of `onbox stop` and of a launch's lease go through the clock seam (onbox/clock.py): with a FakeClock
they are counted, not slept, and their bounds are the clock's. Real waits: tests/integration/test_hardening_agent.py
(`onbox stop --timeout` running out against a live lock holder)."""
from __future__ import annotations

import os

import pytest

from onbox import subsystems
from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.errors import JobFailed, UnfitError
from onbox.launch import stopping
from onbox.proc import ProcessSeam
from onbox.supervisor.rundir import RunDir


class HeldLock:
    """The run's lock as a live agent holds it: never ours."""

    def acquire(self) -> bool:
        return False

    def release(self) -> None:
        raise AssertionError("released a lock it never took")


def live_agent_state() -> dict:
    """state.json of a running run whose agent is alive (this test process: pid and start time match)."""
    me = os.getpid()
    return {"run": "r", "state": "running", "agent_pid": me, "agent_start_time": ProcessSeam().start_time_of(me),
            "child_pid": None}


def test_onbox_stop_waits_on_the_clock_seam_until_its_bound(onbox_home):
    rd = RunDir(str(onbox_home / "runs" / "r"))
    os.makedirs(rd.path)
    clock = FakeClock()
    rd_state = live_agent_state()
    rd.read_state = lambda: rd_state  # type: ignore[method-assign]
    with pytest.raises(JobFailed, match="did not stop within 5 s"):
        stopping._wait_for_agent(rd, HeldLock(), 5.0, True, clock)
    assert len(clock.sleeps) == 50 and set(clock.sleeps) == {stopping.POLL_S}


def test_onbox_stop_returns_without_a_sleep_once_the_agent_has_ended(onbox_home):
    rd = RunDir(str(onbox_home / "runs" / "r"))
    os.makedirs(rd.path)
    ended = dict(live_agent_state(), state="stopped", agent_pid=None)
    rd.read_state = lambda: ended  # type: ignore[method-assign]

    class Free(HeldLock):
        def release(self) -> None:
            pass

    clock = FakeClock()
    stopping._wait_for_agent(rd, Free(), 5.0, True, clock)
    assert clock.sleeps == []


def test_take_lease_retries_on_the_clock_seam(tmp_path, monkeypatch):
    from onbox.checkpoints.leases import fencing

    tries = []

    def unreachable(*a, **k):
        tries.append(1)
        raise OSError("Transport endpoint is not connected")

    monkeypatch.setattr(fencing.RunLease, "take", unreachable)
    cfg = RunConfig(name="r", command=["true"], durable=str(tmp_path / "durable")).validate()
    clock = FakeClock()
    with pytest.raises(UnfitError, match="cannot take run r's lease"):
        subsystems.take_lease(cfg, "r", False, clock)
    assert len(tries) == 3 and clock.sleeps == [1.0, 3.0]
