"""The hang rule (onbox/telemetry/cadence.py) driven by scripted observations on a fake clock: the bound each phase
gets, the verdict once per quiet period, and the healthy cadences that must never be called hung (a checkpoint
save longer than a step, an eval that is silent for minutes, a slow first step, a trainer that reports no step)."""
from __future__ import annotations

from onbox.telemetry.cadence import EVAL, STARTUP, TRAIN, HangDetector, HangSettings

SETTINGS = HangSettings(factor=10.0, floor=120.0, startup=1200.0)


def steps(det: HangDetector, t: float, n: int, every: float, first: int = 0) -> float:
    """`n` step reports `every` seconds apart from time `t`; the time of the last one."""
    for i in range(n):
        t += every
        assert det.check(t) is None
        det.record({"step": first + i, "loss": 1.0}, t)
    return t


def quiet_until(det: HangDetector, t: float, until: float, probe=None, every: float = 1.0):
    """Ask the detector every second from t to `until` with nothing happening; the first verdict, else None."""
    while t < until:
        t += every
        verdict = det.check(t, probe)
        if verdict is not None:
            return t, verdict
    return None


def test_a_trainer_that_stops_reporting_is_hung_after_k_times_its_step_time_or_the_floor():
    det = HangDetector(HangSettings(factor=10.0, floor=30.0, startup=1200.0))
    det.attempt_started(0.0)
    t = steps(det, 0.0, 20, 6.0)
    assert det.bound() == (60.0, "train: max(10 x median step interval 6 s, floor 30 s)")
    t_hung, verdict = quiet_until(det, t, t + 1000)
    assert t_hung - t == 60.0
    assert (verdict.phase, verdict.step, verdict.bound_s, verdict.typical_s) == (TRAIN, 19, 60.0, 6.0)
    # fast steps: the floor decides
    det = HangDetector(SETTINGS)
    det.attempt_started(0.0)
    t = steps(det, 0.0, 50, 0.2)
    assert det.bound()[0] == 120.0
    assert quiet_until(det, t, t + 1000)[0] - t >= 120.0


def test_the_verdict_comes_once_and_any_sign_of_life_rearms_it():
    det = HangDetector(HangSettings(factor=10.0, floor=10.0, startup=100.0))
    det.attempt_started(0.0)
    t = steps(det, 0.0, 10, 1.0)
    t, _ = quiet_until(det, t, t + 100)
    assert quiet_until(det, t, t + 500) is None  # latched: no second verdict for the same quiet
    det.alive(t)  # output again
    assert quiet_until(det, t, t + 100)[0] - t == 10.0


def test_output_bytes_keep_it_alive_without_steps():
    det = HangDetector(HangSettings(factor=10.0, floor=10.0, startup=100.0))
    det.attempt_started(0.0)
    t = steps(det, 0.0, 10, 1.0)
    for _ in range(100):  # a tqdm bar redrawn every 5 s, no step parsed
        t += 5.0
        assert det.check(t) is None
        det.alive(t)


def test_a_checkpoint_save_longer_than_the_bound_is_no_hang_while_the_dir_is_written():
    det = HangDetector(HangSettings(factor=2.0, floor=0.0, startup=100.0))
    det.attempt_started(0.0)
    t = steps(det, 0.0, 10, 1.0)  # bound 2 s
    save_end = t + 6.0  # a save 6x the step time, writing the checkpoint dir as it goes
    written = {"at": t}

    def probe():
        return written["at"]

    while t < save_end:
        t += 0.5
        written["at"] = t - 0.25  # the file grew a quarter second ago
        assert det.check(t, probe) is None
    t = steps(det, t, 5, 1.0, first=10)  # training goes on
    t_hung, verdict = quiet_until(det, t, t + 100, probe, every=0.5)  # a save that stops writing is a hang
    assert verdict.quiet_s >= 2.0 and t_hung - t <= 2.5


def test_a_checkpoint_save_that_takes_three_steps_is_within_the_learned_bound_anyway():
    det = HangDetector(HangSettings(factor=10.0, floor=0.0, startup=100.0))
    det.attempt_started(0.0)
    t = 0.0
    for i in range(200):
        t += 3.0 if i % 10 == 9 else 1.0  # every 10th step saves for 3 step times
        assert det.check(t) is None
        det.record({"step": i}, t)
    assert det.bound()[0] == 10.0  # the median ignores the saves


