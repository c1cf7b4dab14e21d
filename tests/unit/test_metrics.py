"""Parsers against golden files of real trainer output (tests/golden/metrics/*.txt -> *.expected.json).

Regenerate the expected files after a deliberate change with UPDATE_GOLDEN=1 and review the diff.
"""
from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onbox.errors import UsageError
from onbox.telemetry.metrics import MetricsParser
from onbox.telemetry.progress import MetricsFileTail, Progress

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "metrics")
FORMATS = sorted(f[:-4] for f in os.listdir(GOLDEN) if f.endswith(".txt"))


def _jsonable(fields):
    if fields is None:
        return None
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in sorted(fields.items())}


def render(name: str) -> list:
    parser = MetricsParser()
    out = []
    with open(os.path.join(GOLDEN, name + ".txt"), encoding="utf-8") as f:
        for i, line in enumerate(f.read().splitlines(), 1):
            fmt, _ = parser.parse_with_format(line)
            out.append({"line": i, "format": fmt, "fields": _jsonable(parser.parse(line))})
    return out


@pytest.mark.parametrize("name", FORMATS)
def test_golden(name):
    got = render(name)
    path = os.path.join(GOLDEN, name + ".expected.json")
    if os.environ.get("UPDATE_GOLDEN"):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
    with open(path, encoding="utf-8") as f:
        expected = json.load(f)
    assert got == expected, "golden mismatch for %s: regenerate with UPDATE_GOLDEN=1 and review" % name


def test_each_framework_yields_step_and_loss():
    p = MetricsParser()
    assert p.parse("iter 10: loss 3.2118, time 20.21ms, mfu 18.44%") == {
        "step": 10, "loss": 3.2118, "steps_per_s": pytest.approx(1000 / 20.21)}
    assert p.parse("step 250: train loss 1.9672, val loss 2.0669") == {"step": 250, "loss": 1.9672, "eval_loss": 2.0669}
    hf = p.parse("{'loss': 0.5384, 'grad_norm': 9.87, 'learning_rate': 3.18e-05, 'epoch': 1.09}")
    assert hf == {"loss": 0.5384, "lr": 3.18e-05, "epoch": 1.09}
    assert p.parse("{'eval_loss': '9.86', 'eval_runtime': '4.061', 'epoch': '1'}") == {"eval_loss": 9.86, "epoch": 1.0}
    assert p.parse(" 36%|███▋      | 500/1377 [01:04<01:46,  8.23it/s]")["step"] == 500
    lit = p.parse("Epoch 1 | iter 200 step 50 | loss train: 6.031, val: 6.118 | iter time: 119.02 ms (step)")
    assert lit == {"epoch": 1.0, "step": 50, "loss": 6.031, "eval_loss": 6.118}
    bar = p.parse("Epoch 3: 100%|██████████| 61/61 [00:24<00:00,  2.44it/s, v_num=0, train_loss_step=1.310]")
    assert bar == {"epoch": 3.0, "steps_per_s": 2.44, "loss": 1.31}
    assert math.isnan(p.parse('{"step": 103, "loss": NaN}')["loss"])
    assert p.parse("hello world") is None
    assert p.parse("Validation DataLoader 0:   3%|▎         | 1/38 [00:00<00:00, 40.91it/s]") is None


def test_carriage_return_segments_are_merged():
    p = MetricsParser()
    line = " 1%|          | 10/1000 [00:01<01:40, 9.9it/s]\r 2%|▏         | 20/1000 [00:02<01:38, 9.9it/s]"
    assert p.parse(line)["step"] == 20


def test_user_regex_first_and_validated():
    p = MetricsParser([r"global (?P<step>\d+) ce=(?P<loss>\S+) toks=(?P<tokens_per_s>[\d.]+)"])
    assert p.parse("global 7 ce=1.5 toks=123.0") == {"step": 7, "loss": 1.5, "tokens_per_s": 123.0}
    with pytest.raises(UsageError):
        MetricsParser(["(unclosed"])
    with pytest.raises(UsageError):
        MetricsParser([r"step \d+"])


