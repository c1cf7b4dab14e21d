"""The curriculum rules (onbox/supervisor/phases.py) with the FakeClock seam: [[phase]] tables checked, a phase's
target ends it with the checkpoint signal (SIGKILL a grace later), its criteria decide what comes next, the state
a relaunch resumes from; and the supervisor loop driving it with scripted processes."""
from __future__ import annotations

import json
import os
import signal
from typing import List, Optional

import pytest

from onbox.clock import FakeClock
from onbox.config import RunConfig, resolve
from onbox.errors import UsageError
from onbox.proc import ExitStatus
from onbox.supervisor.hooks import Hooks, NoReaper, NoTelemetry
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.phases import Curriculum, parse_phases
from onbox.supervisor.rundir import RunDir
from onbox.telemetry.metrics import MetricsParser
from tests.fakes.supervisor import Checkpoints, FakeProcs

BROAD = {"name": "broad", "target_steps": 100, "args": ["--data", "web"], "lr": 3e-4, "lr_schedule": "cosine",
         "warmup_steps": 10, "criteria": ["eval_loss < 2.5"]}
CURATED = {"name": "curated", "target_steps": 150, "command": ["other", "train"], "env": {"MIX": "hq"},
           "criteria": "val_loss <= 2.0"}
ANNEAL = {"name": "anneal", "criteria": ["loss < 1"], "on_fail": "continue"}


@pytest.mark.parametrize("tables, message", [
    ([{"target_steps": 5}], "needs a name"),
    ([{"name": "a b", "target_steps": 5}], "needs a name"),
    ([{"name": "a", "target_steps": 5}, {"name": "a"}], "used twice"),
    ([{"name": "a"}, {"name": "b"}], "'a' has no target"),
    ([{"name": "a", "target_steps": 0}], "target_steps must be a whole number from 1"),
    ([{"name": "a", "target_steps": True}], "target_steps must be a whole number"),
    ([{"name": "a", "target_steps": 2.5}], "target_steps must be a whole number"),
    ([{"name": "a", "target_tokens": 1000}], "target_tokens needs tokens_per_step"),
    ([{"name": "a", "target_steps": 5, "target_tokens": 9, "tokens_per_step": 3}], "both target_steps and"),
    ([{"name": "a", "target_steps": 5, "lr": float("nan")}], "lr must be a number from 0 to 100"),
    ([{"name": "a", "target_steps": 5, "criteria": ["eval_loss ~ 2"]}], "is not METRIC OP NUMBER"),
    ([{"name": "a", "target_steps": 5, "criteria": ["perplexity < 2"]}], "names no metric onbox reads"),
    ([{"name": "a", "target_steps": 5, "criteria": ["step > 2"]}], "names no metric onbox reads"),
    ([{"name": "a", "target_steps": 5, "on_fail": "retry"}], "on_fail must be one of fail|continue"),
    ([{"name": "a", "target_steps": 5, "command": []}], "command must be a non-empty list"),
    ([{"name": "a", "target_steps": 5, "command": ["x"], "args": ["y"]}], "both command and args"),
    ([{"name": "a", "target_steps": 5, "env": {"1BAD": "x"}}], "not a valid environment variable name"),
    ([{"name": "a", "target_steps": 5, "env": {"ONBOX_TRACKER_TOKEN": "x"}}], "the agent's secret"),
    ([{"name": "a", "target_steps": 5, "target": 9}], "unknown key 'target'"),
])
def test_bad_phase_tables_are_refused_naming_the_phase_and_the_problem(tables, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("|", r"\|")):
        parse_phases(tables)


def test_a_run_file_with_phase_tables_resolves_into_the_run_config(tmp_path):
    rf = tmp_path / "run.toml"
    rf.write_text('[run]\ncommand = ["python", "train.py"]\n\n[[phase]]\nname = "broad"\ntarget_tokens = 4e10\n'
                  'tokens_per_step = 2097152\n\n[[phase]]\nname = "anneal"\ncriteria = "eval_loss < 2.5"\n')
    cfg = resolve({}, environ={}, run_file=str(rf))
    specs = parse_phases(cfg.phases)
    assert [s.name for s in specs] == ["broad", "anneal"]
    assert specs[0].target_step == 19074  # 4e10 tokens / 2 Mi tokens a step, rounded up
    assert RunConfig.from_dict(cfg.to_dict()).phases == cfg.phases  # config.json keeps them for a relaunch
    rf.write_text('[run]\ncommand = ["x"]\nphases = "broad"\n')
    with pytest.raises(UsageError, match="expected \\[\\[phase\\]\\] tables"):
        resolve({}, environ={}, run_file=str(rf))


