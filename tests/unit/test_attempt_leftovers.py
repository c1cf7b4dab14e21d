"""Leftovers of an attempt, through the process seam over a scripted process table and a FakeClock: the real tree
walk, marker scan, escalation (TERM, wait, KILL) and start-time check run; the OS is fake. Each process is what a
test scripted, so a test can tell a tracked process from one that got its pid since."""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Callable, Dict, List, Optional, Set, Tuple

from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.proc import Child, ExitStatus, ProcessSeam, ProcInfo, ProcRef
from onbox.supervisor.hooks import Hooks, NoCheckpoints, NoReaper, NoTelemetry
from onbox.supervisor.leftovers import MARKER_VAR
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.rundir import RunDir

CHILD = 1000


@dataclasses.dataclass
class Proc:
    ppid: int
    sid: int
    start: int
    env: Dict[str, str]
    command: str
    ignores: Set[int] = dataclasses.field(default_factory=set)  # signals it survives (TERM when it ignores it)


class ProcTable(ProcessSeam):
    """A ProcessSeam whose /proc is a dict and whose time is a FakeClock. `script` holds (at, action) pairs run
    once the clock passes `at` (seconds after the child's spawn): forks, exits, a pid handed to a new process."""

    def __init__(self, clock: FakeClock, child_exit_at: float) -> None:
        super().__init__(proc="/nonexistent", clock=clock)
        self.clock = clock
        self.procs: Dict[int, Proc] = {}
        self.sent: List[Tuple[float, int, int]] = []  # (time, pid, signal) of every signal that was delivered
        self.script: List[Tuple[float, Callable[[], None]]] = []
        self.child_exit_at = child_exit_at
        self.spawned_at: Optional[float] = None
        self.spawns = 0

    # -- scripting
    def fork(self, parent: int, pid: int, command: str, setsid: bool = False, scrub_env: bool = False,
             ignores: Set[int] = frozenset()) -> None:
        p = self.procs[parent]
        self.procs[pid] = Proc(ppid=parent, sid=pid if setsid else p.sid, start=pid, command=command,
                               env={} if scrub_env else dict(p.env), ignores=set(ignores))

    def exit(self, pid: int) -> None:
        del self.procs[pid]
        for p in self.procs.values():  # orphans reparent to init
            if p.ppid == pid:
                p.ppid = 1

    def _run_script(self) -> None:
        if self.spawned_at is None:
            return
        t = self.clock.monotonic() - self.spawned_at
        due = [(at, act) for at, act in self.script if at <= t]
        self.script = [(at, act) for at, act in self.script if at > t]
        for _, act in due:
            act()

    # -- what the supervisor calls
    def spawn(self, argv, env, cwd, log_path) -> Child:
        self.spawns += 1
        pid = CHILD if self.spawns == 1 else CHILD + 5000 * (self.spawns - 1)
        self.procs[pid] = Proc(ppid=os.getpid(), sid=pid, start=pid, env=dict(env), command=" ".join(argv))
        self.spawned_at = self.clock.monotonic()
        return Child(pid=pid, sid=pid, pgid=pid, start_time=pid)

    def poll(self, child: Child) -> Optional[ExitStatus]:
        self._run_script()
        if child.pid == CHILD and self.clock.monotonic() - (self.spawned_at or 0) >= self.child_exit_at:
            if CHILD in self.procs:
                self.exit(CHILD)
            return ExitStatus(code=0)
        return None if self.spawns > 1 or child.pid in self.procs else ExitStatus(code=0)

    def signal_group(self, pgid: int, sig: int) -> bool:
        return True

    def reap_zombies(self, keep=()) -> List[int]:
        return []

    # -- the /proc readers and the one signal primitive, over the table
    def info(self, pid: int) -> Optional[ProcInfo]:
        self._run_script()
        p = self.procs.get(pid)
        return ProcInfo(pid=pid, ppid=p.ppid, pgid=p.sid, sid=p.sid, start_time=p.start, comm="x") if p else None

    def pids(self) -> List[int]:
        return sorted(self.procs)

    def children(self, pid: int) -> List[int]:
        return [c for c, p in sorted(self.procs.items()) if p.ppid == pid]

    def environ(self, pid: int) -> Dict[str, str]:
        return dict(self.procs[pid].env) if pid in self.procs else {}

    def marked(self, name: str, value: str) -> List[ProcInfo]:
        return [i for i in (self.info(p) for p in self.pids() if self.environ(p).get(name) == value) if i]

    def command(self, pid: int) -> str:
        return self.procs[pid].command if pid in self.procs else ""

    def session_members(self, sid: int) -> List[int]:
        return [pid for pid, p in sorted(self.procs.items()) if p.sid == sid]

    def _pidfd_open(self, pid: int) -> Optional[int]:
        return None

    def signal_pid(self, pid: int, sig: int) -> bool:
        p = self.procs.get(pid)
        if p is None:
            return False
        self.sent.append((self.clock.monotonic(), pid, int(sig)))
        if int(sig) not in p.ignores:
            self.exit(pid)
        return True


