"""The beat's `times` block (what a goodput ledger reads to tell restoring from down): when the agent started, when
the current attempt's setup began, when its child was spawned. Driven through the hook's seams with a FakeClock."""
from __future__ import annotations

import jsonschema

from onbox.clock import FakeClock
from onbox.heartbeat.schema import load_schema, validate
from tests.unit.test_heartbeat_hook import STATE, beats, make, wait_beats


def _attempt(n, started_at):
    return {"n": n, "started_at": started_at, "ended_at": None}


def test_the_first_attempt_is_set_up_from_the_agents_start_to_its_childs_spawn(tmp_path):
    clock = FakeClock()
    t0 = clock.time()
    hook, _, out = make(tmp_path, clock)
    clock.advance(42.5)  # the restore: fetched and verified before the child starts
    hook.tick(dict(STATE, attempt=0, attempts=[_attempt(0, t0 + 42.5)]))
    hook.close(dict(STATE, attempt=0, attempts=[_attempt(0, t0 + 42.5)]))
    first = wait_beats(out, 2)[0]
    assert first["times"] == {"agent_started_at": t0, "setup_at": t0, "child_started_at": t0 + 42.5}
    assert validate(first) == []
    jsonschema.validate(first, load_schema())


def test_a_backoffs_end_begins_the_next_attempts_setup(tmp_path):
    clock = FakeClock()
    t0 = clock.time()
    hook, _, out = make(tmp_path, clock)
    a0 = _attempt(0, t0 + 1)
    hook.tick(dict(STATE, attempt=0, attempts=[a0]))
    clock.advance(10)
    hook.tick(dict(STATE, state="backoff", attempt=0, attempts=[a0]))  # the child crashed: waiting
    clock.advance(5)
    hook.on_event({"time": clock.time(), "type": "state", "old": "backoff", "new": "starting"})
    clock.advance(3)  # the next attempt's restore
    a1 = _attempt(1, clock.time())
    hook.tick(dict(STATE, attempt=1, attempts=[a0, a1]))
    hook.close(dict(STATE, attempt=1, attempts=[a0, a1]))
    got = wait_beats(out, 4)
    assert [b["times"]["setup_at"] for b in got] == [t0, t0, t0 + 15, t0 + 15]
    assert [b["times"]["child_started_at"] for b in got] == [t0 + 1, t0 + 1, t0 + 18, t0 + 18]
    assert {b["times"]["agent_started_at"] for b in got} == {t0}


def test_an_attempt_this_agent_did_not_set_up_has_no_setup_time(tmp_path):
    clock = FakeClock()
    t0 = clock.time()
    older = _attempt(0, t0 - 3600)  # the child of an earlier agent
    hook, _, out = make(tmp_path, clock)
    hook.on_event({"time": t0, "type": "adopted", "pid": 4242, "start_time": 1.0})
    hook.tick(dict(STATE, attempt=0, attempts=[older]))
    hook.close(dict(STATE, attempt=0, attempts=[older]))
    assert wait_beats(out, 2)[0]["times"] == {"agent_started_at": t0, "setup_at": None,
                                              "child_started_at": t0 - 3600}


def test_a_relaunch_whose_restore_found_a_fence_has_no_child_and_no_setup(tmp_path):
    # the agent ends before any child of its own: the attempts are an earlier agent's
    clock = FakeClock()
    t0 = clock.time()
    hook, _, out = make(tmp_path, clock)
    clock.advance(2)
    hook.close(dict(STATE, state="fenced", attempt=0, attempts=[_attempt(0, t0 - 600)]))
    assert wait_beats(out, 1)[0]["times"]["setup_at"] is None


def test_a_beat_without_attempts_says_no_child_yet(tmp_path):
    clock = FakeClock()
    hook, _, out = make(tmp_path, clock)
    hook.tick(STATE)
    hook.close(STATE)
    times = beats(out)[0]["times"]
    assert times["child_started_at"] is None and times["setup_at"] is None


def test_an_older_tracker_or_reader_sees_an_unknown_key_only():
    # onbox.heartbeat/1 readers ignore unknown keys: a beat with `times` of the wrong shape is refused by this
    # schema, one without it (an older agent) is as valid as before
    base = {"schema": "onbox.heartbeat/1", "run": "x", "box": "b", "attempt": 0, "seq": 0, "time": 1.0,
            "state": "running"}
    assert validate(base) == []
    assert validate(dict(base, times={"agent_started_at": 1.0, "setup_at": None, "child_started_at": 2.0})) == []
    assert validate(dict(base, times={"setup_at": "soon"}))
