"""Goodput timelines for tests: a run's beats as the ledger reads them (controller/goodput/records.Beat), taken from a
real tracker after a real scenario, saved as a fixture (tests/fixtures/goodput/<scenario>.json) with the ground truth
the trainer's trace gives (every step it trained, and when), and the checks every ledger must pass:

- the parts sum to the wall time, and the segments tile [start, end] (no gap, no overlap);
- each step of the lineage is counted once: kept_steps is the run's distinct steps that survive, recomputed_steps the
  trainings of a step beyond its last one (plus, for a run that failed for good, the steps past its final durable
  checkpoint).

`GOODPUT_CAPTURE=1 pytest tests/integration/test_goodput_scenarios.py` writes the fixtures again from new runs;
tests/unit/test_goodput_scenarios.py replays them.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

from controller.goodput.records import Beat, beat_from_doc

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "goodput")


def tracker_timeline(tracker: Any, run: str) -> List[Beat]:
    """The run's beats from a TrackerProcess (tests/hosts/tracker.py), each with the first record of the trainer's
    points it brought (as the tracker's own fold reads it)."""
    import requests

    docs = tracker.all_heartbeats(run)
    firsts: Dict[int, Any] = {}
    after = -1
    for _ in range(1000):
        r = requests.get(tracker.url + "/api/v1/runs/%s/series" % run, headers=tracker.headers(), timeout=30,
                         params={"after": -1, "limit": 1, "points_after": after, "points_limit": 200000})
        r.raise_for_status()
        t = r.json()["trainer"]
        for seq, at, step in zip(t["points"]["seq"], t["points"]["time"], t["points"]["step"]):
            if seq not in firsts:
                firsts[seq] = (at, step) if at is not None and step is not None else None
        after = t["next_after"]
        if not t["more"]:
            break
    out = []
    for d in docs:
        b = beat_from_doc(d)
        if b is not None:
            out.append(dataclasses.replace(b, first_point=firsts.get(b.seq)))
    return out


def trace_truth(path: str, final_durable: Optional[int] = None) -> Dict[str, Any]:
    """What a goodput_trainer trace (or a list of steps) says: steps trained, distinct, the trainings beyond each
    step's last (recomputed), and what survives (kept: every distinct step, or up to `final_durable` when the run
    failed for good)."""
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return steps_truth([x["step"] for x in lines if "step" in x], final_durable,
                       starts=[x["start"] for x in lines if "start" in x])


def steps_truth(steps: List[int], final_durable: Optional[int] = None, starts: Optional[List[int]] = None
                ) -> Dict[str, Any]:
    counts = collections.Counter(steps)
    distinct = sorted(counts)
    kept = [s for s in distinct if final_durable is None or s <= final_durable]
    return {"trained": len(steps), "distinct": len(distinct), "kept_steps": len(kept),
            "recomputed_steps": len(steps) - len(kept), "starts": starts or [], "last_step": distinct[-1] if distinct
            else None}


def check_ledger(doc: Dict[str, Any]) -> None:
    """The invariants of a ledger's to_dict(segments=True) (the tracker's answer, or one computed here)."""
    parts = doc["parts"]
    wall = doc["wall_s"]
    assert abs(sum(parts.values()) - wall) <= 0.005 + 1e-9 * wall, (parts, wall)  # each part rounded to 1 ms
    segs = doc["segments"]
    assert segs, doc
    assert abs(segs[0][0] - doc["start"]) < 1e-3 and abs(segs[-1][1] - doc["end"]) < 1e-3, (segs[:1], segs[-1:], doc)
    for (a0, a1, _, _), (b0, b1, _, _) in zip(segs, segs[1:]):
        assert a1 >= a0 and abs(a1 - b0) < 1e-3, (a0, a1, b0, b1)  # tiled: no gap, no overlap
    by_part: Dict[str, float] = collections.defaultdict(float)
    for s0, s1, part, _box in segs:
        by_part[part] += s1 - s0
    for part, seconds in parts.items():
        assert abs(by_part[part] - seconds) < 1e-2, (part, by_part[part], seconds)
    by_box = doc["by_box"]
    for part in parts:
        assert abs(sum(p[part] for p in by_box.values()) - parts[part]) < 1e-2, part


def save_fixture(name: str, run: str, beats: List[Beat], now: Optional[float], truth: Dict[str, Any],
                 expect: Dict[str, Any]) -> None:
    """tests/fixtures/goodput/<name>.json, only when GOODPUT_CAPTURE is set (a scenario run to refresh them)."""
    if not os.environ.get("GOODPUT_CAPTURE"):
        return
    os.makedirs(FIXTURES, exist_ok=True)
    with open(os.path.join(FIXTURES, name + ".json"), "w") as f:
        json.dump({"scenario": name, "run": run, "now": now, "truth": truth, "expect": expect,
                   "beats": [dataclasses.asdict(b) for b in beats]}, f, indent=None, separators=(",", ":"))
        f.write("\n")


def load_fixture(name: str) -> Dict[str, Any]:
    with open(os.path.join(FIXTURES, name + ".json")) as f:
        doc = json.load(f)
    doc["beats"] = [Beat(**dict(b, first_point=tuple(b["first_point"]) if b.get("first_point") else None))
                    for b in doc["beats"]]
    return doc


def fixtures() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(FIXTURES) if f.endswith(".json")) if os.path.isdir(FIXTURES) else []
