"""SlurmJob detection from the environment, run naming, requeue decisions, and the scontrol calls (argv checked
through the runner seam; the real scontrol is exercised in tests/integration/test_slurm_requeue.py)."""
from __future__ import annotations

import subprocess

import pytest

from onbox.slurm.job import SlurmError, SlurmJob, heartbeat_fields, kill_wait, requeue, requeue_decision
from tests.fakes.recorders import RunnerRecorder


def test_outside_slurm_there_is_no_job():
    assert SlurmJob.from_env({}) is None
    assert heartbeat_fields({"HOME": "/root"}) is None


def test_first_run_has_no_restart_count_and_is_0():
    job = SlurmJob.from_env({"SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NAME": "x"})
    assert job is not None
    assert job.restart_count == 0 and job.run_name() == "slurm-17" and job.is_primary
    assert job.to_dict() == {"job_id": "17", "array_job_id": None, "array_task_id": None, "restart_count": 0,
                             "node_list": "vm", "num_nodes": 1, "node_id": 0, "proc_id": 0, "is_primary": True,
                             "job_name": "x"}


def test_requeued_array_task():
    env = {"SLURM_JOB_ID": "23", "SLURM_ARRAY_JOB_ID": "20", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "2",
           "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2"}
    job = SlurmJob.from_env(env)
    assert job is not None
    assert (job.array_job_id, job.array_task_id, job.restart_count, job.num_nodes) == ("20", "3", 2, 2)
    assert job.run_name() == "slurm-20_3"
    assert job.run_name("sweep") == "sweep-3"
    assert heartbeat_fields(env)["node_list"] == "gpu[01-02]"  # type: ignore[index]


def test_non_primary_node_is_its_own_run_and_not_primary():
    job = SlurmJob.from_env({"SLURM_JOB_ID": "5", "SLURM_NODEID": "1", "SLURM_PROCID": "1"})
    assert job is not None and not job.is_primary
    assert job.run_name() == "slurm-5.node1"
    assert job.run_name("exp") == "exp.node1"
    assert not SlurmJob.from_env({"SLURM_JOB_ID": "5", "SLURM_NODEID": "0", "SLURM_PROCID": "3"}).is_primary  # type: ignore[union-attr]


def test_garbage_numbers_fall_back_to_defaults():
    job = SlurmJob.from_env({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "", "SLURM_NODEID": "x"})
    assert job is not None and job.restart_count == 0 and job.node_id == 0


def test_requeue_is_a_list_argv_with_a_timeout():
    r = RunnerRecorder()
    requeue("123", timeout=7, runner=r)
    argv, kw = r.calls[0]
    assert argv == ["scontrol", "requeue", "123"] and kw["timeout"] == 7


def test_requeue_failure_carries_stderr():
    with pytest.raises(SlurmError, match="Job is not requeueable"):
        requeue("123", runner=RunnerRecorder(rc=1, stderr="scontrol: error: Job is not requeueable"))
    with pytest.raises(SlurmError, match="did not answer"):
        requeue("123", runner=RunnerRecorder(exc=subprocess.TimeoutExpired(["scontrol"], 1)))
    with pytest.raises(SlurmError, match="not found"):
        requeue("123", runner=RunnerRecorder(exc=FileNotFoundError("scontrol")))
    with pytest.raises(SlurmError, match="not a Slurm job id"):
        requeue("1; rm -rf /", runner=RunnerRecorder())


def test_kill_wait_parsed_from_show_config():
    assert kill_wait(runner=RunnerRecorder(stdout="JobRequeue = 1\nKillWait                = 30 sec\n")) == 30.0
    assert kill_wait(runner=RunnerRecorder(rc=1, stderr="down")) is None


JOB = SlurmJob(job_id="9", restart_count=1)


@pytest.mark.parametrize("job, outcome, sig, enabled, want, why", [
    (JOB, "preempted", "SIGUSR1", None, True, "requeueing job 9 (restart 1 -> 2)"),
    (JOB, "preempted", "USR2", None, False, "not by the Slurm signal SIGUSR1"),
    (JOB, "preempted", "SIGTERM", None, False, "time limit or scancel"),
    (JOB, "failed", "SIGUSR1", None, False, "for its own reasons"),
    (JOB, "done", None, None, False, "ended as done: not requeued"),
    (JOB, "crashed", None, None, False, "for its own reasons"),
    (JOB, "preempted", "SIGUSR1", False, False, "disabled"),
    (None, "preempted", "SIGUSR1", None, False, "not inside a Slurm job"),
    (SlurmJob(job_id="9", node_id=1, proc_id=1), "preempted", "SIGUSR1", None, False, "not the primary"),
])
def test_requeue_decision(job, outcome, sig, enabled, want, why):
    ok, reason = requeue_decision(job, outcome, sig, "USR1", enabled)
    assert ok is want and why in reason


