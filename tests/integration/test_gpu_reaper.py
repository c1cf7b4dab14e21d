"""The VRAM-zombie reaper against real processes holding stand-in device files (no GPU here; NVML is faked).

A "trainer" opens nvidia0/nvidiactl/nvidia-uvm and forks workers that inherit them (DataLoader workers forked
after CUDA init); its parent is SIGKILLed; the workers keep the files open. The scan must find them, the reaper
must classify them as orphans of our earlier attempt and kill them before the restart, and must never touch the
current attempt or a foreign holder without --force.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from onbox.clock import SystemClock
from onbox.config import RunConfig
from onbox.errors import UsageError
from onbox.fsutil import atomic_write_json
from onbox.gpu.holders import HolderScan
from onbox.gpu.nvml import NvmlSeam
from onbox.gpu.ownership import AttemptIndex, classify
from onbox.gpu.reaper import ReaperHook, decide_all
from onbox.subsystems import make_hooks
from onbox.supervisor.hooks import RunContext
from tests.conftest import subprocess_env
from tests.fakes.nvml import BrokenCount, FakeGpu, FakeNvml, FakeProcess
from tests.polling import wait_for
from tests.processes import Started, pid_alive

pytestmark = pytest.mark.integration

NO_DRIVER = NvmlSeam(FakeNvml(driver=False))
IMPOSSIBLE_PID = 4194304 + 17  # above the kernel's pid_max limit: a host PID no process here can have


def write_state(home, run, attempts, state="backoff", current=None):
    """A state.json as the supervisor writes it: attempts [{n, pid, sid, pgid, start_time (leader's start in
    clock ticks), started_at (wall)}], current_sid naming the running attempt (None between attempts)."""
    run_dir = os.path.join(str(home), "runs", run)
    os.makedirs(run_dir, exist_ok=True)
    atomic_write_json(os.path.join(run_dir, "state.json"), {
        "run": run, "state": state, "attempt": len(attempts) - 1,
        "current_sid": current.sid if current is not None else None,
        "attempts": [{"n": i, "pid": a.pid, "sid": a.sid, "pgid": a.sid, "start_time": a.start_ticks,
                      "started_at": t, "ended_at": None, "exit": None} for i, (a, t) in enumerate(attempts)],
    })
    return run_dir


def orphaned_trainer(spawn_holder, workers=3, ignore_term=1):
    """A trainer whose DataLoader workers outlive it: the parent is SIGKILLed, the workers keep the device open."""
    t0 = time.time()
    trainer = spawn_holder(workers=workers, ignore_term=ignore_term)
    sid = trainer.sid
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.popen.wait(timeout=10)
    return trainer, sid, t0


def make_ctx(home, run, devices, events, reap_wait=1.0):
    run_dir = os.path.join(str(home), "runs", run)
    os.makedirs(run_dir, exist_ok=True)
    return RunContext(name=run, run_dir=run_dir, ckpt_dir=os.path.join(run_dir, "ckpt"),
                      config=RunConfig(name=run, gpu_devices=devices, reap_wait=reap_wait), clock=SystemClock(),
                      emit=lambda kind, **f: events.append(dict(f, event=kind)), attempt=lambda: 1)


def test_scan_finds_orphaned_workers_and_names_our_earlier_attempt(onbox_home, gpu_devices, spawn_holder):
    trainer, sid, t0 = orphaned_trainer(spawn_holder)
    assert not pid_alive(trainer.pid) and all(pid_alive(w) for w in trainer.workers)
    write_state(onbox_home, "train", [(trainer, t0)])

    scan = HolderScan(gpu_devices, seam=NO_DRIVER).scan()
    classify(scan, AttemptIndex.load(str(onbox_home / "runs")))
    found = {h.pid: h for h in scan.holders if h.pid in trainer.workers}
    assert sorted(found) == sorted(trainer.workers)
    for h in found.values():
        assert h.sid == sid and h.ppid != trainer.pid  # reparented, same session
        assert h.gpus == [0] and len(h.devices) == 3
        assert (h.owner, h.run, h.attempt) == ("earlier", "train", 0)
        assert h.nvml_visible is None and "gpu_holder_proc.py" in h.command
    assert scan.scanned >= len(found) and not scan.nvml_available


def test_hook_reaps_orphans_before_restart_and_spares_current_and_foreign(onbox_home, gpu_devices, spawn_holder):
    trainer, sid, t0 = orphaned_trainer(spawn_holder, workers=3, ignore_term=1)
    current = spawn_holder(files=("nvidia1", "nvidiactl"), workers=1)
    foreign = spawn_holder(files=("nvidia0",))
    write_state(onbox_home, "train", [(trainer, t0), (current, time.time())], state="running", current=current)
    events: list = []
    hook = ReaperHook(make_ctx(onbox_home, "train", gpu_devices, events), seam=NO_DRIVER,
                      term_timeout_s=0.5, kill_timeout_s=10)

    hook.before_attempt([sid])

    assert not any(pid_alive(w) for w in trainer.workers)
    assert pid_alive(current.pid) and all(pid_alive(w) for w in current.workers) and pid_alive(foreign.pid)
    sent = sorted((e["signal"], e["pid"]) for e in events if e["event"] == "reap_signal")
    assert [s for s, _ in sent].count("SIGTERM") == 3 and [s for s, _ in sent].count("SIGKILL") == 1
    assert {p for _, p in sent} == set(trainer.workers)
    done = next(e for e in events if e["event"] == "reaped")
    outcomes = sorted(h["outcome"] for h in done["holders"])
    assert outcomes == ["killed by SIGKILL (ignored SIGTERM)"] + ["terminated by SIGTERM"] * 2
    assert done["memory"] == {"skipped": "NVML not available: no NVIDIA driver (libnvidia-ml.so.1 not found)"}
    with open(onbox_home / "reap.jsonl") as f:
        assert len(f.read().splitlines()) == 4  # every signal logged
    # nothing left: a second call does nothing
    events.clear()
    hook.before_attempt([sid])
    assert events == []


def test_hook_is_off_when_reap_orphans_is_false(onbox_home, gpu_devices, spawn_holder):
    trainer, sid, _t0 = orphaned_trainer(spawn_holder, workers=1, ignore_term=0)
    events: list = []
    ctx = make_ctx(onbox_home, "train", gpu_devices, events)
    ctx.config.reap_orphans = False
    ReaperHook(ctx, seam=NO_DRIVER).before_attempt([sid])
    assert pid_alive(trainer.workers[0]) and events == []


def test_make_hooks_plugs_the_reaper_in(onbox_home, gpu_devices):
    ctx = make_ctx(onbox_home, "train", gpu_devices, [])
    assert isinstance(make_hooks(ctx).reaper, ReaperHook)


def run_reap(onbox_argv, home, devices, *args):
    env = subprocess_env({"ONBOX_HOME": str(home), "ONBOX_GPU_DEVICES": devices})
    r = subprocess.run([*onbox_argv, "reap", "--json", *list(args)], env=env, capture_output=True, text=True,
                       timeout=60)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else None, r.stderr


def test_cli_dry_run_reports_foreign_holder_and_touches_nothing(onbox_home, gpu_devices, spawn_holder, onbox_argv):
    foreign = spawn_holder(files=("nvidia1", "nvidiactl"))
    rc, doc, err = run_reap(onbox_argv, onbox_home, gpu_devices, "--min-age", "0")
    assert rc == 0, err
    d = next(x for x in doc["decisions"] if x["pid"] == foreign.pid)
    assert (d["owner"], d["verdict"], d["outcome"]) == ("foreign", "reap", None)
    assert d["gpus"] == [1] and d["sid"] == foreign.pid
    assert doc["forced"] is False and pid_alive(foreign.pid)
    assert not os.path.exists(onbox_home / "reap.jsonl")
    # the human table says the same
    env = subprocess_env({"ONBOX_HOME": str(onbox_home), "ONBOX_GPU_DEVICES": gpu_devices})
    out = subprocess.run([*onbox_argv, "reap", "--min-age", "0"], env=env, capture_output=True, text=True,
                         timeout=60).stdout
    assert str(foreign.pid) in out and "dry run" in out and pid_alive(foreign.pid)


def test_cli_force_kills_foreign_and_orphans_never_the_current_attempt(onbox_home, gpu_devices, spawn_holder,
                                                                       onbox_argv):
    trainer, _sid, t0 = orphaned_trainer(spawn_holder, workers=2, ignore_term=0)
    current = spawn_holder(files=("nvidia0", "nvidiactl"), workers=1)
    foreign = spawn_holder(files=("nvidia1",))
    write_state(onbox_home, "train", [(trainer, t0), (current, time.time())], state="running", current=current)

    rc, doc, err = run_reap(onbox_argv, onbox_home, gpu_devices, "--force", "--min-age", "0",
                            "--term-timeout", "5")
    assert rc == 0, err
    by_pid = {d["pid"]: d for d in doc["decisions"]}
    for pid in [current.pid, *current.workers]:
        assert by_pid[pid]["owner"] == "current" and by_pid[pid]["verdict"] == "keep"
        assert by_pid[pid]["outcome"] == "not touched: " + by_pid[pid]["reason"] and pid_alive(pid)
    for pid in trainer.workers:
        assert by_pid[pid]["owner"] == "earlier" and by_pid[pid]["outcome"] == "terminated by SIGTERM"
    assert by_pid[foreign.pid]["outcome"] == "terminated by SIGTERM"
    wait_for(lambda: not pid_alive(foreign.pid) and not any(pid_alive(w) for w in trainer.workers), what="reaped")


def test_cli_force_respects_min_age(onbox_home, gpu_devices, spawn_holder, onbox_argv):
    foreign = spawn_holder(files=("nvidia0",))
    rc, doc, _err = run_reap(onbox_argv, onbox_home, gpu_devices, "--force", "--min-age", "3600")
    d = next(x for x in doc["decisions"] if x["pid"] == foreign.pid)
    assert rc == 0 and d["verdict"] == "keep" and "younger than the minimum age" in d["reason"]
    assert pid_alive(foreign.pid)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as another user")
def test_other_users_process_needs_all_users(onbox_home, gpu_devices, spawn_holder, onbox_argv):
    nobody = spawn_holder(files=("nvidia0",), uid=65534)
    rc, doc, err = run_reap(onbox_argv, onbox_home, gpu_devices, "--force", "--min-age", "0")
    assert rc == 0, err
    d = next(x for x in doc["decisions"] if x["pid"] == nobody.pid)
    assert d["verdict"] == "keep" and d["reason"].endswith("needs --all-users") and pid_alive(nobody.pid)
    rc, doc, _err = run_reap(onbox_argv, onbox_home, gpu_devices, "--force", "--all-users", "--min-age", "0")
    d = next(x for x in doc["decisions"] if x["pid"] == nobody.pid)
    assert rc == 0 and d["outcome"] == "terminated by SIGTERM"
    wait_for(lambda: not pid_alive(nobody.pid), what="nobody's holder gone")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root")
def test_holder_in_another_pid_namespace_is_reported_not_killed(onbox_home, gpu_devices, spawn_holder,
                                                                onbox_argv):
    boxed = spawn_holder(files=("nvidia0",), new_pid_ns=True)
    rc, doc, err = run_reap(onbox_argv, onbox_home, gpu_devices, "--force", "--min-age", "0")
    assert rc == 0, err
    d = next(x for x in doc["decisions"] if x["pid"] == boxed.pid)
    assert d["other_pid_ns"] is True and d["ns_pids"] == [boxed.pid, 1]
    assert d["verdict"] == "keep" and "another container" in d["reason"] and "restart that container" in d["reason"]
    assert d["outcome"] == "not touched: " + d["reason"] and pid_alive(boxed.pid)


def test_all_users_without_root_is_a_usage_error(monkeypatch, onbox_home, gpu_devices):
    from click.testing import CliRunner

    import onbox.commands.gpu as cmd

    monkeypatch.setattr(cmd.os, "geteuid", lambda: 1000)
    r = CliRunner().invoke(cmd.reap, ["--all-users", "--devices", gpu_devices], standalone_mode=False)
    assert isinstance(r.exception, UsageError) and "--all-users needs root" in str(r.exception)
    assert not os.path.exists(onbox_home / "reap.jsonl")


# -- NVML cross-check: the process list with and without the holder, host PIDs, v3 missing, driver absent

def scan_with(fake, devices):
    return HolderScan(devices, seam=NvmlSeam(fake)).scan()


def test_nvml_lists_the_holder(gpu_devices, spawn_holder):
    h = spawn_holder(files=("nvidia0", "nvidiactl"))
    fake = FakeNvml([FakeGpu(minor=0, processes=[FakeProcess(h.pid, 3 << 30)]), FakeGpu(minor=1)])
    got = next(x for x in scan_with(fake, gpu_devices).holders if x.pid == h.pid)
    assert got.nvml_visible is True and got.gpu_memory_bytes == 3 << 30 and got.gpus == [0]


def test_nvml_does_not_list_the_holder(gpu_devices, spawn_holder):
    h = spawn_holder(files=("nvidia0",))
    fake = FakeNvml([FakeGpu(minor=0, memory_used=20 << 30, processes=[])])
    scan = scan_with(fake, gpu_devices)
    got = next(x for x in scan.holders if x.pid == h.pid)
    assert got.nvml_visible is False and scan.nvml_unmatched == []
    [d] = [d for d in decide_all(scan, min_age_s=0, all_users=False, is_root=False, my_uid=os.geteuid())
           if d.holder.pid == h.pid]
    assert d.verdict == "reap" and "invisible to NVML" in d.reason


def test_nvml_gives_host_pids_namespace_mismatch(gpu_devices, spawn_holder):
    """Old drivers inside a container report host PIDs: none matches, so visibility is unknown, and the NVML-only
    PID is reported as living elsewhere."""
    h = spawn_holder(files=("nvidia0",))
    fake = FakeNvml([FakeGpu(minor=0, memory_used=20 << 30, processes=[FakeProcess(IMPOSSIBLE_PID, 20 << 30)])])
    scan = scan_with(fake, gpu_devices)
    got = next(x for x in scan.holders if x.pid == h.pid)
    assert got.nvml_visible is None and got.gpu_memory_bytes is None
    assert scan.nvml_unmatched == [{"gpu": 0, "pid": IMPOSSIBLE_PID, "memory_bytes": 20 << 30}]


def test_gpu_index_comes_from_nvml_minor_numbers(gpu_devices, spawn_holder):
    h = spawn_holder(files=("nvidia1",))
    fake = FakeNvml([FakeGpu(minor=1, uuid="GPU-a"), FakeGpu(minor=0, uuid="GPU-b")])  # index 0 is minor 1
    got = next(x for x in scan_with(fake, gpu_devices).holders if x.pid == h.pid)
    assert got.gpus == [0]


def test_v3_missing_still_cross_checks(gpu_devices, spawn_holder):
    h = spawn_holder(files=("nvidia0",))
    fake = FakeNvml([FakeGpu(minor=0, processes=[FakeProcess(h.pid, 1 << 30)])],
                    missing={"nvmlDeviceGetComputeRunningProcesses_v3"})
    got = next(x for x in scan_with(fake, gpu_devices).holders if x.pid == h.pid)
    assert got.nvml_visible is True and got.gpu_memory_bytes == 1 << 30


def test_driver_absent_scan_still_works(gpu_devices, spawn_holder):
    h = spawn_holder(files=("nvidia0",))
    scan = scan_with(FakeNvml(driver=False), gpu_devices)
    got = next(x for x in scan.holders if x.pid == h.pid)
    assert not scan.nvml_available and got.nvml_visible is None and got.gpus == [0]


def test_cli_gpu_lists_holders(onbox_home, gpu_devices, spawn_holder, onbox_argv):
    h = spawn_holder(files=("nvidia0",))
    env = subprocess_env({"ONBOX_HOME": str(onbox_home), "ONBOX_GPU_DEVICES": gpu_devices})
    r = subprocess.run([*onbox_argv, "gpu", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert h.pid in [x["pid"] for x in doc["holders"]["holders"]]


def test_cli_gpu_driver_absent_and_present(monkeypatch, onbox_home, gpu_devices, spawn_holder):
    from click.testing import CliRunner

    import onbox.commands.gpu as cmd

    monkeypatch.setattr(cmd, "_seam", lambda: NvmlSeam(FakeNvml(driver=False)))
    r = CliRunner().invoke(cmd.gpu, ["--devices", gpu_devices])
    assert r.exit_code == 0 and r.output.startswith("no GPU readings: no NVIDIA driver")
    h = spawn_holder(files=("nvidia0",))
    fake = FakeNvml([FakeGpu(minor=0, memory_used=30 << 30, util_gpu=0, processes=[])])
    monkeypatch.setattr(cmd, "_seam", lambda: NvmlSeam(fake))
    r = CliRunner().invoke(cmd.gpu, ["--devices", gpu_devices, "--json"])
    doc = json.loads(r.output)
    g = doc["gpus"][0]
    assert g["verdict"] == "pinned" and "pinned by 1 holder" in g["verdict_reason"]
    assert [x["pid"] for x in doc["holders"]["holders"]] == [h.pid]
    r = CliRunner().invoke(cmd.gpu, ["--devices", gpu_devices])
    assert "[pinned] memory pinned by 1 holder" in r.output and "SM 1980/1980 MHz" in r.output


def test_holder_scan_matches_fuser(gpu_devices, spawn_holder):
    """The scan finds what psmisc's fuser finds on the same file (both from /proc fd links)."""
    spawned = [spawn_holder(files=("nvidia0",), workers=2), spawn_holder(files=("nvidia0", "nvidiactl"))]
    path = os.path.join(os.path.dirname(gpu_devices), "nvidia0")
    r = subprocess.run(["fuser", path], capture_output=True, text=True, timeout=30)
    fuser_pids = {int(x) for x in r.stdout.split()}
    ours = {h.pid for h in HolderScan(path, seam=NO_DRIVER).scan().holders}
    expected = {s.pid for s in spawned} | {w for s in spawned for w in s.workers}
    assert expected <= fuser_pids and ours == fuser_pids


