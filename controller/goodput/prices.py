"""What an hour of a box costs: the box's own `price` in the inventory (`onboxctl box add NAME --price 0.44`), else
its profile's in `$ONBOX_CONFIG_DIR/prices.toml`:

    # price per hour of a box of each profile, in your currency; a box's own --price wins
    [profiles]
    runpod = 0.44
    vastai = 0.31

Unknown (None) when neither says: the ledger's hours are shown without money. A price is a number >= 0 and below
MAX_PRICE; anything else in the file is one line naming the file and the key, exit 2.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Optional

from onbox.errors import UsageError

FILE = "prices.toml"
MAX_PRICE = 1e6  # per hour: past it a typo (a price per month, a missing decimal point)


def price_problem(v: Any) -> Optional[str]:
    """Why `v` is no price per hour (None: it is one)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "a price per hour is a number, not %r" % (v,)
    if not math.isfinite(float(v)) or not 0 <= v < MAX_PRICE:
        return "a price per hour is a number from 0 to %g, not %r" % (MAX_PRICE, v)
    return None


def load_prices(directory: str) -> Dict[str, float]:
    """The profiles' prices from `directory`/prices.toml ({} when there is no such file)."""
    path = os.path.join(directory, FILE)
    if not os.path.lexists(path):
        return {}
    from onbox.tomlread import load_toml

    doc = load_toml(path, "price list")
    unknown = sorted(set(doc) - {"profiles"})
    table = doc.get("profiles", {})
    if unknown or not isinstance(table, dict):
        raise UsageError("price list %s: expected one table [profiles] of NAME = price per hour%s" % (
            path, " (unknown: %s)" % ", ".join(unknown) if unknown else ""), hint="e.g. [profiles]\\nrunpod = 0.44")
    out = {}
    for name, v in table.items():
        why = price_problem(v)
        if why:
            raise UsageError("price list %s: profile %s: %s" % (path, name, why), hint="e.g. runpod = 0.44")
        out[str(name)] = float(v)
    return out


def price_of(box_price: Optional[float], profile: Optional[str], profiles: Dict[str, float]) -> Optional[float]:
    """The box's own price, else its profile's, else None."""
    if box_price is not None:
        return box_price
    return profiles.get(profile) if profile else None
