"""A run's deadline (onbox/supervisor/deadline.py, onbox/launch/deadline.py), driven through the fake process seam
and a FakeClock: the checkpoint is asked for at deadline - (grace + commit + margin), the commit estimate (the
newest checkpoint's size by the measured throughput) moves it, a trainer that ignores the signal is killed in time
for the newest complete checkpoint to be committed before the wall, and the run exits 75 `session_limit` with how
to continue. Then the launch's side: --deadline parsed, Slurm's EndTime read, a Kaggle session, bad input refused."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Dict, List, Optional

import pytest

from onbox.config import RunConfig, parse_deadline
from onbox.errors import UnfitError, UsageError
from onbox.launch import deadline as launch_deadline
from onbox.slurm import job as slurm
from onbox.supervisor.deadline import SessionDeadline
from onbox.supervisor.loop import RunState, exit_code_for
from tests.fakes.supervisor import Checkpoints, dies_on, exits_after
from tests.unit.test_supervisor_loop import make


class Estimating(Checkpoints):
    """Checkpoints whose commit estimate is `estimate(t)` seconds at monotonic time t (from the run's start), and
    whose final commit names the newest checkpoint."""

    def __init__(self, clock: Any, estimate: Any, name: str = "step_40.ckpt") -> None:
        super().__init__(clock)
        self.t0 = clock.monotonic()
        self.estimate = estimate
        self.name = name

    def commit_estimate(self) -> Optional[Dict[str, Any]]:
        return {"seconds": self.estimate(self.clock.monotonic() - self.t0)}

    def final(self, deadline: float):
        super().final(deadline)
        return {"name": self.name, "step": 40, "status": "committed"}


def deadline_run(tmp_path, scripts, at_s: float, estimate: Any = lambda t: 3.0, **fields):
    sup, procs, _, clock = make(tmp_path, scripts, **fields)
    ckpts = Estimating(clock, estimate)
    sup.hooks.checkpoints = ckpts
    sup.intake.deadline = SessionDeadline(clock.time() + at_s, "flag", fields.get("grace", 30.0), 5.0)
    return sup, procs, ckpts, clock


def test_ask_at_is_the_deadline_less_grace_commit_and_margin_and_moves_with_the_estimate():
    d = SessionDeadline(10_000.0, "slurm", grace=30.0, margin=60.0)
    assert d.ask_at == 10_000.0 - 90.0  # nothing measured yet: 0 s of commit
    d.update(12.5)  # a 1.25 GB checkpoint at 100 MB/s
    assert d.ask_at == 10_000.0 - 102.5 and d.kill_at == 10_000.0 - 72.5 and d.commit_by == 10_000.0 - 60.0
    d.update(2.5)  # the throughput measured 5x faster
    assert d.ask_at == 10_000.0 - 92.5
    assert not d.due(10_000.0 - 92.6) and d.due(10_000.0 - 92.5)
    doc = d.to_dict(9_000.0)
    assert doc["left_s"] == 1000.0 and doc["commit_estimate_s"] == 2.5 and doc["source"] == "slurm"
    assert set(doc) >= {"at", "source", "ask_at", "left_s", "commit_estimate_s"}


def test_the_checkpoint_is_asked_for_at_ask_at_and_the_run_exits_75_session_limit(tmp_path):
    sup, procs, ckpts, clock = deadline_run(tmp_path, [dies_on(signal.SIGTERM)], at_s=100.0, grace=10.0)
    t0 = clock.monotonic()
    assert sup.run() == RunState.PREEMPTED and exit_code_for(sup.state) == 75
    sent = [(round(t - t0, 3), s) for t, s in procs.signals]
    assert sent[0][1] == signal.SIGTERM and 82.0 <= sent[0][0] <= 83.0  # 100 - (10 + 3 + 5), within a tick (1 s)
    last = sup.last_exit or {}
    assert last["classification"] == "session_limit"
    assert last["hint"] == "relaunch to continue: `onbox run --name loop`: it resumes from step_40.ckpt"
    assert sup.message.startswith("session limit") and sup.state_doc()["preemption"]["source"] == "session_limit"
    # the final commit may run until the deadline less the margin (the commit's time was kept after the KILL)
    assert ckpts.finals and round(ckpts.finals[-1][1] - t0, 3) == 95.0
    doc = sup.state_doc()["deadline"]
    assert doc["source"] == "flag" and doc["commit_estimate_s"] == 3.0 and doc["asked_at"] is not None


def test_a_growing_checkpoint_moves_ask_at_earlier(tmp_path):
    """The commit estimate grows from 1 s to 30 s at t=20 s (a bigger checkpoint, a slower measured
    throughput): the checkpoint is asked for 29 s earlier than it would have been."""
    sup, procs, _, clock = deadline_run(tmp_path, [dies_on(signal.SIGTERM)], at_s=100.0, grace=10.0,
                                        estimate=lambda t: 1.0 if t < 20.0 else 30.0)
    t0 = clock.monotonic()
    assert sup.run() == RunState.PREEMPTED
    first = procs.signals[0][0] - t0
    assert 55.0 <= first <= 56.0  # 100 - (10 + 30 + 5), not 100 - (10 + 1 + 5) = 84


def test_a_trainer_that_ignores_the_signal_is_killed_and_the_newest_checkpoint_committed_before_the_wall(tmp_path):
    sup, procs, ckpts, clock = deadline_run(tmp_path, [dies_on(signal.SIGKILL)], at_s=100.0, grace=10.0,
                                            sync_reserve=2.0)
    t0 = clock.monotonic()
    wall0 = clock.time()
    assert sup.run() == RunState.PREEMPTED
    sent = [(round(t - t0, 1), s) for t, s in procs.signals]
    ask = sent[0][0]
    assert sent[0][1] == signal.SIGTERM and sent[-1][1] == signal.SIGKILL
    assert round(sent[-1][0] - ask, 1) <= 10.0 + 0.1  # KILL a grace after the ask: at - margin - commit
    commits = [(round(at - t0, 1), round(d - t0, 1)) for at, d in ckpts.finals]
    assert commits[0][0] < sent[-1][0]  # the reserve's commit while the trainer ignored the signal
    assert commits[-1][0] >= sent[-1][0] and commits[-1][1] == 95.0  # and again once it was gone, before the wall
    assert all(at < 100.0 for at, _ in commits) and clock.time() - wall0 < 100.0
    assert sup.last_exit["classification"] == "session_limit" and "Signal 9" in sup.last_exit["message"]


def test_a_deadline_during_a_backoff_ends_session_limit_without_another_attempt(tmp_path):
    sup, procs, _, _ = deadline_run(tmp_path, [exits_after(1, 1), exits_after(1000, 0)], at_s=50.0, grace=10.0,
                                    backoff_initial=300.0, crash_loop_threshold=0)
    assert sup.run() == RunState.PREEMPTED
    assert len(procs.spawned) == 1
    assert sup.last_exit["classification"] == "session_limit" and "no child was running" in sup.last_exit["message"]


def test_another_notice_first_wins_and_the_deadline_is_not_taken(tmp_path):
    sup, _, _, clock = deadline_run(tmp_path, [dies_on(signal.SIGTERM)], at_s=100.0, grace=10.0)
    original = clock.sleep

    def sleep_and_preempt(seconds: float) -> None:
        original(seconds)
        if sup.state == RunState.RUNNING and sup.notice is None and clock.monotonic() - 1000.0 >= 10.0:
            sup._on_signal(signal.SIGUSR1, None)

    sup.waiter = sleep_and_preempt
    assert sup.run() == RunState.PREEMPTED
    assert sup.last_exit["classification"] == "preempted" and sup.notice.source == "signal:SIGUSR1"


def test_the_deadline_comes_from_the_config_and_is_in_state_json(tmp_path):
    sup, _, _, _ = make(tmp_path, [exits_after(5, 0)], deadline_at=1_700_000_000.0 + 3600.0,
                            deadline_source="slurm", grace=20.0, deadline_margin=30.0)
    assert sup.run() == RunState.DONE
    doc = sup.state_doc()["deadline"]
    assert doc["at"] == 1_700_003_600.0 and doc["source"] == "slurm" and doc["ask_at"] == 1_700_003_600.0 - 50.0


# ---- the launch's side ----------------------------------------------------------------------------------------
NOW = 1_800_000_000.0


def test_deadline_text_is_parsed_as_a_time_with_its_zone_or_a_duration():
    assert parse_deadline("11h40m", NOW) == NOW + 11 * 3600 + 40 * 60
    assert parse_deadline("1d2h", NOW) == NOW + 26 * 3600
    assert parse_deadline("90", NOW) == NOW + 90 and parse_deadline("45s", NOW) == NOW + 45
    assert parse_deadline("2027-01-15T12:00:00Z", NOW) == parse_deadline("2027-01-15T13:00+01:00", NOW)
    assert parse_deadline("none", NOW) is None
    for bad, says in (("soon", "not a time"), ("2027-01-15T12:00", "no zone"), ("0s", "more than 0"),
                      ("2027-02-30T00:00Z", "day is out of range"), ("12x", "not a time")):
        with pytest.raises(UsageError, match=says):
            parse_deadline(bad, NOW)
    with pytest.raises(UsageError, match="--deadline"):
        RunConfig(deadline="tomorrow").validate()


def cfg_for(**fields) -> RunConfig:
    return RunConfig(name="r", command=["true"], **fields).validate()


def test_the_launch_refuses_a_deadline_in_the_past_or_too_near(tmp_path):
    with pytest.raises(UsageError, match="in the past"):
        launch_deadline.resolve(cfg_for(deadline="2020-01-01T00:00Z"), {}, str(tmp_path), now=NOW)
    with pytest.raises(UsageError, match="shorter than the stop needs: grace 30 s"):
        launch_deadline.resolve(cfg_for(deadline="60s"), {}, str(tmp_path), now=NOW)
    cfg = cfg_for(deadline="20s", grace=5.0, deadline_margin=2.0)
    assert launch_deadline.resolve(cfg, {}, str(tmp_path), now=NOW) == []
    assert (cfg.deadline_at, cfg.deadline_source) == (NOW + 20.0, "flag")
    cfg = cfg_for(deadline="none", deadline_at=123.0)  # a recorded one is never inherited
    launch_deadline.resolve(cfg, {}, str(tmp_path), now=NOW)
    assert cfg.deadline_at is None


def scontrol(stdout: str = "", rc: int = 0, stderr: str = ""):
    calls: List[List[str]] = []

    def runner(argv, **kw):
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)

    runner.calls = calls  # type: ignore[attr-defined]
    return runner


def test_slurm_end_time_is_read_from_scontrol_as_local_time(tmp_path):
    import time

    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW + 7200))
    run = scontrol("JobId=42 JobName=x\n   RunTime=00:01:00 TimeLimit=02:00:00\n   StartTime=x EndTime=%s "
                   "Deadline=N/A\n" % end)
    assert slurm.end_time("42", runner=run) == NOW + 7200
    cfg = cfg_for()
    assert launch_deadline.resolve(cfg, {"SLURM_JOB_ID": "42"}, str(tmp_path), now=NOW, runner=run) == []
    assert (cfg.deadline_at, cfg.deadline_source) == (NOW + 7200, "slurm")
    assert run.calls[0][:3] == ["scontrol", "show", "job"]


def test_an_unreadable_slurm_end_time_is_a_warning_or_with_deadline_slurm_a_refusal(tmp_path):
    unlimited = scontrol("JobId=42 TimeLimit=UNLIMITED EndTime=Unknown\n")
    cfg = cfg_for()
    warnings = launch_deadline.resolve(cfg, {"SLURM_JOB_ID": "42"}, str(tmp_path), now=NOW, runner=unlimited)
    assert cfg.deadline_at is None and len(warnings) == 1 and "cannot be read" in warnings[0]
    with pytest.raises(UnfitError, match="end time of Slurm job 42 cannot be read"):
        launch_deadline.resolve(cfg_for(deadline="slurm"), {"SLURM_JOB_ID": "42"}, str(tmp_path), now=NOW,
                                runner=scontrol(rc=1, stderr="slurm_load_jobs error: Invalid job id specified"))
    with pytest.raises(UsageError, match="not inside a Slurm job"):
        launch_deadline.resolve(cfg_for(deadline="slurm"), {}, str(tmp_path), now=NOW)


def test_a_platform_end_too_near_for_the_stop_is_a_warning_and_the_run_goes_on_without_a_deadline(tmp_path):
    """A one-minute Slurm job (or a session nearly over): the job already runs, so the launch never refuses it; the
    run has no deadline of its own and Slurm's signal stops it. The same end given as --deadline is refused."""
    import time

    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW + 59))
    one_minute = scontrol("JobId=42 TimeLimit=00:01:00 EndTime=%s\n" % end)
    cfg = cfg_for()
    warnings = launch_deadline.resolve(cfg, {"SLURM_JOB_ID": "42"}, str(tmp_path), now=NOW, runner=one_minute)
    assert cfg.deadline_at is None and cfg.deadline_source is None
    assert len(warnings) == 1 and "the slurm session's end" in warnings[0] and "shorter than the stop needs" in \
        warnings[0] and "no deadline of its own" in warnings[0], warnings
    past = scontrol("JobId=42 TimeLimit=00:01:00 EndTime=%s\n" % time.strftime(
        "%Y-%m-%dT%H:%M:%S", time.localtime(NOW - 5)))
    assert "in the past" in launch_deadline.resolve(cfg_for(), {"SLURM_JOB_ID": "42"}, str(tmp_path), now=NOW,
                                                    runner=past)[0]
    with pytest.raises(UsageError, match="shorter than the stop needs"):
        launch_deadline.resolve(cfg_for(deadline="59s"), {}, str(tmp_path), now=NOW)


