"""The keeper must never recover a healthy run (issue 31, part 1), for real: network-namespace boxes with their own
sshd, real agents beating to a real tracker on this machine, the real trainer (tests/integration/keep_trainer.py),
and `onboxctl keep` as a process (tests/hosts/keeper_rig.py). Two runs, each on its own box (both boxes in the pool
too, as rented fleets are), one idle spare, and a provision command that notes every call.

- the keeper's own link goes (this machine's end of every box's link, tests/hosts/netns.py cut_keeper_side, the
  unreachable routes in place first) for 5x --lost-after, and again for 60 s, while every box trains on: the
  keeper says it is blind, and after each heal both runs are where they were, nothing fenced, the spare untouched,
  no provision;
- the keeper's machine "reboots": the keeper SIGKILLed, the tracker on it stopped and its links cut for 10x
  --lost-after while the boxes train on; then everything back and the keeper started again: it watches on and
  recovers nothing.
As few boxes as prove it (three): each netns box is an sshd, an agent and a trainer on a 2-core machine.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Dict, List

import pytest

from tests.hosts.keeper_rig import Rig
from tests.hosts.netns import cut_keeper_side, heal_keeper_side
from tests.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LOST_AFTER = 3.0  # the rig's --lost-after (1 s beats)
RUNS = {"kp": "b1", "kq": "b2"}


@pytest.fixture
def fleet(tmp_path, netns_boxes, onbox_pyz):
    from tests.hosts.tracker import TrackerProcess

    b1, b2, s1 = netns_boxes(3)
    rig = Rig(tmp_path, onbox_pyz)
    tracker = TrackerProcess(str(tmp_path / "tracker"), host=b1.netns.host_addr).start()  # on this machine
    rig.env["ONBOX_TRACKER_TOKEN"] = tracker.token
    try:
        for name, box in (("b1", b1), ("b2", b2), ("s1", s1)):
            rig.add(name, box, pool="p")
        provision = rig.provision_marker()
        for run, box in RUNS.items():
            rig.ctl("push", box, "--pyz", rig.pyz)
            with rig.named(run):
                rig.launch(box, "--tracker", tracker.url, "--tracker-token-file", tracker.token_file,
                           "--provision", provision, lost_after="%gs" % LOST_AFTER)
        for run in RUNS:
            with rig.named(run):
                wait_for(lambda: len(rig.committed()) >= 1, 90, "a durable commit of %s" % run)
        yield rig, tracker, [b1, b2, s1], provision
    finally:
        tracker.stop()
        rig.close()
        for run, box in RUNS.items():
            with rig.named(run):
                rig.kill_run(box)


def records(rig: Rig) -> Dict[str, Dict[str, Any]]:
    out = {}
    for run in RUNS:
        with rig.named(run):
            out[run] = rig.record()
    return out


def steps(rig: Rig) -> Dict[str, int]:
    out = {}
    for run, box in RUNS.items():
        with rig.named(run):
            out[run] = rig.newest_step(box)
    return out


def watching_where_they_were(rig: Rig) -> bool:
    recs = records(rig)
    return all(r.get("state") == "watching" and r.get("boxes") == [RUNS[run]] for run, r in recs.items())


def assert_untouched(rig: Rig, spare: Any, provision: str) -> None:
    """Both runs on their boxes, never recovered; nothing fenced; the spare and the provision command untouched."""
    for run, rec in records(rig).items():
        kinds = [e["kind"] for e in rec.get("events") or []]
        assert rec["boxes"] == [RUNS[run]] and rec["recoveries"] == 0, (run, rec.get("message"), kinds)
        assert not {"declared_lost", "box_chosen", "relaunched"} & set(kinds), (run, kinds)
        with rig.named(run):
            assert rig.state(RUNS[run]).get("state") == "running", run
            assert not [e for e in rig.events(RUNS[run]) if e.get("type") == "fenced"], run
            assert not rig.took_over(RUNS[run])
    assert not os.path.exists(os.path.join(spare.home, ".onbox", "runs")), "a run was launched on the spare"
    assert not os.path.exists(provision + ".called"), "the provision command was called"
    starts = [(s["box"], s["start"]) for s in rig.starts()]  # every trainer start of both runs (one trace file)
    assert sorted(starts) == [("b1", 0), ("b2", 0)], starts


def blip(rig: Rig, boxes: List[Any], seconds: float) -> None:
    """The keeper's own link cut for `seconds` while every box trains on: said blind, every run trained on."""
    before = steps(rig)
    t_cut = time.time()
    cut_keeper_side(boxes)
    try:
        wait_for(lambda: all(r.get("blind_since") for r in records(rig).values()), 60, "the keeper to say it is blind",
                 0.3)
        while time.time() < t_cut + seconds:
            time.sleep(0.5)  # the cut lasts what it lasts: the keeper's passes go on meanwhile
    finally:
        heal_keeper_side(boxes)
    after = steps(rig)
    assert all(after[run] > before[run] + 5 for run in RUNS), (before, after)  # every box trained on, unseen
    wait_for(lambda: watching_where_they_were(rig) and not any(r.get("blind_since") for r in records(rig).values()),
             90, "the keeper to see again and watch both runs where they were", 0.3)


@pytest.mark.timeout(300)  # two cuts (5 x --lost-after, then 60 s) and their heals: ~106 s on a quiet machine
def test_the_keepers_own_link_cut_for_5x_lost_after_and_for_60_s_recovers_nothing(fleet):
    rig, _tracker, boxes, provision = fleet
    t0 = time.time()
    rig.keeper()
    wait_for(lambda: all((r.get("last_ok") or 0) > t0 for r in records(rig).values()), 60, "the keeper's first pass")
    time.sleep(3 * LOST_AFTER)  # the keeper has watched long enough for its fast path to be armed
    for seconds in (5 * LOST_AFTER, 60.0):
        blip(rig, boxes, seconds)
        time.sleep(3 * LOST_AFTER)  # passes after the heal, while the beats come back: still nothing
        assert_untouched(rig, boxes[2], provision)
    for run, rec in records(rig).items():
        kinds = [e["kind"] for e in rec["events"]]
        assert kinds.count("keeper_blind") == 2 and kinds.count("keeper_sees_again") == 2, (run, kinds)


def test_the_keepers_machine_down_for_10x_lost_after_then_back_recovers_nothing(fleet):
    """A reboot of the keeper's machine: the keeper SIGKILLed, its tracker stopped, its links down, for 10x
    --lost-after while the boxes train on (their beats spooled); then the links and the tracker back and the keeper
    started again, meeting beats that are late and boxes it must first connect to again."""
    rig, tracker, boxes, provision = fleet
    t0 = time.time()
    keeper = rig.keeper()
    wait_for(lambda: all((r.get("last_ok") or 0) > t0 for r in records(rig).values()), 60, "the keeper's first pass")
    time.sleep(3 * LOST_AFTER)
    before = steps(rig)
    keeper.send_signal(signal.SIGKILL)
    keeper.wait(timeout=30)
    tracker.kill()
    cut_keeper_side(boxes)
    try:
        time.sleep(10 * LOST_AFTER)
    finally:
        heal_keeper_side(boxes)
    tracker.start()
    t_back = time.time()
    rig.keeper()
    wait_for(lambda: all((r.get("last_ok") or 0) > t_back for r in records(rig).values()), 60,
             "the restarted keeper's first pass")
    time.sleep(5 * LOST_AFTER)  # its passes while the beats come back
    after = steps(rig)
    assert all(after[run] > before[run] + 5 for run in RUNS), (before, after)
    assert watching_where_they_were(rig)
    assert_untouched(rig, boxes[2], provision)