def test_scan_survives_a_lost_gpu(gpu_devices, spawn_holder):
    h = spawn_holder(files=("nvidia1",))
    fake = FakeNvml([FakeGpu(minor=0, lost=True), FakeGpu(minor=1, processes=[FakeProcess(h.pid, 1 << 30)])])
    got = next(x for x in scan_with(fake, gpu_devices).holders if x.pid == h.pid)
    assert got.gpus == [1] and got.nvml_visible is True


def test_gpu_less_box_scans_nothing_and_leaves_nvml_alone(tmp_path):
    fake = FakeNvml([FakeGpu()])
    scan = HolderScan(str(tmp_path / "nvidia*"), seam=NvmlSeam(fake)).scan()
    assert scan.holders == [] and scan.devices == [] and fake.calls == []


def test_busy_foreign_holder_is_kept_idle_one_is_a_candidate(onbox_home, gpu_devices, spawn_holder):
    from onbox.gpu.reaper import survey

    busy = spawn_holder(files=("nvidia0",))
    idle = spawn_holder(files=("nvidia0",))
    fake = FakeNvml([FakeGpu(minor=0, memory_used=40 << 30, util_gpu=90,
                             processes=[FakeProcess(busy.pid, 20 << 30), FakeProcess(idle.pid, 20 << 30)],
                             process_util={busy.pid: 90})])
    _, decisions = survey(devices=gpu_devices, seam=NvmlSeam(fake), runs_dir=str(onbox_home / "runs"),
                          min_age_s=0, all_users=False)
    by_pid = {d.holder.pid: d for d in decisions}
    assert (by_pid[busy.pid].verdict, by_pid[busy.pid].reason) == (
        "keep", "busy: NVML saw it using the GPU in the last sample")
    assert (by_pid[idle.pid].verdict, by_pid[idle.pid].reason) == (
        "reap", "idle: no GPU activity of it in the last sample")
    assert pid_alive(busy.pid) and pid_alive(idle.pid)  # a survey never acts


