"""Reaper rules through the seams: decisions per holder, the TERM->KILL escalation on a scripted process table,
the memory wait on the fake NVML and a fake clock, attempt ownership from state.json, unreadable processes."""
from __future__ import annotations

import os
import signal

import pytest

from onbox.clock import FakeClock
from onbox.gpu.holders import Holder, HolderScan, device_files
from onbox.gpu.nvml import NvmlSeam
from onbox.gpu.ownership import Attempt, AttemptIndex, attempts_of
from onbox.gpu.reaper import Activity, Decision, decide, memory_settled, reap
from onbox.proc import ProcessSeam, ProcInfo
from tests.fakes.nvml import FakeGpu, FakeNvml, FakeProcess

GiB = 1 << 30


def holder(**kw):
    base = dict(pid=500, ppid=1, uid=1000, user="alice", command="python train.py", state="S", age_s=600.0,
                start_time=1_700_000_000.0, start_ticks=12345, sid=400, pgid=400, devices=["/dev/nvidia0"],
                gpus=[0], other_pid_ns=False, ns_pids=[500], nvml_visible=False, owner="foreign")
    base.update(kw)
    return Holder(**base)


RULES = dict(min_age_s=60, all_users=False, is_root=False, my_uid=1000)


@pytest.mark.parametrize("kw, rules, verdict, reason", [
    (dict(owner="current", run="r", attempt=2), {}, "keep", "current attempt 2 of run r: never reaped"),
    (dict(owner="self"), {}, "keep", "this onbox process or its parent"),
    (dict(owner="earlier", run="r", attempt=0), {}, "reap", "orphan of run r attempt 0 (session 400)"),
    (dict(owner="earlier", age_s=5), {}, "keep", "younger than the minimum age (5 s < 60 s)"),
    (dict(nvml_visible=False), {}, "reap", "invisible to NVML (U11 zombie holder)"),
    (dict(nvml_visible=True), dict(activity=Activity(sampled_gpus={0}, gpu_util={0: 50})), "reap",
     "idle: no GPU activity of it in the last sample"),
    (dict(nvml_visible=True), dict(activity=Activity(busy_pids={500}, sampled_gpus={0}, gpu_util={0: 50})),
     "keep", "busy: NVML saw it using the GPU in the last sample"),
    (dict(nvml_visible=None), dict(activity=Activity(gpu_util={0: 0})), "reap",
     "idle: GPU 0 ran no kernel in the last sample"),
    (dict(nvml_visible=None), dict(activity=Activity(sampled_gpus={0}, gpu_util={0: 80})), "keep",
     "cannot tell whether it is busy: GPU 0 is in use and NVML cannot attribute it"),
    (dict(nvml_visible=True, gpus=[0, 1]), dict(activity=Activity(gpu_util={0: 0, 1: 30})), "keep",
     "cannot tell whether it is busy: GPU 0,1 is in use and NVML cannot attribute it"),
    (dict(uid=0, user="root"), {}, "keep", "owned by root: needs root and --all-users"),
    (dict(uid=0, user="root"), dict(is_root=True, my_uid=0, all_users=False, min_age_s=60), "reap",
     "invisible to NVML (U11 zombie holder)"),
    (dict(uid=7, user="bob"), dict(is_root=True, my_uid=0), "keep", "owned by bob: needs --all-users"),
    (dict(uid=7, user="bob"), dict(is_root=True, my_uid=0, all_users=True), "reap",
     "invisible to NVML (U11 zombie holder)"),
    (dict(other_pid_ns=True, ns_pids=[500, 12]), {}, "keep",
     "lives in another container (PID namespace differs): restart that container"),
    (dict(command="/usr/bin/nvidia-persistenced --user nvidia-persistenced"), {}, "keep",
     "system GPU service (nvidia-persistenced)"),
    (dict(gpus=[], devices=["/dev/nvidiactl"]), {}, "keep", "holds no GPU (driver control files only)"),
])
def test_decisions(kw, rules, verdict, reason):
    r = dict(RULES, **rules)
    d = decide(holder(**kw), **r)
    assert (d.verdict, d.reason) == (verdict, reason)


def test_no_nvml_means_cannot_tell_busy():
    d = decide(holder(nvml_visible=None), nvml_available=False, **RULES)
    assert (d.verdict, d.reason) == ("reap", "NVML not available: cannot tell whether it is busy")