def test_a_kaggle_session_ends_its_hours_after_the_session_began(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_deadline, "session_start", lambda now: now - 3600.0)  # an hour into the session
    cfg = cfg_for(profile="kaggle")
    launch_deadline.resolve(cfg, {"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, str(tmp_path), now=NOW)
    assert (cfg.deadline_at, cfg.deadline_source) == (NOW + 11 * 3600.0, "kaggle")
    cfg = cfg_for(profile="kaggle")
    launch_deadline.resolve(cfg, {"TPU_NAME": "local"}, str(tmp_path), now=NOW)
    assert cfg.deadline_at == NOW + 8 * 3600.0
    cfg = cfg_for(profile="kaggle", deadline="2h")  # --deadline wins
    launch_deadline.resolve(cfg, {}, str(tmp_path), now=NOW)
    assert (cfg.deadline_at, cfg.deadline_source) == (NOW + 7200.0, "flag")
    cfg = cfg_for(profile="generic-ssh")
    launch_deadline.resolve(cfg, {}, str(tmp_path), now=NOW)
    assert cfg.deadline_at is None


def test_the_session_start_is_pid_1s_never_later_than_now():
    start = launch_deadline.session_start(NOW * 2)
    assert start <= NOW * 2 and start < os.stat("/proc/1").st_mtime + 10 ** 9


def test_a_slurm_job_stopped_by_its_deadline_is_requeued_only_when_the_run_asks():
    job = slurm.SlurmJob(job_id="42")
    assert slurm.requeue_decision(job, "preempted", "session_limit", "USR1", None)[0] is False
    assert slurm.requeue_decision(job, "preempted", "session_limit", "USR1", False)[0] is False
    ok, why = slurm.requeue_decision(job, "preempted", "session_limit", "USR1", True)
    assert ok and "deadline" in why


def test_a_session_limit_requeued_by_slurm_says_so_in_its_hint(tmp_path):
    sup, _, _, _ = deadline_run(tmp_path, [dies_on(signal.SIGTERM)], at_s=100.0, grace=10.0, requeue=True)
    sup.environ["SLURM_JOB_ID"] = "42"
    sup.seams.requeue = lambda job_id: True
    assert sup.run() == RunState.PREEMPTED
    assert sup.last_exit["hint"].startswith("Slurm requeued the job: when it runs again it resumes from step_40")
    assert "requeued as Slurm job 42" in sup.message


def test_no_deadline_costs_nothing_and_says_nothing(tmp_path):
    sup, _, _, _ = make(tmp_path, [exits_after(3, 0)])
    assert sup.run() == RunState.DONE and sup.state_doc()["deadline"] is None


def test_training_status_and_onbox_status_show_the_time_left_and_when_the_checkpoint_is_asked_for():
    from onbox.supervisor.runsummary import deadline_line, render_status

    block = SessionDeadline(NOW + 3725.0, "slurm", 30.0, 60.0)
    block.update(3.2)
    state = {"run": "r", "state": "running", "updated_at": NOW, "deadline": block.to_dict(NOW)}
    text = render_status(state)
    assert ("- deadline: 2027-01-15T09:02:05Z (slurm), 1h02m left; checkpoint asked for at 2027-01-15T09:00:31Z "
            "(grace 30 s + commit ~3.2 s + margin 60 s)") in text
    ended = deadline_line(dict(block.to_dict(NOW), asked_at=NOW + 3631.0), NOW + 3700.0, live=False)
    assert "left" not in ended and "asked for at" in ended


def test_the_resolved_deadline_is_recorded_for_an_adopting_agent_and_never_taken_from_the_environment():
    cfg = cfg_for(deadline="2h", deadline_at=NOW + 7200.0, deadline_source="flag", deadline_margin=30.0)
    again = RunConfig.from_dict(cfg.to_dict(), "config.json").validate()  # what `onbox adopt` reads back
    assert (again.deadline_at, again.deadline_source, again.deadline_margin) == (NOW + 7200.0, "flag", 30.0)
    from onbox.config import env_overrides

    assert env_overrides({"ONBOX_DEADLINE_AT": "1", "ONBOX_DEADLINE": "2h"}) == {"deadline": "2h"}
    with pytest.raises(UsageError, match="deadline_at"):
        RunConfig(deadline_at=float("nan")).validate()


def test_the_commit_hook_estimates_the_newest_checkpoint_by_its_size_and_the_measured_throughput(tmp_path):
    """What moves ask_at: the newest complete checkpoint's bytes / the measured throughput, plus the commit's
    overhead and the final quiet period; none without durable storage."""
    from onbox.checkpoints.hook import CheckpointCommitHook
    from onbox.checkpoints.hook.scheduler import COMMIT_OVERHEAD_S
    from tests.checkpoint_files import write_torch_zip
    from tests.fakes.run_context import run_context

    ctx = run_context(tmp_path, settle_seconds=0.0)
    hook = CheckpointCommitHook(ctx)
    assert hook.commit_estimate()["seconds"] == COMMIT_OVERHEAD_S  # nothing saved yet: the overhead alone
    write_torch_zip(os.path.join(ctx.ckpt_dir, "step_3.pt"))
    hook.scan_now()
    est = hook.commit_estimate()
    size = est["bytes"]
    assert est["checkpoint"] == "step_3.pt" and size > 0
    hook.throughput = 1000.0  # measured: 1 kB/s
    assert hook.commit_estimate()["seconds"] == round(size / 1000.0 + COMMIT_OVERHEAD_S, 3)
    hook.throughput = 4000.0  # measured faster: the estimate, and so ask_at's lead, shrinks
    assert hook.commit_estimate()["seconds"] == round(size / 4000.0 + COMMIT_OVERHEAD_S, 3)
    hook.scheduler.committer = None  # no durable storage: nothing to commit
    assert hook.commit_estimate() is None