def test_scan_stands_when_nvml_fails(gpu_devices, spawn_holder):
    h = spawn_holder(files=("nvidia0",))
    scan = scan_with(BrokenCount([FakeGpu()]), gpu_devices)
    got = next(x for x in scan.holders if x.pid == h.pid)
    assert got.gpus == [0] and got.nvml_visible is None and not scan.nvml_available and scan.nvml_error


class LiveDriver(FakeNvml):
    """NVML over real processes: a listed process counts (and holds its memory) only while it is alive."""

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h):
        return [p for p in self._gpu(h).processes if pid_alive(p.pid)]

    def nvmlDeviceGetMemoryInfo(self, h):
        h.memory_used = sum(p.usedGpuMemory for p in self.nvmlDeviceGetComputeRunningProcesses_v3(h))
        return super().nvmlDeviceGetMemoryInfo(h)


def test_hook_waits_for_memory_to_come_back(onbox_home, gpu_devices, spawn_holder):
    trainer, sid, t0 = orphaned_trainer(spawn_holder, workers=2, ignore_term=0)
    current = spawn_holder(files=("nvidia0",))
    fake = LiveDriver([FakeGpu(minor=0, processes=[FakeProcess(w, 10 << 30) for w in trainer.workers]
                               + [FakeProcess(current.pid, 1 << 30)])])
    write_state(onbox_home, "train", [(trainer, t0), (current, time.time())], state="running", current=current)
    events: list = []
    ReaperHook(make_ctx(onbox_home, "train", gpu_devices, events, reap_wait=30), seam=NvmlSeam(fake),
               term_timeout_s=5, memory_poll_s=0.01).before_attempt([sid])
    done = next(e for e in events if e["event"] == "reaped")
    assert done["memory"]["released"] is True and done["memory"]["gpus"] == {0: 1 << 30}
    assert pid_alive(current.pid) and not any(pid_alive(w) for w in trainer.workers)