def test_metrics_file_tail_is_incremental(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsFileTail(str(path))
    assert tail.read_new() == []
    with open(path, "a") as f:
        f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert tail.read_new() == [{"step": 1, "loss": 2.0}]
    with open(path, "a") as f:
        f.write('ss": 1.9}\n')
    assert tail.read_new() == [{"step": 2, "loss": 1.9}]
    assert tail.read_new() == []
    path.write_text('{"step": 9, "loss": 1.0}\n')  # truncated and rewritten: start over
    assert tail.read_new() == [{"step": 9, "loss": 1.0}]


def test_progress_to_dict_is_json_safe():
    prog = Progress()
    prog.update({"step": 3, "loss": float("nan")}, wall=100.0, mono=5.0)
    doc = prog.to_dict()
    assert doc["loss"] == "NaN" and doc["step"] == 3 and doc["time"] == 100.0
    json.dumps(doc, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_parser_never_crashes_on_any_text(text):
    found = MetricsParser().parse(text)
    assert found is None or isinstance(found, dict)
    if found and "step" in found:
        assert isinstance(found["step"], int) and found["step"] >= 0


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["loss", "step", "lr", "eval_loss", "x", "epoch"]),
                       st.one_of(st.floats(allow_nan=True), st.integers(-10**20, 10**20), st.text(max_size=8),
                                 st.none(), st.booleans()), max_size=6))
def test_parser_fuzz_structured_lines(d):
    p = MetricsParser()
    for line in (json.dumps(d), repr(d), " ".join("%s=%s" % kv for kv in d.items())):
        found = p.parse(line)
        assert found is None or isinstance(found, dict)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fragment", ["1", "1/2 ", "|", "5%|", "a=1 ", "loss: ", "Epoch 1/2 ", "12/34 [00:01<",
                                      "iter 1: loss 1, time ", "{'a': 1, ", "│ a ", "1e", "nan"])
def test_pathological_lines_stay_linear(fragment):
    # A child can print anything: a regex that backtracks quadratically would freeze the output reader
    # (the line cap is 16 KB; quadratic patterns took minutes on these before the lookbehinds).
    line = fragment * (20000 // len(fragment))
    MetricsParser().parse(line)


def test_bad_user_regex_is_a_config_error():
    from onbox.config import RunConfig

    with pytest.raises(UsageError, match=r"--metrics-regex .* not a valid regular expression"):
        RunConfig(name="r", metrics_regex=["(?P<step>"]).validate()
    with pytest.raises(UsageError, match="no named group for a metric"):
        RunConfig(name="r", metrics_regex=[r"s=(?P<foo>\d+)"]).validate()
    RunConfig(name="r", metrics_regex=[r"s=(?P<step>\d+) (?P<other>x)"]).validate()


def test_tracker_and_ping_urls_are_validated_with_the_config():
    from onbox.config import RunConfig

    with pytest.raises(UsageError, match=r"--tracker '10\.0\.0\.5:8787': not an http"):
        RunConfig(name="r", tracker="10.0.0.5:8787").validate()
    with pytest.raises(UsageError, match="--ping-url"):
        RunConfig(name="r", ping_url="hc-ping.com/x").validate()
    RunConfig(name="r", tracker="https://t.example", ping_url="https://hc-ping.com/x").validate()


def test_numbers_past_any_float_or_step_are_readings_not_crashes():
    """A diverged run can print a 400-digit integer; a format's \\d+ can match one: never an OverflowError, and never
    a step the tracker (SQLite) or MLflow (int64) would refuse every beat for."""
    p = MetricsParser([])
    huge = "1" + "0" * 400
    assert p.parse('{"step": 1, "loss": %s}' % huge) == {"step": 1, "loss": math.inf}
    assert p.parse('{"step": 2, "loss": -%s}' % huge) == {"step": 2, "loss": -math.inf}
    assert p.parse('{"step": %s, "loss": 3}' % huge) == {"loss": 3.0}
    assert p.parse('{"step": 1e300, "loss": 3}') == {"loss": 3.0}
    assert p.parse("step=%s loss=2.5" % huge) == {"loss": 2.5}
    assert p.parse("step=%d loss=2.5" % (2 ** 63 - 1)) == {"step": 2 ** 63 - 1, "loss": 2.5}
