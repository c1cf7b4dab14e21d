"""Issue 12, the agent's side, at the seams: strict run-file types, the documented ranges, sbatch time formats,
thread deaths reported (metadata poller, heartbeat sender), warnings as alerts, and training_status.md after a
preemption (requeued by Slurm, not requeued, nothing to requeue it) and after a commit without a state change."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from onbox.clock import FakeClock
from onbox.config import RANGES, RunConfig, resolve
from onbox.errors import UsageError
from onbox.heartbeat.sinks import Backoff, Sender
from onbox.heartbeat.spool import Spool
from onbox.proc import Child, ExitStatus, Stopped
from onbox.slurm.script import time_limit_seconds
from onbox.supervisor.hooks import Hooks, NoCheckpoints, NoReaper, NoTelemetry
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.preempt import MetadataPoller
from onbox.supervisor.rundir import RunDir
from onbox.telemetry.alerts import AlertEngine


# ---- config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,words", [
    ("max_restarts", True, "not true/false"), ("keep_last", False, "not true/false"),
    ("prune_local", 1, "expected true or false"), ("requeue", 0.0, "expected true or false"),
    ("grace", True, "not true/false"), ("durable", True, "not true/false"), ("name", 5, "expected a string"),
    ("max_restarts", float("inf"), "whole number"), ("max_restarts", 2.5, "whole number"),
    ("env", {"A": True}, "table"), ("command", ["python", False], "list of strings"),
])
def test_typed_layers_must_carry_the_type(key, value, words):
    with pytest.raises(UsageError, match=words):
        RunConfig.from_dict({key: value}, "run file x.toml")


def test_text_layers_are_parsed():
    cfg = resolve({}, environ={"ONBOX_PRUNE_LOCAL": "yes", "ONBOX_MAX_RESTARTS": "7", "ONBOX_GRACE": "12.5",
                               "ONBOX_METRICS_REGEX": r"s=(?P<step>\d+) (?P<loss>\S+)"})
    assert (cfg.prune_local, cfg.max_restarts, cfg.grace) == (True, 7, 12.5)
    assert cfg.metrics_regex == [r"s=(?P<step>\d+) (?P<loss>\S+)"]  # one regex: no shell-word splitting


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_range_takes_its_bounds_and_refuses_beyond_and_non_finite(key):
    low, high, _ = RANGES[key]
    for ok in (low, high):
        RunConfig(name="r", **{key: ok}).validate()
    bad = [low - 1, high * 2 + 1] + ([float("nan"), float("inf")] if isinstance(low, float) else [])
    for value in bad:
        with pytest.raises(UsageError, match="must be a"):
            RunConfig(name="r", **{key: value}).validate()


# ---- sbatch --time ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), ("30:15", 1815), ("4:00:00", 14400), ("1-2", 93600), ("1-2:30", 95400), ("1-02:30:15", 95415),
    ("UNLIMITED", None), ("infinite", None), ("-1", None), ("0", None), ("120:00:00", 432000),
])
def test_sbatch_time_formats_of_the_man_page(text, seconds):
    assert time_limit_seconds(text) == seconds


# ---- thread deaths ----------------------------------------------------------------------------------------------
class ScriptedClient:
    provider = "aws"

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)

    def check(self, now):
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def _poller(outcomes):
    deaths, notices = [], []
    p = MetadataPoller("aws", "http://127.0.0.1:9", 0.001, lambda *a: notices.append(a),
                       on_death=deaths.append)
    p._detect = lambda: ScriptedClient(outcomes)  # type: ignore[method-assign]
    p.start()
    assert p._thread is not None
    return p, deaths, notices


def test_a_poller_that_keeps_failing_dies_loudly_and_one_glitch_does_not_kill_it():
    p, deaths, _ = _poller([ValueError("garbage")] * 3)
    p._thread.join(5)
    assert not p._thread.is_alive() and len(deaths) == 1 and isinstance(deaths[0], ValueError)
    p, deaths, notices = _poller([ValueError("glitch"), None, (30.0, "aws spot terminate")])
    p._thread.join(5)
    assert deaths == [] and notices == [(30.0, "aws", "aws spot terminate")]


class ExplodingSpool(Spool):
    def backlog(self) -> int:
        raise OSError("the spool dir is gone")


class OkSink:
    name = "file"

    def send(self, beats):
        pass

    def close(self):
        pass


def test_a_sender_that_dies_says_so(tmp_path):
    deaths = []
    sp = ExplodingSpool(str(tmp_path / "s"))
    sp.put(1, {"seq": 1})
    sender = Sender(OkSink(), sp, backoff=Backoff(base=0.001, cap=0.01), on_death=deaths.append)
    sender.start()
    sender._thread.join(5)  # type: ignore[union-attr]
    assert len(deaths) == 1 and "spool dir is gone" in str(deaths[0]) and "spool dir is gone" in sender.last_error


def test_state_warnings_become_alerts():
    engine = AlertEngine()
    engine.evaluate(child_alive=True, state={"warnings": [
        {"code": "thread_died", "severity": "critical", "message": "cloud preemption notices stopped", "hint": "h",
         "thread": "onbox-metadata"},
        {"code": "thread_died", "severity": "critical", "message": "heartbeats to file stopped"},
        {"code": "no_metrics", "severity": "warning", "message": "no metric", "hint": "--metrics-regex"}]})
    alerts = {a.code: a for a in engine.collect()}
    assert alerts["thread_died"].severity == "critical" and alerts["thread_died"].data == {"thread": "onbox-metadata"}
    assert alerts["thread_died"].message == "cloud preemption notices stopped; heartbeats to file stopped"
    assert alerts["no_metrics"].hint == "--metrics-regex"


# ---- training_status.md --------------------------------------------------------------------------------------
class OneChild:
    """A process seam whose one child exits when it gets the checkpoint signal."""

    def __init__(self):
        self.sigs = []

    def spawn(self, argv, env, cwd, log_path):
        return Child(pid=4000, sid=4000, pgid=4000, start_time=1)

    def poll(self, child):
        return ExitStatus(code=0) if self.sigs else None

    def signal_group(self, pgid, sig):
        self.sigs.append(sig)
        return True

    def kill_session(self, sid, timeout, log=None, leader_start=None, also=None, on_step=None):
        return Stopped()

    def descendants(self, root):
        return []

    def marked(self, name, value):
        return []

    def start_time_of(self, pid):
        return None

    def reap_zombies(self, keep=()):
        return []


def read(path):
    with open(path) as f:
        return f.read()


def _preempted_summary(tmp_path, environ, requeue=None):
    clock = FakeClock()
    rd = RunDir(str(tmp_path / "job"))
    os.makedirs(rd.path)
    cfg = RunConfig(name="job", command=["train"], notice_source="none", tick_interval=1.0).validate()
    sup = Supervisor(cfg, rd, proc=OneChild(), clock=clock,  # type: ignore[arg-type]
                     hooks_factory=lambda ctx: Hooks(NoCheckpoints(), NoTelemetry(), NoReaper()),
                     seams=Seams(oom_reader=lambda: None, environ=environ, log=lambda m: None, requeue=requeue,
                                 slurm_runner=lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError())))

    def sleep_then_warn(seconds):
        clock.sleep(seconds)
        if sup.state == RunState.RUNNING and sup.notice is None:
            sup._on_signal(signal.SIGUSR1, None)

    sup.waiter = sleep_then_warn
    assert sup.run() == RunState.PREEMPTED
    with open(rd.file("training_status.md")) as f:
        return f.read(), sup.message


def test_after_a_preemption_the_summary_says_who_brings_the_run_back(tmp_path):
    text, message = _preempted_summary(tmp_path / "a", {})
    assert "- next: nothing restarts it by itself: relaunch with `onbox run --name job`" in text
    assert "it starts from scratch: no checkpoint was committed" in text and "relaunch with" in message
    text, message = _preempted_summary(tmp_path / "b", {"SLURM_JOB_ID": "4242"}, requeue=lambda job: True)
    assert "- next: requeued as Slurm job 4242" in text and message.endswith("requeued as Slurm job 4242")
    text, message = _preempted_summary(tmp_path / "c", {"SLURM_JOB_ID": "4242"}, requeue=lambda job: False)
    assert "- next: NOT requeued (requeue of job 4242 was refused)" in text and "NOT requeued" in message


def test_a_commit_rewrites_the_summary_without_a_state_change(tmp_path):
    """A checkpoint commit (checkpoint_status.json, its event), a hook's rewrite of its file (RunContext.summary_due)
    or new progress (progress.json, written by the loop from its feed) refreshes training_status.md at the next
    tick, from any thread: the summary used to say "no checkpoint yet" for a whole run."""
    from onbox import fsutil

    clock = FakeClock()
    rd = RunDir(str(tmp_path / "job"))
    os.makedirs(rd.path)
    cfg = RunConfig(name="job", command=["train"], notice_source="none", tick_interval=1.0).validate()
    contexts = []
    sup = Supervisor(cfg, rd, proc=OneChild(), clock=clock,  # type: ignore[arg-type]
                     hooks_factory=lambda ctx: contexts.append(ctx) or Hooks(NoCheckpoints(), NoTelemetry(),
                                                                             NoReaper()),
                     seams=Seams(oom_reader=lambda: None, environ={}, log=lambda m: None, waiter=clock.sleep))
    sup._start_attempt()
    summary = rd.file("training_status.md")
    assert "no checkpoint yet" in read(summary)
    fsutil.atomic_write_json(rd.file("checkpoint_status.json"), {
        "latest_durable": {"name": "step-40", "step": 40}, "latest_local": {"name": "step-40", "step": 40},
        "durable": "/d", "verified": True, "last_sync": {"ok": True, "at": time.time()}})
    worker = threading.Thread(target=sup.emit, args=("checkpoint_committed",), kwargs={"checkpoint": "step-40"})
    worker.start()
    worker.join()
    sup._tick()
    text = read(summary)
    assert "newest checkpoint: step-40 (step 40)" in text and "no checkpoint yet" not in text
    assert "- state: **running**" in text
    fsutil.atomic_write_json(rd.file("checkpoint_status.json"), {  # a scan found a newer one: no event
        "latest_durable": None, "latest_local": {"name": "step-45", "step": 45}, "verified": False})
    worker = threading.Thread(target=contexts[0].summary_due)
    worker.start()
    worker.join()
    sup._tick()
    assert "newest checkpoint: step-45 (step 45)" in read(summary)
    with open(rd.metrics_file, "a") as f:
        f.write('{"step": 41, "loss": 1.5}\n')
    clock.advance(1.0)
    sup._observe()
    sup._tick()
    assert "progress: step 41, loss 1.5" in read(summary)
    assert fsutil.read_json(rd.file("progress.json"))["step"] == 41
