"""The hang watch inside the loop, driven by scripted attempts on a FakeClock: the trainer's steps are lines the
test appends to output.log as the fake time passes, its hang is the lines stopping. What --on-hang does (alert,
restart through the restart policy, stop), every step said as an event, and the warning in state.json and
training_status.md."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.proc import ExitStatus, ProcRef
from onbox.supervisor.hooks import Hooks, NoTelemetry
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.rundir import RunDir
from onbox.supervisor.runsummary import render_status
from onbox.supervisor.stacks import ProcessStacks
from tests.fakes.supervisor import Checkpoints, FakeProcs, Script

PY_SPY = 'Thread 11 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n'


class HangProcs(FakeProcs):
    def session_members(self, sid: int) -> List[int]:
        return []


class Reaper:
    def __init__(self) -> None:
        self.calls: List[List[int]] = []

    def before_attempt(self, earlier_sessions: List[int]) -> None:
        self.calls.append(list(earlier_sessions))

    def gpu_state(self) -> Dict[str, Any]:
        return {"available": False, "reason": "no NVIDIA driver", "gpus": []}


def runs_until_killed(t: float, sigs: List[int]) -> Optional[ExitStatus]:
    return ExitStatus(signal=9) if 9 in sigs else None


class Trainer:
    """Appends one step line a fake second to output.log, per attempt, until that attempt's `hang_at` (seconds
    since it started; None: never), and ends at `done_at` (a script)."""

    def __init__(self, sup: Supervisor, clock: FakeClock, hang_at: List[Optional[float]]) -> None:
        self.sup, self.clock, self.hang_at = sup, clock, hang_at
        self.step, self.next_at = 0, None

    def wait(self, seconds: float) -> None:
        self.clock.sleep(seconds)
        sup = self.sup
        if sup.state != RunState.RUNNING or sup.child is None:
            self.next_at = None
            return
        n = sup.launcher.number
        started = sup.attempts[-1]["started_at"]
        now = self.clock.time()
        hang = self.hang_at[n] if n < len(self.hang_at) else None
        if self.next_at is None:
            self.next_at = started + 1.0
        with open(sup.rd.log_path, "a") as f:
            while self.next_at <= now and (hang is None or self.next_at - started < hang):
                f.write(json.dumps({"step": self.step, "loss": 1.0}) + "\n")
                self.step += 1
                self.next_at += 1.0


def make(tmp_path, scripts: List[Script], hang_at: List[Optional[float]], **fields: Any):
    clock = FakeClock()
    procs = HangProcs(clock, scripts)
    ckpts = Checkpoints(clock)
    reaper = Reaper()
    synced: List[float] = []
    cfg = RunConfig(name="hang", command=["train"], notice_source="none", tick_interval=1.0, backoff_initial=2.0,
                    hang_factor=10.0, hang_floor=5.0, hang_startup=60.0, **fields).validate()
    rd = RunDir(str(tmp_path / "hang"))
    os.makedirs(rd.path)
    captured: List[List[ProcRef]] = []

    def stacks(refs: List[ProcRef]) -> List[ProcessStacks]:
        captured.append(list(refs))
        return [ProcessStacks(ProcRef(11, 5), command="python -u train.py", state="S (sleeping)",
                              wchan="futex_do_wait", python=PY_SPY, method="py-spy")]

    sup = Supervisor(cfg, rd, proc=procs, clock=clock,  # type: ignore[arg-type]
                     hooks_factory=lambda ctx: Hooks(ckpts, NoTelemetry(), reaper,  # type: ignore[arg-type]
                                                     logs=lambda: synced.append(clock.monotonic())),
                     seams=Seams(oom_reader=lambda: None, environ={}, log=lambda m: None, stacks=stacks))
    trainer = Trainer(sup, clock, hang_at)
    sup.waiter = trainer.wait
    sup.trainer = trainer  # type: ignore[attr-defined]
    return sup, procs, reaper, synced, captured


def events(sup: Supervisor, kind: str) -> List[Dict[str, Any]]:
    with open(sup.rd.file("events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["type"] == kind]


def test_a_hung_attempt_is_detected_by_its_cadence_stacks_kept_then_stopped_and_restarted(tmp_path):
    # 1 s steps: bound max(10 x 1 s, 5 s) = 10 s. Attempt 0 hangs after 20 steps; attempt 1 trains and ends.
    sup, procs, reaper, synced, captured = make(
        tmp_path, [runs_until_killed, lambda t, s: ExitStatus(code=0) if t >= 30 else None], [20.0, None])
    assert sup.run() == RunState.DONE
    (hang,) = events(sup, "hang_detected")
    assert hang["attempt"] == 0 and hang["phase"] == "train" and hang["bound_s"] == 10.0
    assert 10.0 <= hang["quiet_s"] <= 11.0  # within one tick of the bound
    assert hang["rule"] == "train: max(10 x median step interval 1 s, floor 5 s)"
    assert hang["processes"][0]["top"] == "all_reduce (torch/distributed/distributed_c10d.py:3252)"
    assert hang["gpus"] == {"available": False, "reason": "no NVIDIA driver"}
    with open(hang["stacks"]) as f:
        text = f.read()
    assert hang["stacks"] == sup.rd.file("hang-stacks.0.txt") and "all_reduce" in text and "no NVIDIA driver" in text
    assert captured and len(synced) == 1  # the stacks went to durable storage with the logs, once, after the stop
    first_exit = sup.attempts[0]["exit"]
    assert first_exit["classification"] == "hung" and hang["stacks"] in first_exit["message"]
    (action,) = events(sup, "hang_action")
    assert action["action"] == "restart" and action["state"] == "backoff" and action["restarts"] == 1
    assert reaper.calls == [[], [1000]]  # the reaper runs before the restart, as before every attempt
    (back,) = events(sup, "hang_recovered")
    assert back["hung_attempt"] == 0 and back["attempt"] == 1 and 0 < back["after_s"] < 5.0
    warning = next(w for w in sup.state_doc()["warnings"] if w["code"] == "hang")
    assert warning["severity"] == "warning" and "recovered" in warning["message"]
    assert len(procs.spawned) == 2


def test_alert_only_leaves_the_trainer_as_it_is_and_says_it_everywhere(tmp_path):
    sup, procs, reaper, synced, _ = make(tmp_path, [lambda t, s: ExitStatus(code=0) if t >= 60 else None],
                                         [20.0], on_hang="alert")
    wait = sup.waiter
    said: Dict[str, Any] = {}

    def watch(seconds: float) -> None:
        wait(seconds)
        if events(sup, "hang_action") and "doc" not in said:
            said["doc"] = sup.state_doc()
            sup.trainer.hang_at[0] = None  # type: ignore[attr-defined]  # and then it comes back by itself

    sup.waiter = watch
    assert sup.run() == RunState.DONE
    assert len(procs.spawned) == 1 and procs.signals == [] and reaper.calls == [[]] and synced == []
    (w,) = [w for w in said["doc"]["warnings"] if w["code"] == "hang"]
    assert w["severity"] == "critical" and w["stacks"] == sup.rd.file("hang-stacks.0.txt")
    assert "only alerted" in w["message"]
    summary = render_status(said["doc"])
    assert "- next: the trainer is HUNG and left as it is (--on-hang alert): read the stacks in %s" % w["stacks"] \
        in summary
    (back,) = events(sup, "hang_recovered")
    assert back["hung_attempt"] == back["attempt"] == 0
    (w,) = [w for w in sup.state_doc()["warnings"] if w["code"] == "hang"]
    assert w["severity"] == "warning" and "recovered" in w["message"]
    assert "HUNG" not in render_status(sup.state_doc())


def test_stop_ends_the_run_failed_hung_with_its_gpu_reaped(tmp_path):
    sup, procs, reaper, synced, _ = make(tmp_path, [runs_until_killed], [20.0], on_hang="stop")
    assert sup.run() == RunState.FAILED
    assert sup.last_exit["classification"] == "hung" and len(procs.spawned) == 1
    assert reaper.calls == [[], [1000]] and len(synced) == 1
    (action,) = events(sup, "hang_action")
    assert action["action"] == "stop" and action["state"] == "failed"
    doc = sup.state_doc()
    assert "- next: fix the hang (read the stacks in %s)" % sup.rd.file("hang-stacks.0.txt") in render_status(doc)


def test_the_restarts_are_bounded_by_the_restart_policy(tmp_path):
    sup, procs, _, _, _ = make(tmp_path, [runs_until_killed] * 5, [20.0, 5.0, 5.0, 5.0, 5.0], max_restarts=10)
    assert sup.run() == RunState.FAILED
    assert len(procs.spawned) == 3 and "the same failure (hung) 3 times in a row" in sup.message
    assert [e["attempt"] for e in events(sup, "hang_detected")] == [0, 1, 2]


def test_a_healthy_trainer_is_never_judged(tmp_path):
    sup, _, _, _, _ = make(tmp_path, [lambda t, s: ExitStatus(code=0) if t >= 300 else None], [None])
    assert sup.run() == RunState.DONE and events(sup, "hang_detected") == []
