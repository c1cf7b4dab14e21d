"""The trainer's progress, parsed once: the ProgressFeed (onbox/telemetry/progress.py)."""
from __future__ import annotations

import json

from onbox.clock import FakeClock
from onbox.telemetry.progress import ProgressFeed


def test_the_feed_parses_each_line_once_and_keeps_the_newest_value_of_each_field(tmp_path):
    clock = FakeClock()
    feed = ProgressFeed(str(tmp_path / "metrics.jsonl"), (), clock)
    assert feed.on_output("loading the data") is None and feed.records == 0
    assert feed.on_output("iter 10: loss 3.2118, time 20.21ms, mfu 18.44%") == {
        "step": 10, "loss": 3.2118, "steps_per_s": 1000.0 / 20.21}
    clock.advance(5)
    feed.on_output("{'eval_loss': nan, 'epoch': 0.5}")
    snap = feed.snapshot()
    assert feed.records == 2 and snap["step"] == 10 and snap["loss"] == 3.2118 and snap["eval_loss"] == "NaN"
    assert snap["time"] == clock.time() and json.loads(json.dumps(snap, allow_nan=False)) == snap


def test_metrics_file_records_are_read_past_one_reads_worth_each_taken_as_it_is_handed_on(tmp_path):
    path = tmp_path / "metrics.jsonl"
    filler = "x" * 2000
    path.write_text("".join('{"step": %d, "loss": 1.0, "note": "%s"}\n' % (i, filler) for i in range(600)))
    feed = ProgressFeed(str(path), (), FakeClock())
    seen = [(fields["step"], feed.progress.values["step"]) for fields in feed.read_metrics_file()]
    assert seen == [(i, i) for i in range(600)]  # 1.2 MB: more than one read; the newest values as of each
    assert list(feed.read_metrics_file()) == [] and feed.records == 600


def test_a_feed_goes_on_from_the_progress_an_earlier_agent_recorded(tmp_path):
    saved = {"step": 41, "loss": "NaN", "eval_loss": None, "time": 1234.5, "schema": "ignored"}
    feed = ProgressFeed(str(tmp_path / "metrics.jsonl"), (), FakeClock(), saved=saved)
    assert feed.snapshot()["step"] == 41 and feed.snapshot()["loss"] == "NaN" and feed.snapshot()["time"] == 1234.5
    assert feed.records == 0 and feed.progress.step_advanced_mono is None  # nothing new heard yet
