"""The dashboard's columns of a stored beat (controller/tracker/store.py writes them, series.py reads them): the
box, the GPUs' mean utilisation and summed memory, the newest durable checkpoint's name, the covering index that
serves a run's curves, and the rows of the `points` table that a beat's trainer points become."""
from __future__ import annotations

import json
import math
from typing import Any, Dict, Optional, Tuple


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
    (controller/tracker/runview.py); None where no GPU reported the number."""
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


# The trainer's own points (a beat's `points` section, onbox/heartbeat/points.py): one row per beat that brought
# any, its columns kept as the JSON arrays they are served as (a page of the run's points is these texts spliced
# together: no work per point, on the way in or out). Keyed by the run and the id of the beat (beats.id, which only
# grows: the reader's cursor), so a run's points lie together in the order they arrived; stored only with a beat
# that is new, so a resent beat adds none (its (run, attempt, seq) is stored once). A column no record carried is
# NULL (served as nulls).
POINT_FIELDS = ("loss", "eval_loss", "lr", "tokens_per_s", "samples_per_s", "epoch", "steps_per_s")
POINTS_TABLE = ("CREATE TABLE IF NOT EXISTS points (run TEXT NOT NULL, bid INTEGER NOT NULL, attempt INTEGER NOT NULL, "
                "seq INTEGER NOT NULL, n INTEGER NOT NULL, time TEXT NOT NULL, step TEXT NOT NULL, %s, "
                "PRIMARY KEY (run, bid)) WITHOUT ROWID" % ", ".join("%s TEXT" % f for f in POINT_FIELDS))
POINTS_INSERT = "INSERT OR IGNORE INTO points VALUES (%s)" % ",".join("?" * (7 + len(POINT_FIELDS)))
MAX_STEP = 2 ** 63 - 1
_NUMBERS = frozenset((int, float, type(None)))


def _column(values: Any, n: int) -> Optional[str]:
    """A column as stored: a JSON array of numbers and nulls (a value that is not a finite number, such as "NaN", is
    null); None when the beat has no such column. A validated beat's columns are numbers, null or those strings,
    and strict JSON has no NaN or infinite float: a column of numbers goes through whole, at C speed."""
    if not isinstance(values, list) or len(values) != n:
        return None
    if not set(map(type, values)) <= _NUMBERS:
        values = [_num(v) for v in values]
    return json.dumps(values, separators=(",", ":"), allow_nan=False)


def point_row(beat: Dict[str, Any], bid: int) -> Optional[Tuple[Any, ...]]:
    """The row of a validated beat's points (its columns are of one length: onbox/heartbeat/schema.py), None when
    it brought none. A step out of SQLite's integer range is null."""
    pts = beat.get("points")
    if not isinstance(pts, dict) or not isinstance(pts.get("time"), list) or not pts["time"]:
        return None
    n = len(pts["time"])
    steps = pts.get("step")
    if not (isinstance(steps, list) and len(steps) == n and set(map(type, steps)) <= _NUMBERS - {float}
            and max((s for s in steps if s is not None), default=0) <= MAX_STEP):
        steps = [s if type(s) is int and 0 <= s <= MAX_STEP else None
                 for s in (steps if isinstance(steps, list) and len(steps) == n else [None] * n)]
    return (beat["run"], bid, beat["attempt"], beat["seq"], n, _column(pts["time"], n) or "[]",
            json.dumps(steps, separators=(",", ":")), *(_column(pts.get(f), n) for f in POINT_FIELDS))


def points_summary(points: Any) -> Any:
    """What a stored beat's document keeps of its points (the records themselves are in the table `points`): how
    many there were, how many the agent thinned and dropped."""
    if not isinstance(points, dict):
        return points
    times = points.get("time")
    return {"records": len(times) if isinstance(times, list) else 0, "thinned": points.get("thinned", 0),
            "dropped": points.get("dropped", 0)}
