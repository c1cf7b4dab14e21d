"""The heartbeat hook driven through its seams: FakeClock, fake box readers, a file sink; golden heartbeat."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest

from onbox.clock import FakeClock
from onbox.heartbeat.collect import BoxReaders
from onbox.heartbeat.hook import HeartbeatHook
from onbox.heartbeat.schema import load_schema, validate
from onbox.heartbeat.sinks import FileSink
from onbox.subsystems import make_hooks
from tests.fakes.run_context import run_context
from tests.fakes.supervisor import loop_step

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "golden", "heartbeat", "heartbeat.json")

GPUS = {"available": True, "reason": None, "gpus": [{
    "index": 0, "name": "NVIDIA H100 80GB HBM3", "util_percent": 97.0, "sm_clock_mhz": 1980, "power_w": 650.5,
    "memory_used_bytes": 70 * 2**30, "memory_total_bytes": 80 * 2**30, "temperature_c": 71,
    "throttle_reasons": [], "xid_events": []}]}
HOST = {"cgroup_version": "v2", "cgroup_path": "/", "memory_current_bytes": 10 * 2**30,
        "memory_limit_bytes": 64 * 2**30, "oom_kill": 0, "cpu_quota_cores": 8.0, "effective_cpus": 8,
        "load_average": [1.0, 1.0, 1.0]}
DISKS = [{"role": "run", "path": "/runs", "free_bytes": 100 * 2**30, "total_bytes": 200 * 2**30,
          "free_inodes": 10**6, "total_inodes": 2 * 10**6}]


def make(tmp_path, clock, **cfg):
    cfg.setdefault("heartbeat_interval", 30.0)
    ctx = run_context(tmp_path, name="exp1", clock=clock, durable=None, **cfg)
    run_dir = tmp_path / "run"
    readers = BoxReaders(gpu=lambda: GPUS, host=lambda: HOST, disks=lambda paths: DISKS)
    out = tmp_path / "beats.jsonl"
    hook = HeartbeatHook(ctx, readers=readers, sinks=[FileSink(str(out))], close_timeout=10.0)
    return hook, run_dir, out


def beats(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def wait_beats(path, n, clock_timeout=10.0):
    import time

    deadline = time.monotonic() + clock_timeout
    while time.monotonic() < deadline:
        got = beats(path)
        if len(got) >= n:
            return got
        time.sleep(0.01)
    raise AssertionError("only %d of %d beats arrived" % (len(beats(path)), n))


STATE = {"run": "exp1", "state": "running", "attempt": 0, "child_pid": None, "restarts": 0, "attempts": [],
         "last_exit": None}


def test_beats_on_start_interval_state_change_and_alert(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_BOX", "box-a")
    clock = FakeClock()
    hook, _run_dir, out = make(tmp_path, clock)
    hook.tick(STATE)  # start
    clock.advance(10)
    loop_step(hook, "iter 10: loss 3.2118, time 20.21ms, mfu 18.44%")
    hook.tick(STATE)  # nothing due
    clock.advance(21)
    hook.tick(STATE)  # interval
    hook.tick(dict(STATE, state="backoff"))  # state change
    loop_step(hook, "iter 11: loss nan, time 20.21ms, mfu 18.44%")
    hook.tick(dict(STATE, state="backoff"))  # new alert
    got = wait_beats(out, 4)
    assert [b["reason"] for b in got] == ["start", "interval", "event", "alert"]
    first = int(1_700_000_000.0 * 1000)  # a fresh counter starts at the wall clock in ms (FakeClock's start)
    assert [b["seq"] for b in got] == [first, first + 1, first + 2, first + 3]
    assert got[1]["progress"]["step"] == 10 and got[1]["progress"]["loss"] == 3.2118
    assert [a["code"] for a in got[3]["alerts"]] == ["nan_loss"]
    assert got[3]["progress"]["step"] == 11 and got[3]["progress"]["loss"] == "NaN"  # JSON has no NaN
    hook.close(dict(STATE, state="done"))
    got = beats(out)
    assert got[-1]["reason"] == "final" and got[-1]["state"] == "done"
    for b in got:
        assert validate(b) == []


def test_metrics_file_and_checkpoint_status_are_read(tmp_path):
    clock = FakeClock()
    hook, run_dir, out = make(tmp_path, clock)
    (run_dir / "metrics.jsonl").write_text('{"step": 5, "loss": 1.5, "tokens_per_s": 1000}\n')
    (run_dir / "checkpoint_status.json").write_text(json.dumps(
        {"latest_local": "step-5", "latest_durable": "step-5", "verified": True,
         "last_sync": {"ok": False, "error": "No space left on device", "at": 1.0}}))
    loop_step(hook)
    hook.tick(STATE)
    hook.close(STATE)
    first = beats(out)[0]
    assert first["progress"]["step"] == 5 and first["progress"]["tokens_per_s"] == 1000
    assert first["checkpoint"]["latest_durable"] == "step-5"
    assert "sync_failed" in [a["code"] for a in first["alerts"]]


def test_seq_continues_after_agent_restart(tmp_path):
    clock = FakeClock()
    hook, _, out = make(tmp_path, clock)
    hook.tick(STATE)
    hook.close(STATE)
    clock.advance(3600)
    hook2, _, _ = make(tmp_path, clock)  # a restarted agent continues the counter, whatever the time
    hook2.tick(STATE)
    hook2.close(STATE)
    seqs = [b["seq"] for b in beats(out)]
    assert seqs == list(range(seqs[0], seqs[0] + 4))


def test_golden_heartbeat_matches_schema_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_BOX", "box-a")
    clock = FakeClock()
    hook, _run_dir, _out = make(tmp_path, clock)
    loop_step(hook, "{'loss': 2.25, 'grad_norm': 1.0, 'learning_rate': 3e-05, 'epoch': 0.5}",
            " 36%|███▋      | 500/1377 [01:04<01:46,  8.23it/s]")
    doc = hook.beat(dict(STATE, child_pid=None, attempts=[{"n": 0}]), "interval")
    hook.close(STATE)
    doc = json.loads(json.dumps(doc).replace(str(tmp_path), "/tmp/T"))
    if os.environ.get("UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
    with open(GOLDEN) as f:
        expected = json.load(f)
    assert doc == expected
    jsonschema.validate(expected, load_schema())
    assert validate(expected) == []


@pytest.mark.parametrize("bad", [
    None, [], {}, {"schema": "onbox.heartbeat/1"},
    {"schema": "onbox.heartbeat/1", "run": "../x", "box": "b", "attempt": 0, "seq": 0, "time": 1, "state": "s"},
    {"schema": "onbox.heartbeat/1", "run": "x", "box": "b", "attempt": -1, "seq": 0, "time": 1, "state": "s"},
    {"schema": "onbox.heartbeat/1", "run": "x", "box": "b", "attempt": 0, "seq": True, "time": 1, "state": "s"},
    {"schema": "onbox.heartbeat/1", "run": "x", "box": "b", "attempt": 0, "seq": 0, "time": 1, "state": "s",
     "progress": {"loss": "lots"}},
])
def test_validate_rejects(bad):
    assert validate(bad)


def test_make_hooks_plugs_the_heartbeat_in(tmp_path):
    ctx = run_context(tmp_path, name="r", durable=None)
    assert isinstance(make_hooks(ctx).telemetry, HeartbeatHook)


def test_stall_beat_while_child_lives(tmp_path):
    clock = FakeClock()
    hook, _, out = make(tmp_path, clock, stall_minutes=1.0, heartbeat_interval=300.0)
    live = dict(STATE, child_pid=os.getpid())
    hook.tick(live)
    loop_step(hook, "iter 1: loss 2.0, time 5.00ms, mfu 1.00%")
    clock.advance(59)
    hook.tick(live)
    clock.advance(2)
    hook.tick(live)  # quiet for 61 s < interval: the stall alone makes a beat
    hook.close(dict(live, state="done", child_pid=None))
    got = beats(out)
    assert [b["reason"] for b in got] == ["start", "alert", "final"]
    stall = next(a for a in got[1]["alerts"] if a["code"] == "stall")
    assert "py-spy dump --pid %d" % os.getpid() in stall["hint"]
    assert got[2]["alerts"] == []  # the child is gone: no stall


def test_a_failing_reader_does_not_stop_the_beat(tmp_path):
    clock = FakeClock()
    hook, _, _out = make(tmp_path, clock)

    def broken():
        raise RuntimeError("boom")

    hook.readers = BoxReaders(gpu=broken, host=lambda: HOST, disks=lambda paths: DISKS)
    doc = hook.beat(STATE, "interval")
    hook.close(STATE)
    assert doc["gpus"] == {"available": False, "reason": "reading failed: RuntimeError('boom')"}


def test_beat_with_real_host_and_gpu_readers_matches_the_schema(tmp_path):
    """The landed readers (cgroup of this machine; NVML through tests/fakes/nvml.py) produce a valid beat."""
    from onbox.gpu.nvml import NvmlSeam
    from onbox.heartbeat import collect
    from tests.fakes.nvml import FakeGpu, FakeNvml

    clock = FakeClock()
    hook, _, _ = make(tmp_path, clock)
    for nvml, available in ((FakeNvml(gpus=[FakeGpu(memory_used=2 * 2**30)]), True),
                            (FakeNvml(driver=False), False),
                            (FakeNvml(gpus=[FakeGpu()], missing={"nvmlDeviceGetPowerUsage"}), True)):
        hook.readers = BoxReaders(gpu=collect.default_gpu_reader(NvmlSeam(module=nvml)),
                                  host=collect.default_host_reader())
        doc = json.loads(json.dumps(hook.beat(STATE, "interval")))
        jsonschema.validate(doc, load_schema())
        assert validate(doc) == []
        assert doc["gpus"]["available"] is available
        if available:
            assert doc["gpus"]["gpus"][0]["memory_total_bytes"] == 80 * 2**30
        else:
            assert "driver" in doc["gpus"]["reason"]
        assert doc["host"].get("cgroup_version") in ("v1", "v2", "hybrid", "none")
    hook.close(STATE)


def test_non_finite_reading_does_not_break_the_beat(tmp_path):
    clock = FakeClock()
    hook, _, out = make(tmp_path, clock)
    gpus = {"available": True, "reason": None, "gpus": [dict(GPUS["gpus"][0], power_w=float("nan"))]}
    hook.readers = BoxReaders(gpu=lambda: gpus, host=lambda: dict(HOST, load_average=(float("inf"), 1.0, 1.0)),
                              disks=lambda paths: DISKS)
    hook.beat(STATE, "interval")
    hook.close(STATE)
    first = beats(out)[0]
    assert first["gpus"]["gpus"][0]["power_w"] == "NaN" and first["host"]["load_average"][0] == "Infinity"