def test_an_announced_eval_that_is_silent_for_minutes_is_no_hang_and_its_length_is_learned():
    det = HangDetector(HangSettings(factor=10.0, floor=5.0, startup=600.0))
    det.attempt_started(0.0)
    t = steps(det, 0.0, 20, 0.5)  # train bound 5 s
    for k in range(3):
        det.alive(t)
        det.line("Running evaluation on 2000 samples", t)
        assert det.phase == EVAL
        if k == 0:
            assert det.bound() == (600.0, "startup bound 600 s (an eval, none learned yet)")
        else:
            assert det.bound()[0] == 2.0 * 240.0  # twice the longest eval silence seen
        assert quiet_until(det, t, t + 240.0) is None  # four silent minutes
        t += 240.0
        det.alive(t)  # the result line's bytes (the loop sees every output byte)
        det.line("eval_loss 2.31", t)
        t = steps(det, t, 10, 0.5, first=20 + 10 * k)
        assert det.phase == TRAIN and det.bound()[0] == 5.0
    det.line("evaluating", t)
    t_hung, verdict = quiet_until(det, t, t + 2000)  # an eval that never ends is a hang too
    assert verdict.phase == EVAL and t_hung - t == 480.0


def test_eval_announcements_in_the_shapes_trainers_print():
    for line in ["eval", "Evaluating: 100%|###| 10/10", "***** Running Evaluation *****", "Validation DataLoader 0:",
                 "validating...", '{"phase": "eval", "step": 40}', "[eval] starting", "running eval at step 300"]:
        det = HangDetector(SETTINGS)
        det.line(line, 1.0)
        assert det.phase == EVAL, line
    for line in ["step 10 loss 0.5 eval_loss 0.6", "iter 600: val loss 3.1", "loading validation set",
                 '{"step": 3, "loss": 1.0}', "evalue=3"]:
        det = HangDetector(SETTINGS)
        det.line(line, 1.0)
        assert det.phase == STARTUP, line


def test_a_slow_first_step_gets_the_startup_bound_and_the_cadence_carries_over_attempts():
    det = HangDetector(HangSettings(factor=10.0, floor=10.0, startup=300.0))
    det.attempt_started(0.0)
    assert det.bound() is None  # no step ever: nothing to judge by
    assert quiet_until(det, 0.0, 5000.0) is None
    t = steps(det, 5000.0, 10, 1.0)
    det.attempt_started(t)  # a restart: the model loads again
    assert det.bound() == (300.0, "startup bound 300 s (before the attempt's first step)")
    assert quiet_until(det, t, t + 299.0) is None
    t += 299.0
    det.record({"step": 9}, t)  # the first step after the resume: the learned cadence applies at once
    assert det.bound()[0] == 10.0


def test_a_run_an_earlier_agent_saw_report_steps_is_judged_from_its_first_attempt_here():
    det = HangDetector(HangSettings(factor=10.0, floor=10.0, startup=300.0), reported=True)
    det.attempt_started(0.0)
    t_hung, verdict = quiet_until(det, 0.0, 1000.0)
    assert t_hung == 300.0 and verdict.phase == STARTUP


def test_until_five_intervals_are_known_the_startup_bound_applies():
    det = HangDetector(HangSettings(factor=10.0, floor=10.0, startup=300.0))
    det.attempt_started(0.0)
    steps(det, 0.0, 3, 1.0)
    assert det.bound()[0] == 300.0 and "2 of 5" in det.bound()[1]


def test_hang_after_replaces_the_learned_bound_and_off_disables_it():
    det = HangDetector(HangSettings(after=45.0, factor=10.0, floor=120.0, startup=300.0))
    det.attempt_started(0.0)
    t = steps(det, 0.0, 10, 1.0)
    assert det.bound() == (45.0, "--hang-after 45 s")
    det.line("eval", t)
    assert det.bound()[0] == 45.0
    off = HangDetector(HangSettings(after=0.0), reported=True)
    off.attempt_started(0.0)
    t = steps(off, 0.0, 10, 1.0)
    assert off.bound() is None and quiet_until(off, t, t + 100000, every=1000.0) is None


def test_reports_read_together_measure_one_interval():
    det = HangDetector(HangSettings(factor=10.0, floor=0.0, startup=300.0))
    det.attempt_started(0.0)
    t = 0.0
    for i in range(10):
        t += 0.5
        for j in range(5):  # five steps printed between two reads of the output, handed on microseconds apart
            det.record({"step": i * 5 + j}, t + j * 2e-5)
    assert [round(x, 3) for x in det.intervals] == [0.5] * 9