def test_requeue_decision_with_usr2():
    assert requeue_decision(JOB, "preempted", "SIGUSR2", "USR2")[0] is True


def test_supervisor_notice_source_form_is_understood():
    assert requeue_decision(JOB, "preempted", "signal:SIGUSR1", "USR1")[0] is True
    assert requeue_decision(JOB, "preempted", "signal:SIGTERM", "USR1")[0] is False
    assert requeue_decision(JOB, "preempted", "aws", "USR1")[0] is False


def test_on_run_end_requeues_after_the_slurm_signal_and_says_why_otherwise():
    from onbox.slurm.job import default_run_name, on_run_end, sigterm_grace

    env = {"SLURM_JOB_ID": "77"}
    logs, events = [], []

    def emit(kind, **f):
        events.append((kind, f))

    r = RunnerRecorder()
    assert on_run_end("preempted", "signal:SIGUSR1", "USR1", None, env, logs.append, emit, runner=r) is True
    assert r.calls[0][0] == ["scontrol", "requeue", "77"] and events[-1][0] == "requeue" and events[-1][1]["ok"]
    assert on_run_end("failed", None, "USR1", None, env, logs.append, emit, runner=r) is False
    assert "not requeued" in logs[-1] and events[-1][0] == "requeue_skipped" and len(r.calls) == 1
    bad = RunnerRecorder(rc=1, stderr="Invalid job id specified")
    assert on_run_end("preempted", "signal:SIGUSR1", "USR1", None, env, logs.append, emit, runner=bad) is False
    assert "requeue FAILED" in logs[-1] and "Invalid job id" in logs[-1]
    assert on_run_end("preempted", "signal:SIGUSR1", "USR1", None, {}, logs.append, emit, runner=r) is None
    assert default_run_name(env) == "slurm-77" and default_run_name({}) is None
    assert sigterm_grace({}, runner=r) is None
    assert sigterm_grace(env, runner=RunnerRecorder(stdout="KillWait = 5 sec\n")) == 5.0


def test_non_primary_nodes_restore_but_never_commit():
    from onbox.slurm.job import PrimaryOnlyCommits, checkpoint_hook_for_node

    class Hook:
        def __init__(self):
            self.calls = []

        def restore(self):
            self.calls.append("restore")
            return "/ckpt/step_9"

        def periodic(self):
            self.calls.append("periodic")

        def final(self, deadline):
            self.calls.append("final")
            return {"step": 9}

    inner = Hook()
    assert checkpoint_hook_for_node(inner, {}) is inner
    assert checkpoint_hook_for_node(inner, {"SLURM_JOB_ID": "1"}) is inner
    events = []
    hook = checkpoint_hook_for_node(inner, {"SLURM_JOB_ID": "1", "SLURM_NODEID": "2", "SLURM_PROCID": "2"},
                                    lambda kind, **f: events.append((kind, f)))
    assert isinstance(hook, PrimaryOnlyCommits)
    assert hook.restore() == "/ckpt/step_9"
    hook.periodic()
    hook.periodic()
    assert hook.final(1e9) is None
    assert inner.calls == ["restore"]
    assert [k for k, _ in events] == ["commit_skipped"] and "node 2" in events[0][1]["reason"]


def test_on_run_end_with_a_requeue_seam():
    from onbox.slurm.job import on_run_end

    logs, calls = [], []
    env = {"SLURM_JOB_ID": "8"}
    assert on_run_end("preempted", "signal:SIGUSR1", "USR1", None, env, logs.append, lambda *a, **k: None,
                      requeue_fn=lambda job: calls.append(job) or True) is True
    assert calls == ["8"]
    assert on_run_end("preempted", "signal:SIGUSR1", "USR1", None, env, logs.append, lambda *a, **k: None,
                      requeue_fn=lambda job: False) is False
    assert "refused" in logs[-1]
