"""The log tail each heartbeat carries: bounded, cleaned of terminal noise, and never carrying a secret the agent knows."""
from __future__ import annotations

import json

import jsonschema

from onbox.clock import FakeClock
from onbox.heartbeat.schema import load_schema, validate
from onbox.telemetry.logtail import LINE_CHARS, LogTail
from tests.unit.test_heartbeat_hook import STATE, beats, make


def test_only_the_last_lines_are_kept_and_counted():
    tail = LogTail(3)
    assert tail.snapshot() is None  # nothing printed yet: the beat says null, not an empty list
    for i in range(10):
        tail.add("line %d\n" % i)
    assert tail.snapshot() == {"lines": ["line 7", "line 8", "line 9"], "lines_total": 10, "redacted": 0}


def test_zero_lines_sends_nothing():
    tail = LogTail(0)
    tail.add("hello")
    assert tail.snapshot() is None


def test_long_lines_are_cut_and_terminal_noise_dropped():
    tail = LogTail(5)
    tail.add("x" * (LINE_CHARS + 100))
    tail.add("\x1b[32mgreen\x1b[0m text\x07")
    tail.add(" 10%|#         | 1/10\r 20%|##        | 2/10\r 30%|###       | 3/10\r\n")  # tqdm redrawing in place
    lines = tail.snapshot()["lines"]
    assert lines[0] == "x" * LINE_CHARS + "…"
    assert lines[1] == "green text?"
    assert lines[2] == " 30%|###       | 3/10"


def test_secret_values_are_replaced_longest_first_and_short_values_are_not():
    tail = LogTail(5, ["hf_abcdefghij", "hf_abcdefghij_extended", "yes"])
    tail.add("HF_TOKEN=hf_abcdefghij_extended and again hf_abcdefghij; answer: yes")
    snap = tail.snapshot()
    assert snap["lines"] == ["HF_TOKEN=[secret] and again [secret]; answer: yes"]
    assert snap["redacted"] == 1
    tail.set_secrets(["rotated-value-1"])
    tail.add("now rotated-value-1 and the old hf_abcdefghij")
    assert tail.snapshot()["lines"][-1] == "now [secret] and the old hf_abcdefghij"


def test_the_beat_carries_the_tail_without_the_jobs_secrets_or_the_agents_tokens(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "secrets" / "wandb").write_text("wandb-key-123456\n")
    monkeypatch.setenv("ONBOX_HOME", str(home))
    env_file = tmp_path / "job.env"
    env_file.write_text("# the job's env\nHF_TOKEN=hf_secret_from_env_file\nBATCH=32\n")
    token_file = tmp_path / "tracker.token"
    token_file.write_text("tracker-token-abcdef\n")
    monkeypatch.setenv("ONBOX_TRACKER_TOKEN", "agent-env-token-xyz")
    hook, _run_dir, out = make(tmp_path, FakeClock(), secrets=["WANDB_API_KEY=wandb"], env_files=[str(env_file)],
                               tracker_token_file=str(token_file))
    for line in ("key wandb-key-123456", "hf hf_secret_from_env_file batch 32", "tok tracker-token-abcdef",
                 "env agent-env-token-xyz", "step=1 loss=2.0"):
        hook.on_output(line)
    hook.tick(STATE)
    hook.close(STATE)
    first = beats(out)[0]
    assert first["log_tail"] == {"lines": ["key [secret]", "hf [secret] batch 32", "tok [secret]", "env [secret]",
                                           "step=1 loss=2.0"], "lines_total": 5, "redacted": 4}
    text = json.dumps(beats(out))
    for secret in ("wandb-key-123456", "hf_secret_from_env_file", "tracker-token-abcdef", "agent-env-token-xyz"):
        assert secret not in text
    jsonschema.validate(first, load_schema())
    assert validate(first) == []


def test_a_secret_rotated_between_attempts_is_redacted_from_the_next_attempt_on(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "secrets").mkdir(parents=True)
    (home / "secrets" / "key").write_text("first-secret-value")
    monkeypatch.setenv("ONBOX_HOME", str(home))
    hook, _run_dir, _out = make(tmp_path, FakeClock(), secrets=["KEY=key"])
    hook.beat(dict(STATE, attempt=0), "start")
    (home / "secrets" / "key").write_text("second-secret-value")
    hook.beat(dict(STATE, attempt=1), "event")  # a new attempt reads the secrets again, as the supervisor does
    hook.on_output("printed second-secret-value")
    last = hook.beat(dict(STATE, attempt=1), "interval")
    hook.close(STATE)
    assert last["log_tail"]["lines"] == ["printed [secret]"]


def test_an_unreadable_secret_does_not_stop_the_beats(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_HOME", str(tmp_path / "home"))  # no secrets dir: the attempt says why, not the tail
    hook, _run_dir, _out = make(tmp_path, FakeClock(), secrets=["MISSING"], env_files=[str(tmp_path / "none.env")])
    hook.on_output("hello")
    doc = hook.beat(STATE, "start")
    hook.close(STATE)
    assert doc["log_tail"]["lines"] == ["hello"]