def hear(cur, line):
    """What the loop hands the curriculum while an attempt runs: the record in one line of output, as the run's
    progress feed parses it."""
    cur.on_progress(MetricsParser().parse(line))


def make(saved=None, grace=30.0, tables=(BROAD, CURATED, ANNEAL)):
    clock = FakeClock()
    events: List[dict] = []
    cur = Curriculum(parse_phases(list(tables)), saved, signal.SIGUSR2, grace, clock,
                     lambda kind, **f: events.append({"type": kind, **f}))
    return cur, clock, events


def test_each_phase_gets_its_command_args_lr_policy_and_env():
    cur, _, events = make()
    argv, resume, env = cur.attempt(["python", "train.py"], ["--resume={ckpt}"], None)
    assert argv == ["python", "train.py", "--data", "web"] and resume == ["--resume={ckpt}"]
    assert env == {"ONBOX_PHASE": "broad", "ONBOX_PHASE_INDEX": "0", "ONBOX_PHASE_COUNT": "3",
                   "ONBOX_PHASE_START_STEP": "0", "ONBOX_PHASE_TARGET_STEPS": "100", "ONBOX_PHASE_LR": "0.0003",
                   "ONBOX_PHASE_LR_SCHEDULE": "cosine", "ONBOX_PHASE_WARMUP_STEPS": "10"}
    assert events[-1]["type"] == "phase_started" and events[-1]["phase"] == "broad"
    cur.index = 1
    argv, _, env = cur.attempt(["python", "train.py"], [], "/ckpt/step_100")
    assert argv == ["other", "train"] and env["MIX"] == "hq" and env["ONBOX_PHASE"] == "curated"


def test_the_target_sends_the_checkpoint_signal_once_then_sigkill_a_grace_later():
    cur, clock, events = make(grace=20.0)
    cur.attempt(["t"], [], None)
    hear(cur, '{"step": 99, "loss": 3.0}')
    assert cur.signal_due(clock.monotonic()) is None
    hear(cur, "iter 100: loss 2.9000, time 10.0ms, mfu 40.0%")  # any format the heartbeat reads
    assert cur.signal_due(clock.monotonic()) == signal.SIGUSR2
    assert events[-1] == {"type": "phase_target_reached", "phase": "broad", "step": 100, "target_steps": 100}
    clock.advance(19.9)
    assert cur.signal_due(clock.monotonic()) is None  # once; the child is checkpointing
    clock.advance(0.1)
    assert cur.signal_due(clock.monotonic()) == signal.SIGKILL
    assert cur.signal_due(clock.monotonic()) is None


def test_criteria_that_hold_advance_and_the_next_phase_starts_where_this_one_ended():
    cur, _, events = make()
    cur.attempt(["t"], [], None)
    hear(cur, '{"step": 100, "eval_loss": 2.1}')
    cur.signal_due(0.0)
    hear(cur, '{"step": 101, "loss": 2.0}')
    v = cur.after_exit(failed=True)  # killed by the signal it was sent: still the end of the phase
    assert v is not None and v.ok and v.next_phase == 1 and "starting phase 2/3 'curated'" in v.message
    assert cur.history[0]["criteria"] == [{"criterion": "eval_loss < 2.5", "value": 2.1, "ok": True,
                                           "why": "eval_loss 2.1 < 2.5"}]
    _, _, env = cur.attempt(["t"], [], "/c/step_101")
    assert env["ONBOX_PHASE_START_STEP"] == "101" and cur.values == {}  # metrics start over each phase
    assert [e["type"] for e in events] == ["phase_started", "phase_target_reached", "phase_completed",
                                          "phase_started"]