def test_holder_that_left_the_session_is_ours_by_its_environment(onbox_home, gpu_devices, spawn_holder):
    """A worker that called setsid() keeps the ONBOX_RUN/ONBOX_RESTART_COUNT it inherited."""
    t0 = time.time()
    leader = spawn_holder(files=("nvidia0",))
    escaped = spawn_holder(files=("nvidia0",), env={"ONBOX_RUN": "train", "ONBOX_RESTART_COUNT": "0"})
    stranger = spawn_holder(files=("nvidia0",), env={"ONBOX_RUN": "other", "ONBOX_RESTART_COUNT": "0"})
    write_state(onbox_home, "train", [(leader, t0)], state="backoff")
    os.kill(leader.pid, signal.SIGKILL)
    leader.popen.wait(timeout=10)
    events: list = []
    ReaperHook(make_ctx(onbox_home, "train", gpu_devices, events), seam=NO_DRIVER,
               term_timeout_s=5).before_attempt([leader.sid])
    assert not pid_alive(escaped.pid) and pid_alive(stranger.pid)
    [sent] = [e for e in events if e["event"] == "reap_signal"]
    assert (sent["pid"], sent["of_run"], sent["of_attempt"], sent["signal"]) == (escaped.pid, "train", 0, "SIGTERM")