def make(tmp_path, table: ProcTable, clock: FakeClock, **fields) -> Supervisor:
    cfg = RunConfig(name="lo", command=["train"], notice_source="none", tick_interval=1.0, restart="never",
                    **fields).validate()
    rd = RunDir(str(tmp_path / "lo"))
    os.makedirs(rd.path, exist_ok=True)
    return Supervisor(cfg, rd, proc=table, clock=clock,  # type: ignore[arg-type]
                      hooks_factory=lambda ctx: Hooks(NoCheckpoints(), NoTelemetry(), NoReaper()),
                      seams=Seams(oom_reader=lambda: None, environ={}, log=lambda m: None, waiter=clock.sleep))


def test_what_left_the_session_is_stopped_at_the_end_whether_the_tree_poll_or_the_marker_found_it(tmp_path):
    clock = FakeClock()
    table = ProcTable(clock, child_exit_at=5.0)
    table.script = [
        (0.5, lambda: table.fork(CHILD, 1001, "python loader.py")),
        # seen by the tick at 1 s under 1001, then orphaned (setsid, environment scrubbed): only the tree poll knows
        (0.7, lambda: table.fork(1001, 1002, "sleep 301", setsid=True, scrub_env=True)),
        (2.5, lambda: table.exit(1001)),
        # double-forked between two ticks (its parent gone at once), in a session of its own: only the marker
        # tells; and it ignores TERM
        (3.1, lambda: double_fork(table, 1010, 1003, "daemon --fork", ignores={signal.SIGTERM})),
        # an orphan that kept the session (a DataLoader worker): the session scan finds it
        (3.2, lambda: table.fork(CHILD, 1004, "python worker.py")),
    ]
    sup = make(tmp_path, table, clock, term_timeout=7.0)
    assert sup.run() == RunState.DONE
    assert CHILD not in table.procs and not {1002, 1003, 1004} & set(table.procs)
    t0 = table.sent[0][0]
    assert [(round(t - t0, 1), pid, sig) for t, pid, sig in table.sent] == [
        (0.0, 1004, signal.SIGTERM), (0.0, 1002, signal.SIGTERM), (0.0, 1003, signal.SIGTERM),
        (7.0, 1003, signal.SIGKILL)]  # KILL only to what outlived term_timeout, on the fake clock
    evs = _events(sup)
    steps = [(e["signal"], e["pids"]) for e in evs if e["type"] == "attempt_leftovers_signal"]
    assert steps == [("SIGTERM", [1004, 1002, 1003]), ("SIGKILL", [1003])]
    (done,) = [e for e in evs if e["type"] == "attempt_leftovers_stopped"]
    assert done["pids"] == [1004, 1002, 1003] and done["killed"] == [1003] and done["survived"] == []
    assert done["commands"] == ["python worker.py", "sleep 301", "daemon --fork"]
    assert sup.attempts[0]["marker"] and MARKER_VAR not in os.environ


def test_a_tracked_process_whose_pid_went_to_another_process_is_never_signalled(tmp_path):
    clock = FakeClock()
    table = ProcTable(clock, child_exit_at=5.0)

    def recycle() -> None:  # 1002 ends; an unrelated process (another session, no marker) gets pid 1002
        table.exit(1002)
        table.procs[1002] = Proc(ppid=1, sid=1002, start=9999, env={}, command="someone else's")

    table.script = [(0.5, lambda: table.fork(CHILD, 1002, "sleep 301", setsid=True, scrub_env=True)),
                    (2.0, recycle)]
    sup = make(tmp_path, table, clock)
    assert sup.run() == RunState.DONE
    assert table.sent == [] and table.procs[1002].command == "someone else's"
    assert not [e for e in _events(sup) if e["type"].startswith("attempt_leftovers")]


