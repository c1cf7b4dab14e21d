"""Alerts fire on crafted streams (NaN, spike, stall, ...) and stay quiet on healthy ones."""
from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from onbox.telemetry.alerts import AlertEngine, AlertSettings, robust_z


def healthy_losses(n=400, seed=1):
    rng = random.Random(seed)
    return [4.0 * math.exp(-i / 150.0) + 1.0 + rng.gauss(0, 0.03) for i in range(n)]


def codes(engine):
    return [a.code for a in engine.collect()]


def test_healthy_stream_is_quiet():
    eng = AlertEngine()
    for i, loss in enumerate(healthy_losses()):
        assert eng.observe_loss(loss, i) is None
    eng.evaluate(child_alive=True, child_pid=123, quiet_seconds=5.0,
                 disks=[{"path": "/", "free_bytes": 50 * 2**30, "total_bytes": 100 * 2**30, "free_inodes": 10**6,
                         "total_inodes": 2 * 10**6}],
                 gpus=[{"index": 0, "throttle_reasons": ["GpuIdle", "SyncBoost"], "xid_events": [],
                         "verdict": "healthy"}], oom_kill=0,
                 last_sync={"ok": True}, state={"attempts": [{"exit": {"code": 1, "classification": "failed"}}]})
    eng.evaluate(child_alive=True, quiet_seconds=6.0, oom_kill=0)
    assert codes(eng) == []


def test_nan_and_inf_fire_and_latch_until_collected():
    eng = AlertEngine()
    assert eng.observe_loss(float("nan"), 7).code == "nan_loss"
    assert eng.observe_loss(2.0, 8) is None
    assert codes(eng) == ["nan_loss"]
    assert codes(eng) == []  # collected once
    assert eng.observe_loss(float("inf"), 9).code == "nan_loss"


def test_spike_fires_on_robust_z_and_not_on_noise():
    eng = AlertEngine(AlertSettings(spike_min_points=20))
    for i, loss in enumerate(healthy_losses(100)):
        eng.observe_loss(loss, i)
    alert = eng.observe_loss(9.0, 100)
    assert alert is not None and alert.code == "loss_spike" and alert.data["z"] > 8
    assert "loss_spike" in codes(eng)
    # a single outlier in the window does not make every later point a spike (median/MAD are robust)
    for i, loss in enumerate(healthy_losses(50, seed=2)):
        assert eng.observe_loss(loss - 1.0 if loss > 2 else loss, 101 + i) is None


def test_flat_history_does_not_divide_by_zero():
    assert robust_z(1.0, [1.0] * 30) == 0.0
    assert robust_z(1.01, [1.0] * 30) < 10


def test_stall_only_while_child_lives():
    eng = AlertEngine(AlertSettings(stall_seconds=60))
    eng.evaluate(child_alive=True, child_pid=4242, quiet_seconds=61)
    [alert] = eng.collect()
    assert alert.code == "stall" and "py-spy dump --pid 4242" in alert.hint
    eng.evaluate(child_alive=False, child_pid=None, quiet_seconds=600)
    assert codes(eng) == []
    eng.evaluate(child_alive=True, child_pid=1, quiet_seconds=59)
    assert codes(eng) == []


def test_box_conditions_each_with_a_hint():
    eng = AlertEngine(AlertSettings(crash_loop_threshold=3))
    eng.evaluate(child_alive=True, quiet_seconds=0, oom_kill=2)  # baseline
    failed = {"exit": {"code": 1, "classification": "failed"}}
    eng.evaluate(
        child_alive=True, quiet_seconds=0, oom_kill=3,
        disks=[{"path": "/ckpt", "free_bytes": 2**20, "total_bytes": 2**40, "free_inodes": 5, "total_inodes": 10**6}],
        gpus=[{"index": 1, "throttle_reasons": ["HwSlowdown", "SwThermalSlowdown"], "verdict": "dead",
               "verdict_reason": "dead card: Xid 79", "xid_events": [{"xid": 79, "source": "nvml", "at": 5.0,
                                                                       "message": "fell off the bus"}]},
              {"index": 2, "verdict": "pinned", "throttle_reasons": [], "xid_events": []}],
        last_sync={"ok": False, "error": "mkdir: No space left on device", "at": 1.0},
        state={"state": "backoff", "attempts": [failed, failed, failed]})
    alerts = {a.code: a for a in eng.collect()}
    assert sorted(alerts) == ["crash_loop", "gpu_dead", "gpu_pinned", "gpu_throttle", "host_oom_kill", "low_disk",
                              "low_inodes", "sync_failed", "xid"]
    assert all(a.hint for a in alerts.values())
    assert "re-rent" in alerts["xid"].hint and "U22" in alerts["xid"].hint


def test_crash_loop_needs_the_same_failure():
    eng = AlertEngine(AlertSettings(crash_loop_threshold=3))
    a = {"exit": {"code": 1, "classification": "failed"}}
    a2 = {"exit": {"code": 2, "classification": "failed"}}
    b = {"exit": {"code": None, "signal": 9, "classification": "host_oom"}}
    running = {"exit": None}
    eng.evaluate(child_alive=True, state={"attempts": [a, b, a]})
    assert codes(eng) == []
    eng.evaluate(child_alive=True, state={"attempts": [a, a2, a]})  # a different exit code is another failure
    assert codes(eng) == []
    eng.evaluate(child_alive=True, state={"attempts": [b, b, b, running]})  # the running attempt does not count
    [alert] = eng.collect()
    assert alert.code == "crash_loop" and "host_oom" in alert.message
    eng.evaluate(child_alive=True, state={"attempts": [b, b, b, {"exit": {"classification": "success"}}]})
    assert codes(eng) == []


def test_xid_alerts_once_per_event():
    eng = AlertEngine()
    ev = {"xid": 13, "source": "dmesg", "message": "graphics engine exception", "at": None}
    gpu = {"index": 0, "throttle_reasons": [], "xid_events": [ev], "verdict": "healthy"}
    eng.evaluate(child_alive=True, gpus=[gpu])
    assert codes(eng) == ["xid"]
    eng.evaluate(child_alive=True, gpus=[gpu])  # the same kept event in the next reading: no new alert
    assert codes(eng) == []
    gpu2 = dict(gpu, xid_events=[ev, dict(ev, xid=31, message="GPU memory page fault")])
    eng.evaluate(child_alive=True, gpus=[gpu2])
    [alert] = eng.collect()
    assert alert.data["xids"] == [31]


def test_heavy_tailed_batch_noise_is_not_a_spike():
    # per-batch losses with Student-t(3) noise: 8-MAD outliers happen (z up to ~40 here), but they stay small
    # next to the loss itself (< 25 %), so they are batch noise, not a spike
    rng = random.Random(7)
    eng = AlertEngine()
    for i in range(3000):
        t = rng.gauss(0, 1) / math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3)
        assert eng.observe_loss(2.5 + 0.01 * t, i) is None


@given(st.lists(st.floats(0.0, 0.05), min_size=60, max_size=300), st.floats(0.5, 10.0))
@settings(max_examples=100, deadline=None)
def test_property_smooth_decay_with_small_noise_is_quiet(noise, start):
    eng = AlertEngine()
    for i, e in enumerate(noise):
        assert eng.observe_loss(start * (1 + e) / (1 + 0.01 * i), i) is None