def test_real_onbox_run_stops_a_worker_that_escaped_the_attempt_session(onbox_home, gpu_devices, tmp_path):
    """`onbox run`: attempt 0 forks a worker that holds the GPU and leaves the session (so a sweep of the
    attempt's session alone misses it), then fails. The end of the attempt stops it (it carries the attempt's
    marker), so attempt 1 sees it gone and the GPU reaper before attempt 1 finds nothing left to signal. (The
    reaper's own path, a worker that escaped a previous agent, is the real-process test above.)"""
    import textwrap

    from tests.integration.supervisor_helpers import events as run_events
    from tests.integration.supervisor_helpers import onbox

    dev = os.path.join(os.path.dirname(gpu_devices), "nvidia0")
    pidfile, verdict = tmp_path / "worker.pid", tmp_path / "verdict"
    script = textwrap.dedent("""
        import os, sys, time
        dev, pidfile, verdict = %r, %r, %r
        if os.environ["ONBOX_RESTART_COUNT"] == "0":
            fd = os.open(dev, os.O_RDONLY)  # "CUDA init"
            if os.fork() == 0:
                os.setsid()  # leaves the attempt's session, keeps the device and the environment
                open(pidfile + ".tmp", "w").write(str(os.getpid()))
                os.rename(pidfile + ".tmp", pidfile)
                time.sleep(120)
                os._exit(0)
            while not os.path.exists(pidfile):
                time.sleep(0.01)
            sys.exit(1)
        pid = int(open(pidfile).read())
        try:
            st = open("/proc/%%d/stat" %% pid).read().rpartition(")")[2].split()[0]
        except OSError:
            st = "gone"
        open(verdict, "w").write("gone" if st in ("Z", "X", "gone") else st)
    """ % (dev, str(pidfile), str(verdict)))
    with Started(onbox_home):  # the end (a failed test too) stops the worker: it carries this ONBOX_HOME
        r = onbox(onbox_home, "run", "--foreground", "--name", "gpuorph", "--", sys.executable, "-c", script,
                  env_extra={"ONBOX_GPU_DEVICES": gpu_devices, "ONBOX_REAP_WAIT": "1"})
        assert r.returncode == 0, r.stderr
        assert verdict.read_text() == "gone"
        evs = run_events(onbox_home, "gpuorph")
        worker = int(pidfile.read_text())
        [stopped] = [e for e in evs if e["type"] == "attempt_leftovers_stopped"]
        assert worker in stopped["pids"] and stopped["survived"] == []
        assert [e for e in evs if e["type"] == "reap_signal"] == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_char_device_minor_comes_from_st_rdev(tmp_path):
    """A real character device (mknod, /dev/null's driver so it opens anywhere): the GPU number is the device
    minor, not the name, as for /dev/nvidia<N> (major 195)."""
    import stat as st

    from onbox.gpu.holders import device_files

    d = tmp_path / "chr"
    d.mkdir()
    os.mknod(str(d / "nvidia9"), 0o666 | st.S_IFCHR, os.makedev(1, 3))
    [f] = device_files(str(d / "nvidia*"))
    assert (f.kind, f.minor, f.rdev) == ("gpu", 3, os.makedev(1, 3))
    p = subprocess.Popen([sys.executable, "-c", "import os,sys,time; fd=os.open(%r, os.O_RDONLY); "
                          "print(1, flush=True); time.sleep(60)" % str(d / "nvidia9")],
                         stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == b"1"
        [h] = HolderScan(str(d / "nvidia*"), seam=NO_DRIVER).scan().holders
        assert h.pid == p.pid and h.gpus == [3]
    finally:
        p.kill()
        p.wait(timeout=10)
