"""Which committed checkpoints to keep: the last N, the best by a named metric, every K steps, and always the
newest verified one."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set


def entry_order(e: Dict[str, Any]) -> tuple:
    step = e.get("step")
    return (step if isinstance(step, int) else -1, e.get("created") or 0.0, e.get("name", ""))


def select_keep(entries: List[Dict[str, Any]], keep_last: int, best_metric: Optional[str] = None,
                best_mode: str = "min", every_steps: Optional[int] = None) -> Set[str]:
    """Names to keep among index entries ({name, step, created, metrics, verified})."""
    ordered = sorted(entries, key=entry_order)
    keep: Set[str] = set()
    if keep_last > 0:
        keep.update(e["name"] for e in ordered[-keep_last:])
    if best_metric:
        scored = [e for e in ordered if isinstance((e.get("metrics") or {}).get(best_metric), (int, float))]
        if scored:
            pick = min if best_mode == "min" else max
            keep.add(pick(scored, key=lambda e: e["metrics"][best_metric])["name"])
    if every_steps:
        keep.update(e["name"] for e in ordered if isinstance(e.get("step"), int) and e["step"] % every_steps == 0)
    verified = [e for e in ordered if e.get("verified")]
    if verified:  # never delete the newest verified checkpoint, whatever the rules say
        keep.add(verified[-1]["name"])
        # ... nor the one committed last: when the step went back (a re-launch that trains from scratch under
        # the same name, a reset counter), "newest by step" is an old attempt's and the live run's progress
        # would be retired the moment it was committed
        last = max(range(len(verified)), key=lambda i: (verified[i].get("created") or 0.0, i))
        keep.add(verified[last]["name"])
    return keep