class ScriptedProcs(ProcessSeam):
    """A process table: pid -> start ticks; `dies_on` says which signal ends which pid; `stuck` ignores KILL."""

    def __init__(self, table, dies_on, stuck=(), denied=()):
        super().__init__(proc="/nonexistent")
        self.table, self.dies_on, self.stuck, self.denied = dict(table), dict(dies_on), set(stuck), set(denied)
        self.sent = []

    def info(self, pid):
        ticks = self.table.get(pid)
        return None if ticks is None else ProcInfo(pid=pid, ppid=1, pgid=pid, sid=pid, start_time=ticks, comm="x")

    def command(self, pid):
        return "x"

    def reap_zombies(self, keep=()):
        return []

    def signal_pid(self, pid, sig):
        if pid in self.denied or pid not in self.table:  # EPERM, ESRCH
            return False
        self.sent.append((pid, sig))
        if pid not in self.stuck and (sig == signal.SIGKILL or self.dies_on.get(pid) == sig):
            del self.table[pid]
        return True


def test_reap_escalates_term_then_kill_and_reports_each_pid():
    ds = [Decision(holder(pid=p, start_ticks=p * 10), "reap", "r") for p in (1, 2, 3, 4, 5)]
    ds.append(Decision(holder(pid=6, start_ticks=60), "keep", "current"))
    procs = ScriptedProcs({1: 10, 2: 20, 3: 30, 4: 999, 5: 50, 6: 60},
                          dies_on={1: signal.SIGTERM}, stuck={3}, denied={5})
    clock = FakeClock()
    log = []
    reap(ds, term_timeout_s=2, kill_timeout_s=3, poll_s=0.5, procs=procs, clock=clock, record=log.append)
    outcomes = {d.holder.pid: d.outcome for d in ds}
    assert outcomes[1] == "terminated by SIGTERM"
    assert outcomes[2] == "killed by SIGKILL (ignored SIGTERM)"
    assert outcomes[3].startswith("still alive 3 s after SIGKILL")
    assert outcomes[4] == "already gone"  # same pid, different start ticks: recycled, never signalled
    assert outcomes[5] == "permission denied (owned by alice)"
    assert outcomes[6] == "not touched: current"
    assert (4, signal.SIGTERM) not in procs.sent and all(p != 6 for p, _ in procs.sent)
    assert [(e["pid"], e["signal"], e["result"]) for e in log] == [
        (1, "SIGTERM", "sent"), (2, "SIGTERM", "sent"), (3, "SIGTERM", "sent"), (5, "SIGTERM", "denied"),
        (2, "SIGKILL", "sent"), (3, "SIGKILL", "sent")]
    assert sum(clock.sleeps) <= 2 + 3 + 1  # bounded by the two timeouts


class FreeingFake(FakeNvml):
    """The driver frees a dead context's memory a few polls after its holder died."""

    def __init__(self, *a, polls_until_free=3, **k):
        super().__init__(*a, **k)
        self.polls = 0
        self.polls_until_free = polls_until_free

    def nvmlDeviceGetMemoryInfo(self, h):
        self.polls += 1
        if self.polls > self.polls_until_free:
            h.memory_used = sum(p.usedGpuMemory for p in h.processes)
        return super().nvmlDeviceGetMemoryInfo(h)


def test_memory_wait_until_released():
    fake = FreeingFake([FakeGpu(memory_used=30 * GiB, processes=[FakeProcess(9, 2 * GiB)])])
    clock = FakeClock()
    out = memory_settled(NvmlSeam(fake), [0], timeout_s=60, poll_s=1, clock=clock)
    assert out == {"waited_s": 3.0, "released": True, "gpus": {0: 2 * GiB}}


def test_memory_wait_is_bounded():
    fake = FreeingFake([FakeGpu(memory_used=30 * GiB)], polls_until_free=10**6)
    out = memory_settled(NvmlSeam(fake), [0], timeout_s=5, poll_s=1, clock=FakeClock())
    assert out["released"] is False and out["waited_s"] == 5.0


def test_memory_wait_without_driver_is_skipped():
    out = memory_settled(NvmlSeam(FakeNvml(driver=False)), [0], timeout_s=5, poll_s=1, clock=FakeClock())
    assert out["skipped"].startswith("NVML not available")


def supervisor_state(**kw):
    doc = {"run": "r", "state": "running", "current_sid": 20, "attempts": [
        {"n": 0, "pid": 10, "sid": 10, "pgid": 10, "start_time": 1000, "started_at": 1_700_000_000.0},
        {"n": 1, "pid": 20, "sid": 20, "pgid": 20, "start_time": 5000, "started_at": 1_700_000_040.0}]}
    doc.update(kw)
    return doc