def test_failed_criteria_end_the_run_unless_on_fail_continue():
    cur, _, events = make()
    cur.attempt(["t"], [], None)
    hear(cur, '{"step": 100, "eval_loss": 2.7}')
    cur.signal_due(0.0)
    v = cur.after_exit(failed=False)
    assert v is not None and not v.ok and v.next_phase is None
    assert "phase 1/3 'broad' reached its target step 100" in v.message
    assert "criteria failed: eval_loss 2.7 is not < 2.5" in v.message
    assert events[-1]["type"] == "phase_failed" and cur.to_state()["status"] == "failed"
    # the last phase says on_fail = continue: recorded, and the curriculum completes
    cur, _, _ = make(saved={"name": "anneal", "started_at": 1.0, "history": []})
    cur.attempt(["t"], [], None)
    v = cur.after_exit(failed=False)  # its command exited 0 by itself; loss was never reported
    assert v is not None and v.ok and v.next_phase is None
    assert "the curriculum is complete (criteria failed, on_fail = continue: loss was never reported" in v.message


def test_a_diverged_metric_never_satisfies_a_criterion_and_stays_valid_json():
    cur, _, _ = make()
    cur.attempt(["t"], [], None)
    hear(cur, '{"step": 100, "eval_loss": NaN}')
    cur.signal_due(0.0)
    saved = json.loads(json.dumps(cur.to_state(), allow_nan=False))  # strict JSON: no NaN literal
    assert saved["metrics"]["eval_loss"] == "NaN"
    v = cur.after_exit(failed=False)
    assert v is not None and not v.ok and "eval_loss was nan" in v.message


def test_a_crash_inside_a_phase_is_left_to_the_restart_policy():
    cur, _, _ = make()
    cur.attempt(["t"], [], None)
    hear(cur, '{"step": 40}')
    assert cur.after_exit(failed=True) is None and cur.index == 0


def test_the_state_a_relaunch_resumes_from_and_a_phase_that_no_longer_exists():
    cur, _, events = make()
    cur.attempt(["t"], [], None)
    hear(cur, '{"step": 100, "eval_loss": 2.0}')
    cur.signal_due(0.0)
    cur.after_exit(failed=False)
    cur.attempt(["t"], [], "/c/step_100")
    hear(cur, '{"step": 120, "eval_loss": 1.9}')
    saved = json.loads(json.dumps(cur.to_state()))  # through state.json
    again, _, events = make(saved=saved)
    _, _, env = again.attempt(["t"], [], "/c/step_120")
    assert env["ONBOX_PHASE"] == "curated" and env["ONBOX_PHASE_START_STEP"] == "100"
    assert events == [{"type": "phase_resumed", "phase": "curated", "index": 1, "resume_from": "/c/step_120"}]
    assert again.values["eval_loss"] == 1.9 and [h["name"] for h in again.history] == ["broad"]
    hear(again, '{"step": 121}')
    assert again.signal_due(0.0) is None  # only steps seen in this attempt count toward the target
    with pytest.raises(UsageError, match="phase 'curated', which its \\[\\[phase\\]\\] tables no longer have"):
        make(saved=saved, tables=(BROAD, ANNEAL))


def test_an_agent_adopting_a_child_asked_to_stop_ends_the_phase_when_it_exits():
    cur, clock, _ = make(grace=5.0)
    cur.attempt(["t"], [], None)
    hear(cur, '{"step": 100, "eval_loss": 2.0}')
    assert cur.signal_due(clock.monotonic()) == signal.SIGUSR2
    adopting, clock2, _ = make(saved=json.loads(json.dumps(cur.to_state())), grace=5.0)  # no attempt(): adopted
    clock2.advance(5.0)
    assert adopting.signal_due(clock2.monotonic()) == signal.SIGKILL  # the deadline survived the agent
    v = adopting.after_exit(failed=True)  # an adopted child's exit code cannot be known
    assert v is not None and v.next_phase == 1


# ---- the loop driving it: scripted processes whose output goes to the real output.log ------------------------

def trainer(rd: RunDir, steps_per_s: float, eval_loss: float, path: Optional[str] = None):
    """A scripted child: prints one JSON step line per 1/steps_per_s seconds (or appends it to `path`, its
    ONBOX_METRICS_FILE); exits 0 on the checkpoint signal."""
    printed: List[int] = []

    def script(t: float, sigs: List[int]) -> Optional[ExitStatus]:
        while len(printed) < int(t * steps_per_s):
            printed.append(len(printed) + 1)
            with open(path or rd.log_path, "a") as f:
                f.write(json.dumps({"step": len(printed), "eval_loss": eval_loss}) + "\n")
        return ExitStatus(code=0) if signal.SIGTERM in sigs else None
    return script


