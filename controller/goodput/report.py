"""`onboxctl report`: how much of what the runs cost became training they kept. The ledgers come from the tracker
(`GET /api/v1/goodput`, the same ones its dashboard and /metrics show), over a window; here they are grouped by run,
box, profile or pool (the inventory on this machine says each box's profile and pool) and priced (each box's price per
hour: `onboxctl box add --price`, else its profile's in prices.toml).

A group's parts are the sums of its runs' parts on its boxes, so they sum to its wall time (by box, a box's wall time
is the time runs spent on it, down time charged to the box a run went on on). Money is hours times the box's price;
hours on a box without a price are counted in `unpriced_s` and left out of the money, never guessed.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional

from controller.goodput.ledger import CATEGORIES, PRODUCTIVE
from controller.goodput.prices import price_of
from onbox.errors import UsageError
from onbox.untrusted import printable

BY = ("run", "box", "profile", "pool")
DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|h|d|w)?\s*$")
UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_since(text: str) -> float:
    """Seconds of `--since 7d` (s, m, h, d, w; a bare number is seconds); a UsageError naming the flag otherwise."""
    m = DURATION_RE.match(text) if isinstance(text, str) else None
    if not m or float(m.group(1)) * UNITS[m.group(2)] > 3660 * 86400.0:
        raise UsageError("--since %r is not a duration" % (text,),
                         hint="a number with a unit: 90m, 12h, 7d, 4w (at most ten years)")
    return float(m.group(1)) * UNITS[m.group(2)]


def _seconds(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e12 else 0.0


@dataclasses.dataclass
class Group:
    key: str
    parts: Dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    money: Dict[str, float] = dataclasses.field(default_factory=dict)
    unpriced_s: float = 0.0
    overlap_s: float = 0.0
    overlap_money: float = 0.0
    losses: int = 0
    recomputed_steps: int = 0
    runs: List[str] = dataclasses.field(default_factory=list)

    @property
    def wall(self) -> float:
        return sum(self.parts.values())

    @property
    def goodput(self) -> Optional[float]:
        return self.parts[PRODUCTIVE] / self.wall if self.wall > 0 else None

    def to_dict(self) -> Dict[str, Any]:
        cost = sum(self.money.values())
        return {"key": self.key, "wall_s": round(self.wall, 3), "goodput": None if self.goodput is None else
                round(self.goodput, 6), "parts": {k: round(v, 3) for k, v in self.parts.items()},
                "money": {"parts": {k: round(v, 4) for k, v in self.money.items()}, "total": round(cost, 4),
                          "lost": round(cost - self.money.get(PRODUCTIVE, 0.0), 4), "unpriced_s": round(
                              self.unpriced_s, 3)} if self.money or self.unpriced_s else None,
                "overlap_s": round(self.overlap_s, 3), "overlap_money": round(self.overlap_money, 4),
                "losses": self.losses, "recomputed_steps": self.recomputed_steps, "runs": sorted(set(self.runs))}


def group(runs: List[Any], by: str, boxes: Dict[str, Any], prices: Dict[str, float]) -> List[Group]:
    """The runs' ledgers grouped `by` run, box, profile or pool, priced with the inventory `boxes` (name -> Box or
    a dict with profile, pool, price) and the profiles' `prices`."""
    def fact(box: str, key: str, entry: Dict[str, Any]) -> Any:
        mine = boxes.get(box)
        if mine is not None:
            return getattr(mine, key, None) if not isinstance(mine, dict) else mine.get(key)
        said = entry.get("boxes", {}).get(box) if isinstance(entry.get("boxes"), dict) else None
        return said.get(key) if isinstance(said, dict) and key != "price" else None  # prices: this machine's only

    groups: Dict[str, Group] = {}
    for entry in runs:
        if not isinstance(entry, dict) or not isinstance(entry.get("run"), str):
            continue
        run = entry["run"]
        by_box: Dict[str, Any] = entry["by_box"] if isinstance(entry.get("by_box"), dict) else {}
        losses = [x for x in entry.get("losses") or [] if isinstance(x, dict)]
        for box, parts in by_box.items():
            if not isinstance(parts, dict):
                continue
            key = run if by == "run" else box if by == "box" else fact(box, by, entry) or "-"
            g = groups.setdefault(key, Group(key))
            g.runs.append(run)
            price = price_of(fact(box, "price", entry), fact(box, "profile", entry), prices)
            for part in CATEGORIES:
                s = _seconds(parts.get(part))
                g.parts[part] += s
                if price is None:
                    g.unpriced_s += s
                else:
                    g.money[part] = g.money.get(part, 0.0) + s / 3600.0 * price
            over = _seconds((entry.get("overlap_s") or {}).get(box) if isinstance(entry.get("overlap_s"), dict)
                            else 0)
            g.overlap_s += over
            g.overlap_money += over / 3600.0 * price if price is not None else 0.0
            mine = [x for x in losses if x.get("box") == box]
            g.losses += len(mine)
            g.recomputed_steps += sum(int(x["steps"]) for x in mine if isinstance(x.get("steps"), int))
    return sorted(groups.values(), key=lambda g: (-g.wall, g.key))


def hours(s: float) -> str:
    return "%.1fs" % s if s < 90 else "%.1fm" % (s / 60) if s < 5400 else "%.1fh" % (s / 3600)


def render(groups: List[Group], by: str, problems: List[str]) -> List[str]:
    """The text table: a line per group, a total line, then what could not be read."""
    head = (by.upper(), "WALL", "GOODPUT", *[c.upper() for c in CATEGORIES], "LOSSES", "COST", "LOST")
    total = Group("total")
    rows = [head]
    for g in groups + ([total] if len(groups) > 1 else []):
        if g is not total:
            for k in CATEGORIES:
                total.parts[k] += g.parts[k]
            for k, v in g.money.items():
                total.money[k] = total.money.get(k, 0.0) + v
            total.unpriced_s += g.unpriced_s
            total.losses += g.losses
        cost = sum(g.money.values())
        partial = "*" if g.money and g.unpriced_s else ""
        rows.append((printable(g.key)[:64], hours(g.wall), "-" if g.goodput is None else "%.1f%%" % (100 * g.goodput),
                     *[hours(g.parts[k]) for k in CATEGORIES], str(g.losses),
                     "%.2f%s" % (cost, partial) if g.money else "-",
                     "%.2f%s" % (cost - g.money.get(PRODUCTIVE, 0.0), partial) if g.money else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    if any(g.money and g.unpriced_s for g in [*groups, total]):
        lines.append("* some hours are on boxes without a price (onboxctl box add NAME --price PER_HOUR, or "
                     "prices.toml): left out of the money")
    elif not any(g.money for g in groups) and groups:
        lines.append("no prices known: `onboxctl box add NAME --host H --price 0.44 --replace`, or [profiles] in "
                     "prices.toml, shows what each part cost")
    lines += ["! %s" % printable(p)[:300] for p in problems]
    return lines


def window_label(since: Optional[float]) -> str:
    return "since the runs began" if since is None else "over the last %s" % hours(since)

