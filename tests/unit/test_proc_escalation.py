"""The one escalation (onbox.proc.escalate: TERM, a deadline on the clock, KILL, a bounded wait for the KILL) and
kill_session's policy over it, on a scripted process table and a FakeClock: every signal's time is exact, and no
test sleeps."""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Callable, Dict, List, Optional, Set, Tuple

import pytest

from onbox.clock import FakeClock
from onbox.proc import ProcessSeam, ProcInfo, ProcRef, Stopped, escalate

TERM, KILL = signal.SIGTERM, signal.SIGKILL


@dataclasses.dataclass
class P:
    start: int
    sid: int = 500
    survives: Set[int] = dataclasses.field(default_factory=set)  # signals it lives through
    refuses: bool = False  # another user's process: every signal to it is EPERM


class Table(ProcessSeam):
    """A ProcessSeam over a dict of processes and a FakeClock; `script` runs (at, action) once the clock passes at."""

    def __init__(self, clock: FakeClock, procs: Dict[int, P]) -> None:
        super().__init__(proc="/nonexistent", clock=clock)
        self.t0 = clock.monotonic()
        self.procs = procs
        self.sent: List[Tuple[float, int, str]] = []  # (seconds since start, pid, signal) of each delivered signal
        self.script: List[Tuple[float, Callable[[], None]]] = []

    def now(self) -> float:
        return round(self.clock.monotonic() - self.t0, 3)

    def _run_script(self) -> None:
        due = [act for at, act in self.script if at <= self.now()]
        self.script = [(at, act) for at, act in self.script if at > self.now()]
        for act in due:
            act()

    def info(self, pid: int) -> Optional[ProcInfo]:
        self._run_script()
        p = self.procs.get(pid)
        return ProcInfo(pid=pid, ppid=1, pgid=p.sid, sid=p.sid, start_time=p.start, comm="x") if p else None

    def session_members(self, sid: int) -> List[int]:
        self._run_script()
        return [pid for pid, p in sorted(self.procs.items()) if p.sid == sid]

    def command(self, pid: int) -> str:
        return "cmd %d" % pid

    def reap_zombies(self, keep=()) -> List[int]:
        return []

    def signal_pid(self, pid: int, sig: int) -> bool:
        p = self.procs.get(pid)
        if p is None or p.refuses:
            return False
        self.sent.append((self.now(), pid, signal.Signals(sig).name))
        if sig not in p.survives:
            del self.procs[pid]
        return True


def refs(table: Table, *pids: int) -> List[ProcRef]:
    return [ProcRef(pid, table.procs[pid].start) for pid in pids]


def live(table: Table, wanted: List[ProcRef]) -> Callable[[], List[ProcRef]]:
    return lambda: [r for r in wanted if table.start_time_of(r.pid) == r.start_time]


def test_term_then_kill_exactly_at_the_deadline_each_step_logged_and_reported():
    table = Table(FakeClock(), {10: P(1), 11: P(2, survives={TERM})})
    logs: List[str] = []
    steps: List[Tuple[str, List[int], List[Optional[str]]]] = []

    def step(name: str, rs: List[ProcRef], report: Stopped) -> None:
        steps.append((name, [r.pid for r in rs], [report.result(r, name) for r in rs]))

    out = escalate(table, live(table, refs(table, 10, 11)), 3.0, table.clock, log=logs.append, on_step=step)
    assert table.sent == [(0.0, 10, "SIGTERM"), (0.0, 11, "SIGTERM"), (3.0, 11, "SIGKILL")]
    assert steps == [("SIGTERM", [10, 11], ["sent", "sent"]), ("SIGKILL", [11], ["sent"])]
    assert (out.pids, [r.pid for r in out.killed], out.survived, out.denied) == ([10, 11], [11], [], [])
    assert out.commands == {ProcRef(10, 1): "cmd 10", ProcRef(11, 2): "cmd 11"}
    assert logs == ["TERM to 2 process(es): 10 (cmd 10), 11 (cmd 11)",
                    "KILL to 1 process(es) still alive 3.0 s after TERM: [11]"]


def test_processes_that_go_on_term_end_the_wait_at_once():
    table = Table(FakeClock(), {10: P(1), 11: P(2)})
    out = escalate(table, live(table, refs(table, 10, 11)), 30.0, table.clock)
    assert [s for _, _, s in table.sent] == ["SIGTERM", "SIGTERM"] and out.killed == []
    assert table.now() == 0.0  # nothing left to wait for: no sleep at all


