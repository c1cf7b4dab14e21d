"""Pure parts of the supervisor: the state machine, exit classification, the child's environment, the run
directory's log handling, the metadata clients' parsing (against the documented fake service)."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from onbox.proc import ExitStatus, ProcessSeam, is_alive, read_stat, start_time
from onbox.supervisor import exits as cls
from onbox.supervisor.childenv import child_argv, child_env, cpu_quota_cores
from onbox.supervisor.loop import TRANSITIONS, IllegalTransition, RunState, check_transition, exit_code_for
from onbox.supervisor.preempt import MalformedAnswer, MetadataClient
from onbox.supervisor.rundir import LogTailer, RunDir, tail_lines


def test_every_state_has_documented_transitions_and_illegal_ones_name_the_allowed():
    doc = RunState.__doc__ or ""
    for state, targets in TRANSITIONS.items():
        assert state.value.upper() in doc
        for t in targets:
            check_transition(state, t)
    with pytest.raises(IllegalTransition) as e:
        check_transition(RunState.BACKOFF, RunState.DONE)
    assert "allowed from backoff: starting, stopping" in str(e.value)
    with pytest.raises(IllegalTransition, match=r"none \(terminal\)"):
        check_transition(RunState.DONE, RunState.STARTING)
    assert {s for s in RunState if s.terminal} == {RunState.DONE, RunState.FAILED, RunState.PREEMPTED,
                                                  RunState.STOPPED, RunState.FENCED}
    assert [exit_code_for(s) for s in (RunState.DONE, RunState.FAILED, RunState.PREEMPTED, RunState.FENCED)] == [
        0, 1, 75, 1]


@pytest.mark.parametrize("line, kind", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB", cls.CUDA_OOM),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)", cls.CUDA_OOM),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for "
     "600000 milliseconds before timing out.", cls.NCCL_TIMEOUT),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error",
     cls.NCCL_ERROR),
    ("RuntimeError: [enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0 No space left on device",
     cls.DISK_FULL),
    ("RuntimeError: basic_ios::clear: iostream error", cls.DISK_FULL),
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", cls.GPU_ERROR),
    ('docker: Error response from daemon: could not select device driver "" with capabilities: [[gpu]].',
     cls.NO_GPU_RUNTIME),
    ("docker: Error response from daemon: unknown or invalid runtime name: nvidia.", cls.NO_GPU_RUNTIME),
])
def test_log_tail_causes(line, kind):
    c = cls.classify(ExitStatus(code=1), ["step 10 loss 2.3", line, "  exiting"])
    assert c.classification == kind and line.strip()[:60] in c.message and c.hint


def test_cuda_oom_hint_is_the_fit_it_ladder():
    c = cls.classify(ExitStatus(code=1), ["torch.cuda.OutOfMemoryError: CUDA out of memory."])
    assert "fit-it ladder" in c.hint and "batch" in c.hint


def test_host_oom_needs_the_counter_to_rise():
    assert cls.classify(ExitStatus(signal=9), [], oom_before=2, oom_after=3).classification == cls.HOST_OOM
    plain = cls.classify(ExitStatus(signal=9), [], oom_before=2, oom_after=2)
    assert plain.classification == cls.SIGNALED and plain.message.startswith("Signal 9 (SIGKILL)")
    assert cls.classify(ExitStatus(signal=9), [], None, None).classification == cls.SIGNALED


def test_failure_code_success_unknown_preempted():
    c = cls.classify(ExitStatus(code=2), ["Traceback (most recent call last):", "  File x", "KeyError: 'lr'"])
    assert c.classification == cls.FAILED and c.code == 2 and "KeyError: 'lr'" in c.message
    assert c.loop_key == "failed:2"
    assert cls.classify(ExitStatus(code=0)).classification == cls.SUCCESS
    assert cls.classify(ExitStatus()).classification == cls.UNKNOWN
    assert cls.classify(ExitStatus(signal=15), preempted=True).classification == cls.PREEMPTED
    assert cls.classify(ExitStatus(code=0), stopped=True).classification == cls.STOPPED
    assert not cls.classify(ExitStatus(code=0), preempted=True).failed


def test_oom_kill_count_reads_fixture_cgroup_trees(tmp_path):
    v1 = tmp_path / "v1"
    (v1 / "proc/self").mkdir(parents=True)
    (v1 / "proc/self/cgroup").write_text("4:memory:/box/job\n")
    d = v1 / "sys/fs/cgroup/memory/box/job"
    d.mkdir(parents=True)
    (d / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    assert cls.oom_kill_count(root=str(v1)) == 4
    v2 = tmp_path / "v2"
    (v2 / "proc/self").mkdir(parents=True)
    (v2 / "proc/self/cgroup").write_text("0::/user.slice\n")
    (v2 / "sys/fs/cgroup").mkdir(parents=True)
    (v2 / "sys/fs/cgroup/cgroup.controllers").write_text("memory cpu\n")
    (v2 / "sys/fs/cgroup/user.slice").mkdir()
    (v2 / "sys/fs/cgroup/user.slice/memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    assert cls.oom_kill_count(root=str(v2)) == 2


def test_oom_kill_count_in_a_v1_container_without_a_cgroup_namespace(tmp_path):
    # docker on a v1 host: /proc/self/cgroup names the host-side path, but the container's mount shows only its
    # own subtree; the old fallback reader looked for /sys/fs/cgroup/memory/docker/<id>/ and lost host-OOM
    # detection (U41)
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("4:memory:/docker/abc123\n")
    mem = tmp_path / "sys/fs/cgroup/memory"
    mem.mkdir(parents=True)
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert cls.oom_kill_count(root=str(tmp_path)) == 7


def test_child_env_contract_and_thread_caps():
    env = child_env({"PATH": "/bin", "MKL_NUM_THREADS": "8"}, "r1", "/ck", None, 0, "/m.jsonl", "/P",
                    {"FOO": "1"}, quota_cores=4.5)
    assert env["ONBOX_RESUME_FROM"] == "" and env["ONBOX_RESTART_COUNT"] == "0" and env["PYTHONUNBUFFERED"] == "1"
    assert env["OMP_NUM_THREADS"] == "4" and env["MKL_NUM_THREADS"] == "8" and env["FOO"] == "1"
    assert "OMP_NUM_THREADS" not in child_env({}, "r", "/c", "/c/s", 1, "m", "p", {}, quota_cores=None)
    assert child_argv(["t.py"], ["--resume", "{ckpt}"], None) == ["t.py"]
    assert child_argv(["t.py"], ["--resume={ckpt}"], "/c/step5") == ["t.py", "--resume=/c/step5"]


def test_cpu_quota_from_fixture_cgroups(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/job\n")
    (tmp_path / "sys/fs/cgroup/job").mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/job/cpu.max").write_text("250000 100000\n")
    assert cpu_quota_cores(str(tmp_path)) == 2.5
    (tmp_path / "sys/fs/cgroup/job/cpu.max").write_text("max 100000\n")
    assert cpu_quota_cores(str(tmp_path)) is None


def test_log_tailer_follows_copy_truncate_rotation(tmp_path):
    rd = RunDir(str(tmp_path / "r"))
    os.makedirs(rd.path)
    t = LogTailer(rd.log_path, from_end=True)
    with open(rd.log_path, "a") as f:
        f.write("a\nb\npart")
    assert t.read_new() == ["a", "b"]
    with open(rd.log_path, "a") as f:
        f.write("ial\n" + "x" * 100 + "\n")
    assert t.read_new() == ["partial", "x" * 100]
    assert rd.rotate_log(max_bytes=50, backups=2)
    assert os.path.getsize(rd.log_path) == 0 and os.path.getsize(rd.log_path + ".1") > 100
    with open(rd.log_path, "a") as f:
        f.write("after\n")
    assert t.read_new() == ["after"]
    assert tail_lines(rd.log_path + ".1", 2) == ["partial", "x" * 100]
    assert list(t.tail)[-1] == "after"


def test_proc_start_time_tells_a_recycled_pid_apart():
    p = subprocess.Popen(["sleep", "5"])
    try:
        st = start_time(p.pid)
        assert st is not None and is_alive(p.pid, st) and not is_alive(p.pid, st + 1)
        seam = ProcessSeam()
        assert seam.adopt(p.pid, st + 1) is None
        child = seam.adopt(p.pid, st)
        assert child is not None and not child.ours and child.sid == os.getsid(p.pid)
        assert read_stat(p.pid).comm == "sleep"
    finally:
        p.kill()
        p.wait()
    assert not is_alive(p.pid, st)


def test_kill_session_finds_a_reparented_orphan_and_escalates_to_kill(tmp_path):
    seam = ProcessSeam()
    pidfile = tmp_path / "pid"
    worker = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "open(%r, 'w').write(str(os.getpid())); time.sleep(30)" % str(pidfile))
    # the leader starts a worker in the background and exits: the worker is orphaned but keeps the session id
    leader = subprocess.Popen(["sh", "-c", '(python3 -c "$0" &)', worker], start_new_session=True)
    assert leader.wait(timeout=10) == 0
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    orphan = int(pidfile.read_text())
    assert os.getsid(orphan) == leader.pid
    found = seam.kill_session(leader.pid, timeout=0.2)
    assert found.pids == [orphan] and [r.pid for r in found.killed] == [orphan]
    assert seam.session_members(leader.pid) == [] and not is_alive(orphan)


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_metadata_clients_against_the_documented_service(metadata_server, provider):
    metadata_server.provider = provider
    client = MetadataClient(provider, metadata_server.url, timeout=2)
    assert client.available()
    assert client.check(time.time()) is None
    metadata_server.preempt(lead=60)
    lead, detail = client.check(time.time())
    assert provider in detail
    if provider == "gcp":  # GCP says only TRUE: the documented 30 s applies
        assert lead == 30.0
    else:  # AWS `time`, Azure `NotBefore` carry the moment itself
        assert 55 <= lead <= 61
    for other in ("aws", "gcp", "azure"):
        if other != provider:
            assert not MetadataClient(other, metadata_server.url, timeout=2).available()


def test_an_aws_instance_action_nested_100000_deep_is_still_a_notice_at_the_documented_lead(metadata_server):
    metadata_server.answer = b'{"time": ' * 100_000  # 200 on instance-action is the notice; its time unreadable
    lead, detail = MetadataClient("aws", metadata_server.url, timeout=2).check(time.time())
    assert lead == 120.0 and "nests more than 64 levels deep" in detail


def test_an_azure_answer_that_is_not_an_events_document_is_malformed_not_a_crash(metadata_server):
    metadata_server.provider = "azure"
    client = MetadataClient("azure", metadata_server.url, timeout=2)
    for answer in (b"[" * 100_000, b'{"Events": 5}', b"[]", b"\xff\xfe"):
        metadata_server.answer = answer
        with pytest.raises(MalformedAnswer, match="azure scheduled events answer unreadable"):
            client.check(time.time())


def test_metadata_client_is_silent_when_nothing_answers():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = "http://127.0.0.1:%d" % s.getsockname()[1]
    for provider in ("aws", "gcp", "azure"):
        c = MetadataClient(provider, url, timeout=0.5)
        assert not c.available() and c.check(time.time()) is None


def test_training_status_summary_names_state_exit_checkpoint_and_risks():
    from onbox.supervisor.runsummary import render_status

    state = {"run": "r", "state": "running", "attempt": 2, "restarts": 2,
             "last_exit": {"classification": "cuda_oom", "message": "CUDA out of memory", "hint": "the fit-it ladder"}}
    text = render_status(state, {"latest_durable": {"name": "step-10", "step": 10}, "verified": True},
                         ["checkpoint disk /x has 0.1 GB free"])
    assert "**running**" in text and "attempt: 2" in text and "cuda_oom" in text and "fit-it ladder" in text
    assert "newest checkpoint: step-10 (step 10)" in text and "verified: True" in text
    assert "0.1 GB free" in text and "no checkpoint yet" not in text
    assert "no checkpoint yet" in render_status({"state": "running"})
    assert "## Risks" not in render_status({"state": "done"})


def test_summary_is_written_before_state_json(tmp_path, monkeypatch):
    """A reader that sees state.json in state X finds training_status.md saying X already."""
    from onbox import fsutil
    from onbox.supervisor import rundir

    rd = rundir.RunDir(str(tmp_path / "r"))
    os.makedirs(rd.path)
    seen = []
    real = fsutil.atomic_write_json

    def spy(path, doc, *a, **k):
        if path == rd.state_path:
            with open(rd.file("training_status.md")) as f:
                seen.append(("state: **%s**" % doc["state"]) in f.read())
        return real(path, doc, *a, **k)

    monkeypatch.setattr(fsutil, "atomic_write_json", spy)
    for st in ("running", "done"):
        rd.write_state({"run": "r", "state": st})
    assert seen == [True, True]