def test_the_loop_advances_phases_commits_each_phase_and_fails_on_criteria(tmp_path):
    clock = FakeClock()
    rd = RunDir(str(tmp_path / "cur"))
    os.makedirs(rd.path)
    procs = FakeProcs(clock, [trainer(rd, 1.0, 2.0), trainer(rd, 1.0, 3.0)])
    ckpts = Checkpoints(clock)
    phases = [{"name": "one", "target_steps": 5, "criteria": "eval_loss < 2.5"},
              {"name": "two", "target_steps": 8, "args": ["--hq"], "criteria": "eval_loss < 2.5"}]
    cfg = RunConfig(name="cur", command=["train"], notice_source="none", tick_interval=1.0, phases=phases,
                    max_restarts=0).validate()
    sup = Supervisor(cfg, rd, proc=procs, clock=clock,  # type: ignore[arg-type]
                     hooks_factory=lambda ctx: Hooks(ckpts, NoTelemetry(), NoReaper()),
                     seams=Seams(oom_reader=lambda: None, environ={}, log=lambda m: None, waiter=clock.sleep))
    assert sup.run() == RunState.FAILED
    assert [argv for _, argv in procs.spawned] == [["train"], ["train", "--hq"]]
    assert [s for _, s in procs.signals] == [signal.SIGTERM, signal.SIGTERM]
    assert len(ckpts.finals) == 2  # the end of phase one (before two starts from it), and the run's end
    assert "phase 2/2 'two' reached its target step 8" in sup.message and "eval_loss 3 is not < 2.5" in sup.message
    assert sup.restarts == 0  # a phase change is not a restart
    with open(rd.events_path) as f:
        states = [(e["old"], e["new"]) for e in map(json.loads, f) if e["type"] == "state"]
    assert ("running", "starting") in states  # RUNNING -> STARTING, documented in state.py
    doc = rd.read_state()
    assert doc is not None and doc["phase"]["name"] == "two" and doc["phase"]["status"] == "failed"
    with open(rd.file("training_status.md")) as f:
        status = f.read()
    assert "- phase: 2/2 two" in status and "- one: completed at step" in status and "- two: failed" in status


def test_only_the_attempts_own_records_of_the_metrics_file_count(tmp_path):
    """ONBOX_METRICS_FILE keeps every earlier attempt's and phase's records (more than one read's worth here): the
    run's feed has read them all before an attempt starts and the curriculum hears only the attempt's own, so an
    earlier run's step 500 neither ends a phase at once nor decides its criteria."""
    clock = FakeClock()
    rd = RunDir(str(tmp_path / "cur"))
    os.makedirs(rd.path)
    with open(rd.metrics_file, "w") as f:
        f.write(('{"step": 500, "eval_loss": 9.0, "note": "%s"}\n' % ("x" * 2000)) * 600)  # 1.2 MB > one read
    procs = FakeProcs(clock, [trainer(rd, 1.0, 2.0, rd.metrics_file), trainer(rd, 1.0, 2.0, rd.metrics_file)])
    phases = [{"name": "one", "target_steps": 5, "criteria": "eval_loss < 2.5"},
              {"name": "two", "target_steps": 8, "criteria": "eval_loss < 2.5"}]
    cfg = RunConfig(name="cur", command=["train"], notice_source="none", tick_interval=1.0, phases=phases,
                    max_restarts=0).validate()
    sup = Supervisor(cfg, rd, proc=procs, clock=clock,  # type: ignore[arg-type]
                     hooks_factory=lambda ctx: Hooks(Checkpoints(clock), NoTelemetry(), NoReaper()),
                     seams=Seams(oom_reader=lambda: None, environ={}, log=lambda m: None, waiter=clock.sleep))
    assert sup.run() == RunState.DONE, sup.message
    with open(rd.events_path) as f:
        events = [e for e in map(json.loads, f) if e["type"].startswith("phase_")]
    assert [(e["phase"], e["step"]) for e in events if e["type"] == "phase_target_reached"] == [("one", 5), ("two", 8)]
    assert [e["metrics"]["eval_loss"] for e in events if e["type"] == "phase_completed"] == [2.0, 2.0]