def test_one_that_goes_late_is_waited_for_and_never_killed():
    table = Table(FakeClock(), {10: P(1, survives={TERM})})
    table.script = [(1.2, lambda: table.procs.pop(10))]  # it finishes its checkpoint, then exits
    out = escalate(table, live(table, refs(table, 10)), 5.0, table.clock, poll=0.1)
    assert table.sent == [(0.0, 10, "SIGTERM")] and out.killed == [] and table.now() == pytest.approx(1.2)


def test_a_newcomer_forked_while_waiting_gets_its_own_term_and_the_same_deadline():
    table = Table(FakeClock(), {10: P(1, survives={TERM})})
    table.script = [(0.5, lambda: table.procs.update({12: P(3, survives={TERM})}))]
    out = escalate(table, lambda: [ProcRef(pid, table.procs[pid].start) for pid in table.session_members(500)],
                   2.0, table.clock, poll=0.25)
    assert table.sent == [(0.0, 10, "SIGTERM"), (0.5, 12, "SIGTERM"), (2.0, 10, "SIGKILL"), (2.0, 12, "SIGKILL")]
    assert out.pids == [10, 12]


def test_one_alive_after_the_kill_wait_is_reported_stuck():
    table = Table(FakeClock(), {10: P(1, survives={TERM, KILL})})
    logs: List[str] = []
    seen: List[str] = []
    out = escalate(table, live(table, refs(table, 10)), 1.0, table.clock, kill_timeout=4.0, poll=0.5,
                   log=logs.append, on_step=lambda name, rs, report: seen.append(name))
    assert out.survived == [ProcRef(10, 1)] and seen == ["SIGTERM", "SIGKILL", "survived"]
    assert table.now() == 5.0  # bounded: the deadline plus the KILL wait
    assert logs[-1] == "still alive 4 s after KILL (stuck in the kernel, state D?): [10]"


def test_a_process_that_refuses_the_signal_is_neither_waited_for_nor_killed():
    table = Table(FakeClock(), {10: P(1, refuses=True), 11: P(2)})
    logs: List[str] = []
    out = escalate(table, live(table, refs(table, 10, 11)), 30.0, table.clock, log=logs.append)
    assert out.denied == [ProcRef(10, 1)] and out.killed == [] and table.now() == 0.0
    assert out.signals == [(ProcRef(10, 1), "SIGTERM", "denied"), (ProcRef(11, 2), "SIGTERM", "sent")]
    assert logs[-1] == "TERM refused by 1 process(es) (not ours to signal): [10]"


def test_a_pid_that_went_to_another_process_is_never_signalled():
    table = Table(FakeClock(), {10: P(7)})
    stale = ProcRef(10, 6)  # seen once with start 6: pid 10 is another process now
    assert not table.signal_process(stale, TERM)
    out = escalate(table, lambda: [stale], 1.0, table.clock)
    assert table.sent == [] and out == Stopped() and 10 in table.procs


def test_nothing_found_means_nothing_done():
    table = Table(FakeClock(), {})
    assert escalate(table, list, 5.0, table.clock) == Stopped() and table.now() == 0.0


# -- kill_session: which processes a session's escalation may touch ---------------------------------------------

def test_kill_session_stops_the_session_on_the_seams_clock():
    table = Table(FakeClock(), {500: P(100), 501: P(101, survives={TERM}), 600: P(102, sid=600)})
    logs: List[str] = []
    out = table.kill_session(500, 2.0, log=logs.append, leader_start=100)
    assert table.sent[-1] == (2.0, 501, "SIGKILL") and 600 in table.procs
    assert out.pids == [500, 501] and logs[0].startswith("TERM to 2 leftover process(es): ")


def test_kill_session_of_a_recycled_session_id_touches_nothing():
    table = Table(FakeClock(), {500: P(900), 501: P(901)})  # pid 500 leads session 500 again, since 900
    logs: List[str] = []
    out = table.kill_session(500, 2.0, log=logs.append, leader_start=100)
    assert table.sent == [] and out == Stopped()
    assert logs == ["session 500 was recycled (its leader pid started at another time): not touched"]


def test_kill_session_spares_members_older_than_the_leader():
    table = Table(FakeClock(), {501: P(50), 502: P(150)})  # 501 started before the session's leader (100)
    table.kill_session(500, 1.0, leader_start=100)
    assert [pid for _, pid, _ in table.sent] == [502] and 501 in table.procs


def test_kill_session_stops_what_also_names_but_never_the_agent_or_init():
    me = os.getpid()
    table = Table(FakeClock(), {1: P(1, sid=1), me: P(5, sid=me), 700: P(70, sid=700)})
    out = table.kill_session(500, 1.0, also=lambda: [ProcRef(1, 1), ProcRef(me, 5), ProcRef(700, 70)])
    assert out.pids == [700] and table.sent == [(0.0, 700, "SIGTERM")]