def test_attempts_current_earlier_terminal():
    a = attempts_of(supervisor_state(), "r", leader_alive=lambda pid, ticks: True)
    assert [(x.n, x.sid, x.start_ticks, x.current) for x in a] == [(0, 10, 1000, False), (1, 20, 5000, True)]
    # the leader died (restart pending): what it left is an orphan
    a = attempts_of(supervisor_state(), "r", leader_alive=lambda pid, ticks: pid != 20)
    assert [x.current for x in a] == [False, False]
    # between attempts the supervisor names no current session
    a = attempts_of(supervisor_state(state="backoff", current_sid=None), "r", leader_alive=lambda p, t: True)
    assert [x.current for x in a] == [False, False]
    for terminal in ("done", "failed", "preempted", "stopped"):
        a = attempts_of(supervisor_state(state=terminal), "r", leader_alive=lambda pid, ticks: True)
        assert [x.current for x in a] == [False, False]
    # an older state file without current_sid: the newest attempt is the current one
    doc = supervisor_state()
    del doc["current_sid"]
    assert [x.current for x in attempts_of(doc, "r", leader_alive=lambda p, t: True)] == [False, True]


def test_leader_check_uses_start_ticks(tmp_path):
    import onbox.gpu.ownership as own

    me = os.getpid()
    with open("/proc/%d/stat" % me) as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])
    assert own._leader_alive(me, ticks) and not own._leader_alive(me, ticks + 1)  # a recycled pid is not it


def test_recycled_session_id_is_not_ours():
    index = AttemptIndex([Attempt(run="r", n=0, sid=400, pgid=400, pid=400, start_ticks=5000, started_at=None,
                                  current=False)])
    assert index.owner_of(holder(sid=400, start_ticks=5000)).n == 0
    assert index.owner_of(holder(sid=400, start_ticks=4999)) is None  # started before the session's leader
    by_wall = AttemptIndex([Attempt(run="r", n=0, sid=400, pgid=400, pid=400, start_ticks=None,
                                    started_at=1_700_000_000.0, current=False)])
    assert by_wall.owner_of(holder(sid=400, start_time=1_700_000_100.0)).n == 0
    assert by_wall.owner_of(holder(sid=400, start_time=1_600_000_000.0)) is None


def test_attempt_index_skips_torn_state_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "state.json").write_text("{not json")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "state.json").write_text('{"state": "running", "attempts": [{"n": 0, "sid": 77}]}')
    index = AttemptIndex.load(str(tmp_path))
    assert list(index.by_sid) == [77] and index.by_sid[77][0].run == "b"


def test_unreadable_processes_are_counted_not_dropped(tmp_path):
    """Root reads every fd table here, so the denial comes through the listdir/readlink seams."""
    dev = tmp_path / "nvidia0"
    dev.write_bytes(b"")
    proc = tmp_path / "proc"
    for pid in ("100", "200", "300"):
        (proc / pid / "fd").mkdir(parents=True)
    os.symlink(str(dev), str(proc / "100" / "fd" / "3"))
    os.symlink(str(dev), str(proc / "300" / "fd" / "4"))
    (proc / "self").mkdir()

    def path_of(dir_fd):
        return os.readlink("/proc/self/fd/%d" % dir_fd)

    def listdir(path):
        if isinstance(path, int) and path_of(path).endswith("/200/fd"):
            raise PermissionError(13, "Permission denied")
        return os.listdir(path)

    def readlink(name, dir_fd):
        if path_of(dir_fd).endswith("/300/fd"):
            raise PermissionError(13, "Permission denied")
        return os.readlink(name, dir_fd=dir_fd)

    scan = HolderScan(str(tmp_path / "nvidia*"), proc=str(proc), listdir=listdir, readlink=readlink)
    hits, scanned, unreadable, vanished = scan._raw(device_files(str(tmp_path / "nvidia*")))
    assert hits == {100: [str(dev)]} and scanned == 3 and sorted(unreadable) == [200, 300] and vanished == 0


def test_memory_wait_survives_a_gpu_lost_meanwhile():
    fake = FakeNvml([FakeGpu(memory_used=30 * GiB)])
    seam = NvmlSeam(fake)
    seam.available()
    fake.gpus[0].lost = True
    out = memory_settled(seam, [0], timeout_s=5, poll_s=1, clock=FakeClock())
    assert out["skipped"].startswith("NVML error while waiting") and "GPU is lost" in out["skipped"]


