"""The dashboard's columns of a stored beat (controller/tracker/store.py writes them, series.py reads them): the
box, the GPUs' mean utilisation and summed memory, the newest durable checkpoint's name, and the covering index
that serves a run's curves."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


# added after the first release: an older database gets them (ALTER TABLE ADD COLUMN only touches the schema)
ADDED_BEATS_COLUMNS = (("box", "TEXT"), ("gpu_util", "REAL"), ("gpu_mem", "REAL"), ("ckpt", "TEXT"))
# The dashboard's curves as a covering index: a run's points in seq order, read from the index alone. Without it
# the 10,000 rows of one run sit on 10,000 different pages of the table (interleaved with every other run's beats
# and their documents): opening a run page read ~40 MB at random (150-300 ms warm, over a second cold). It costs
# ~25 us of CPU per stored beat (35 -> 60 us in Store.add_many) and ~8 % of the database's size.
POINTS_INDEX = ("CREATE INDEX IF NOT EXISTS beats_points ON beats (run, seq, attempt, time, step, loss, eval_loss, lr, "
                "tokens_per_s, gpu_util, gpu_mem, state, box, ckpt)")


def gpu_numbers(gpus: Any) -> Tuple[Optional[float], Optional[float]]:
    """(mean utilisation %, memory used in bytes summed) over a beat's GPUs, as `onboxctl status` shows them
    (controller/runview.py); None where no GPU reported the number."""
    items = gpus.get("gpus") if isinstance(gpus, dict) else None
    if not isinstance(items, list):
        return None, None
    utils = [u for u in (_num(g.get("util_percent")) for g in items if isinstance(g, dict)) if u is not None]
    mems = [m for m in (_num(g.get("memory_used_bytes")) for g in items if isinstance(g, dict)) if m is not None]
    return (sum(utils) / len(utils) if utils else None), (sum(mems) if mems else None)


def durable_name(checkpoint: Any) -> Optional[str]:
    """The name of the newest durable checkpoint a beat reports (a {name, step, ...} record or a path)."""
    latest = checkpoint.get("latest_durable") if isinstance(checkpoint, dict) else None
    if isinstance(latest, dict):
        latest = latest.get("name") or latest.get("path")
    return str(latest)[:256] if isinstance(latest, (str, int)) and not isinstance(latest, bool) else None
