"""The trainer's progress, parsed once: the ProgressFeed (onbox/telemetry/progress.py) and the loop that fills it.
Every record of the child's output and of ONBOX_METRICS_FILE reaches the telemetry hook once, in order; the hooks
read the newest values through RunContext.progress; progress.json is the loop's record of them, written at most
once a second and at the end, and a relaunch goes on from it."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from onbox import fsutil
from onbox.checkpoints.local.completion import read_progress
from onbox.clock import FakeClock
from onbox.config import RunConfig
from onbox.heartbeat.collect import BoxReaders
from onbox.heartbeat.hook import HeartbeatHook
from onbox.proc import ExitStatus
from onbox.supervisor.hooks import Hooks, NoReaper, NoTelemetry, RunContext
from onbox.supervisor.journal import PROGRESS_WRITE_S
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.rundir import RunDir
from onbox.telemetry.progress import ProgressFeed
from tests.fakes.supervisor import Checkpoints, FakeProcs, Script


def test_the_feed_parses_each_line_once_and_keeps_the_newest_value_of_each_field(tmp_path):
    clock = FakeClock()
    feed = ProgressFeed(str(tmp_path / "metrics.jsonl"), (), clock)
    assert feed.on_output("loading the data") is None and feed.records_taken == 0
    assert feed.on_output("iter 10: loss 3.2118, time 20.21ms, mfu 18.44%") == {
        "step": 10, "loss": 3.2118, "steps_per_s": 1000.0 / 20.21}
    clock.advance(5)
    feed.on_output("{'eval_loss': nan, 'epoch': 0.5}")
    snap = feed.snapshot()
    assert feed.records_taken == 2 and snap["step"] == 10 and snap["loss"] == 3.2118 and snap["eval_loss"] == "NaN"
    assert snap["time"] == clock.time() and json.loads(json.dumps(snap, allow_nan=False)) == snap


def test_metrics_file_records_are_read_past_one_reads_worth_each_taken_as_it_is_handed_on(tmp_path):
    path = tmp_path / "metrics.jsonl"
    filler = "x" * 2000
    path.write_text("".join('{"step": %d, "loss": 1.0, "note": "%s"}\n' % (i, filler) for i in range(600)))
    feed = ProgressFeed(str(path), (), FakeClock())
    seen = [(fields["step"], feed.progress.values["step"]) for fields in feed.read_metrics_file()]
    assert seen == [(i, i) for i in range(600)]  # 1.2 MB: more than one read; the newest values as of each
    assert list(feed.read_metrics_file()) == [] and feed.records_taken == 600


def test_a_feed_goes_on_from_the_progress_an_earlier_agent_recorded(tmp_path):
    saved = {"step": 41, "loss": "NaN", "eval_loss": None, "time": 1234.5, "schema": "ignored"}
    feed = ProgressFeed(str(tmp_path / "metrics.jsonl"), (), FakeClock(), saved=saved)
    assert feed.snapshot()["step"] == 41 and feed.snapshot()["loss"] == "NaN" and feed.snapshot()["time"] == 1234.5
    assert feed.records_taken == 0 and feed.progress.step_advanced_mono is None  # nothing new heard yet


class Heard(NoTelemetry):
    """A telemetry hook that keeps what the loop hands it (the rest of the protocol: NoTelemetry's)."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self.records: List[Dict[str, float]] = []

    def on_output(self, line: str) -> None:
        self.lines.append(line)

    def on_progress(self, fields: Dict[str, float]) -> None:
        self.records.append(dict(fields))


def reporting(rd: RunDir, per_second: int, seconds: float) -> Script:
    """A scripted trainer: `per_second` steps a second, each printed (`step N loss L`) and its eval loss appended
    to ONBOX_METRICS_FILE; exits 0 after `seconds`."""
    done: List[int] = []

    def script(t: float, sigs: List[int]) -> Optional[ExitStatus]:
        while len(done) < min(int(t * per_second), int(seconds * per_second)):
            n = len(done) + 1
            done.append(n)
            with open(rd.log_path, "a") as f:
                f.write("step %d loss %.1f\n" % (n, 10.0 / n))
            with open(rd.metrics_file, "a") as f:
                f.write(json.dumps({"step": n, "eval_loss": 20.0 / n}) + "\n")
        return ExitStatus(code=0) if t >= seconds else None
    return script


def supervise(tmp_path, scripts: List[Script], heard: Heard):
    clock = FakeClock()
    rd = RunDir(str(tmp_path / "fed"))
    os.makedirs(rd.path, exist_ok=True)
    cfg = RunConfig(name="fed", command=["train"], notice_source="none", tick_interval=0.5).validate()
    contexts: List[RunContext] = []

    def hooks(ctx: RunContext) -> Hooks:
        contexts.append(ctx)
        return Hooks(Checkpoints(clock), heard, NoReaper())  # type: ignore[arg-type]

    sup = Supervisor(cfg, rd, proc=FakeProcs(clock, scripts), clock=clock,  # type: ignore[arg-type]
                     hooks_factory=hooks,
                     seams=Seams(oom_reader=lambda: None, environ={}, log=lambda m: None, waiter=clock.sleep))
    return sup, rd, contexts[0]


def test_the_loop_hands_each_record_of_the_output_and_the_metrics_file_to_the_telemetry_hook_once(tmp_path):
    heard = Heard()
    sup, rd, ctx = supervise(tmp_path, [reporting(RunDir(str(tmp_path / "fed")), 2, 3.0)], heard)
    assert ctx.progress is sup.progress  # the hooks read the loop's one feed
    beats = HeartbeatHook(ctx, readers=BoxReaders(gpu=lambda: {}, host=lambda: {}, disks=lambda p: []), sinks=[])
    assert beats.feed is sup.progress
    assert sup.run() == RunState.DONE
    printed = [r for r in heard.records if "loss" in r]
    appended = [r for r in heard.records if "eval_loss" in r]
    assert [r["step"] for r in printed] == [r["step"] for r in appended] == list(range(1, 7))
    assert len(heard.records) == 12 and sup.progress.records_taken == 12
    assert "step 6 loss 1.7" in heard.lines
    final = fsutil.read_json(rd.file("progress.json"))  # written at the end, whatever the time since the last
    assert (final["step"], final["loss"], final["eval_loss"]) == (6, 1.7, 20.0 / 6)
    assert read_progress(ctx) == sup.progress.snapshot() == final  # the step fallback reads the feed


def test_progress_json_is_written_at_most_once_a_second_and_a_relaunch_goes_on_from_it(tmp_path, monkeypatch):
    writes: List[int] = []
    real = fsutil.atomic_write_json

    def counting(path: str, doc: Any, *a: Any, **k: Any) -> None:
        if os.path.basename(path) == "progress.json":
            writes.append(doc["step"])
        real(path, doc, *a, **k)

    monkeypatch.setattr(fsutil, "atomic_write_json", counting)
    sup, _, _ = supervise(tmp_path, [reporting(RunDir(str(tmp_path / "fed")), 20, 3.0)], Heard())
    assert sup.run() == RunState.DONE
    assert writes[-1] == 60 and len(writes) <= 3.0 / PROGRESS_WRITE_S + 2  # 60 steps, 120 records: a few writes
    relaunch, _, ctx = supervise(tmp_path, [], Heard())
    assert read_progress(ctx)["step"] == 60  # before the trainer reports again: a stepless checkpoint's step
    assert relaunch.progress.records_taken == 0