class SlowTeardown(FakeNvml):
    """NVML keeps listing a killed process (and its memory) until the driver finishes tearing its context down."""

    def __init__(self, *a, polls_until_free=4, **k):
        super().__init__(*a, **k)
        self.polls = 0
        self.polls_until_free = polls_until_free

    def nvmlDeviceGetMemoryInfo(self, h):
        self.polls += 1
        if self.polls > self.polls_until_free:
            h.processes = [p for p in h.processes if p.pid != 66]
            h.memory_used = sum(p.usedGpuMemory for p in h.processes)
        return super().nvmlDeviceGetMemoryInfo(h)


def test_memory_wait_ignores_what_nvml_still_lists_for_reaped_pids():
    fake = SlowTeardown([FakeGpu(memory_used=32 * GiB, processes=[FakeProcess(66, 30 * GiB),
                                                                   FakeProcess(9, 2 * GiB)])])
    out = memory_settled(NvmlSeam(fake), [0], timeout_s=60, poll_s=1, clock=FakeClock(), gone_pids=[66])
    assert out == {"waited_s": 4.0, "released": True, "gpus": {0: 2 * GiB}}


def test_a_recycled_session_id_now_leading_another_runs_live_attempt_is_never_reaped(tmp_path):
    # run "a" attempt 0 had session 400 long ago (its session was emptied when the attempt ended, so the kernel
    # could hand pid 400 out again); run "b"'s CURRENT attempt is now session 400. Before a's next attempt its
    # reaper is told "400 is one of my earlier sessions": b's live training process must stay untouched.
    from onbox.gpu.holders import ScanResult
    from onbox.gpu.ownership import classify

    old_a = Attempt(run="a", n=0, sid=400, pgid=400, pid=400, start_ticks=1000, started_at=None, current=False)
    live_b = Attempt(run="b", n=3, sid=400, pgid=400, pid=400, start_ticks=90000, started_at=None, current=True)
    for order in ([old_a, live_b], [live_b, old_a]):
        index = AttemptIndex(order)
        assert index.owner_of(holder(sid=400, start_ticks=90000)) is live_b  # the newest session 400 before it
        assert index.owner_of(holder(sid=400, start_ticks=2000)) is old_a  # a real orphan of a's attempt 0
        h = holder(pid=400, sid=400, start_ticks=90000)
        scan = ScanResult(holders=[h], scanned=1, unreadable=[], vanished=0, devices=[], nvml_unmatched=[],
                          nvml_available=False, duration_s=0.0)
        classify(scan, index, my_pid=1, extra_earlier_sids=[400], proc=str(tmp_path))
        assert (h.owner, h.run, h.attempt) == ("current", "b", 3)
        assert decide(h, **RULES).verdict == "keep"


def test_a_process_that_started_after_an_attempt_ended_is_not_in_its_session(tmp_path):
    # the supervisor empties an attempt's session when it ends, so pid 400 may then lead a foreign session (the
    # user's notebook on the GPU): a holder that started after attempt 0 ended is not its orphan, even though the
    # supervisor lists 400 among its earlier sessions
    from onbox.gpu.holders import ScanResult
    from onbox.gpu.ownership import classify

    old = Attempt(run="a", n=0, sid=400, pgid=400, pid=400, start_ticks=1000, started_at=1_700_000_000.0,
                  current=False, ended_at=1_700_000_500.0)
    index = AttemptIndex([old])
    assert index.owner_of(holder(sid=400, start_ticks=2000, start_time=1_700_000_100.0)) is old
    late = holder(sid=400, start_ticks=900000, start_time=1_700_009_000.0)
    assert index.owner_of(late) is None
    scan = ScanResult(holders=[late], scanned=1, unreadable=[], vanished=0, devices=[], nvml_unmatched=[],
                      nvml_available=False, duration_s=0.0)
    classify(scan, index, my_pid=1, extra_earlier_sids=[400], proc=str(tmp_path))
    assert late.owner == "foreign"
    doc = {"run": "a", "state": "backoff", "current_sid": None,
           "attempts": [{"n": 0, "pid": 400, "sid": 400, "start_time": 1000, "started_at": 1_700_000_000.0,
                         "ended_at": 1_700_000_500.0}]}
    assert attempts_of(doc, "a", leader_alive=lambda p, t: False)[0].ended_at == 1_700_000_500.0