def test_the_escalation_checks_the_start_time_before_every_signal(tmp_path):
    clock = FakeClock()
    table = ProcTable(clock, child_exit_at=0.0)
    table.procs[77] = Proc(ppid=1, sid=77, start=500, env={}, command="sleep 301", ignores={signal.SIGTERM})
    stale = ProcRef(77, 400)  # what was seen once under pid 77: another process now
    assert not table.signal_process(stale, signal.SIGTERM)
    stopped = table.kill_session(4242, 1.0, also=lambda: [stale])
    assert stopped.found == [] and table.sent == []

    def recycled_while_waiting() -> None:  # 77 (ignoring TERM) ends during the wait; 77 goes to a newcomer
        table.exit(77)
        table.procs[77] = Proc(ppid=1, sid=77, start=600, env={}, command="newcomer")

    table.spawned_at = clock.monotonic()
    table.script = [(0.5, recycled_while_waiting)]
    stopped = table.kill_session(4242, 1.0, also=lambda: [ProcRef(77, 500)])
    assert [(pid, sig) for _, pid, sig in table.sent] == [(77, signal.SIGTERM)]  # never a KILL to the newcomer
    assert stopped.pids == [77] and stopped.killed == [] and table.procs[77].command == "newcomer"


def test_a_relaunch_stops_the_leftovers_of_an_earlier_agents_attempt_found_by_its_recorded_marker(tmp_path):
    """The agent died before its attempt ended: the next agent knows that attempt only from state.json."""
    from onbox import fsutil
    from onbox.proc import boot_id

    clock = FakeClock()
    table = ProcTable(clock, child_exit_at=1e9)
    marker = "lo/0/5eed"
    table.procs[1003] = Proc(ppid=1, sid=1003, start=1003, env={MARKER_VAR: marker}, command="daemon --fork")
    table.procs[1004] = Proc(ppid=1, sid=1004, start=1004, env={MARKER_VAR: "lo/0/other"}, command="not this one")
    rd = RunDir(str(tmp_path / "lo"))
    os.makedirs(rd.path)
    fsutil.atomic_write_json(rd.state_path, {"run": "lo", "state": "running", "attempts": [
        {"n": 0, "pid": 900, "sid": 900, "pgid": 900, "start_time": 900, "boot_id": boot_id(), "marker": marker}]})
    sup = make(tmp_path, table, clock)
    sup._start_attempt()
    assert [(pid, sig) for _, pid, sig in table.sent] == [(1003, signal.SIGTERM)]
    assert 1003 not in table.procs and 1004 in table.procs
    assert sup.state == RunState.RUNNING and sup.attempts[1]["marker"] != marker


def double_fork(table: ProcTable, middle: int, pid: int, command: str, ignores: Set[int]) -> None:
    table.fork(CHILD, middle, "sh")
    table.fork(middle, pid, command, setsid=True, ignores=ignores)
    table.exit(middle)


def _events(sup: Supervisor) -> List[dict]:
    import json

    with open(sup.rd.events_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_tree_poll_forgets_dead_processes_once_it_remembers_many(tmp_path, monkeypatch):
    from onbox.supervisor import leftovers

    monkeypatch.setattr(leftovers, "PRUNE_AT", 3)
    clock = FakeClock()
    table = ProcTable(clock, child_exit_at=1e9)
    table.spawn(["train"], {}, None, "")
    tracked = leftovers.AttemptProcesses(table, ProcRef(CHILD, CHILD), None)
    for pid in range(1001, 1006):  # five short-lived helpers, one poll each
        table.fork(CHILD, pid, "nvidia-smi")
        tracked.poll()
        table.exit(pid)
    table.fork(CHILD, 1010, "python worker.py")
    tracked.poll()
    assert len(tracked.seen) <= 3 and ProcRef(1010, 1010) in tracked.seen
    assert tracked.leftovers() == [ProcRef(1010, 1010)]
