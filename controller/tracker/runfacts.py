"""What the tracker knows of a run besides its beats, from the onboxctl config dir beside its pulls record (the
machine that launched the runs): the box inventory (each box's profile, pool and price per hour; controller/
boxes.py), the profiles' prices (prices.toml; controller/goodput/prices.py) and the launch records: the launch log
`launches.json` every `onboxctl run` appends to (command, durable target, when) and, for a run launched with
`--recover`, the keeper's `runs/<run>/launch.json` (read here with a reader of its own: only the fields shown, each
checked, nothing asked of the keeper's code).

Each file is read again only when it changed (mtime and size), at most CONFIG_MAX_BYTES and 64 levels deep like every
file onbox reads; one that cannot be read leaves its facts unknown (`problems` says which and why, logged once per
change), never fails a page, a scrape or a report. A run started without onboxctl (sbatch, a Kaggle session) has no
launch record here: its command and durable target are unknown.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import untrusted
from onbox.paths import valid_run_name

log = logging.getLogger("onbox.tracker")

MAX_COMMAND_WORDS = 200
MAX_WORD = 1000


def _stamp(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _words(v: Any) -> Optional[List[str]]:
    if not isinstance(v, list) or not v or not all(isinstance(w, str) for w in v):
        return None
    return [untrusted.printable(w)[:MAX_WORD] for w in v[:MAX_COMMAND_WORDS]]


def _text(v: Any, limit: int = 4096) -> Optional[str]:
    return untrusted.printable(v)[:limit] if isinstance(v, str) and v else None


def _time(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e11 else None


class _Cached:
    """One file read through `parse` when it changed; `value` is `empty` (and `problem` says why) when it cannot be."""

    def __init__(self, path: str, parse: Callable[[str], Any], empty: Any) -> None:
        self.path, self.parse, self.empty = path, parse, empty
        self.value: Any = empty
        self.problem: Optional[str] = None
        self._stamp: Optional[Tuple[int, int]] = None
        self._read = False

    def get(self) -> Any:
        stamp = _stamp(self.path)
        if self._read and stamp == self._stamp:
            return self.value
        self._read, self._stamp = True, stamp
        if stamp is None:
            self.value, self.problem = self.empty, None
            return self.value
        try:
            self.value, self.problem = self.parse(self.path), None
        except Exception as e:  # any unreadable file: its facts are unknown, the tracker goes on
            self.value = self.empty
            self.problem = "%s: %s" % (self.path, untrusted.reason(e) if isinstance(e, (OSError, ValueError))
                                       else getattr(e, "message", str(e)))
            log.warning("onbox tracker: %s (its facts are shown as unknown)", self.problem)
        return self.value


def _inventory(path: str) -> Dict[str, Dict[str, Any]]:
    from controller.boxes.inventory import Inventory

    boxes = Inventory(os.path.dirname(path)).load()
    return {n: {"profile": b.profile, "pool": b.pool, "price": b.price} for n, b in boxes.items()}


def _launches(path: str) -> Dict[str, Dict[str, Any]]:
    """The newest launch of each run in launches.json."""
    doc = untrusted.read_json(path, untrusted.CONFIG_MAX_BYTES, "launch log")
    entries = doc.get("launches") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError('not {"launches": [...]}')
    out: Dict[str, Dict[str, Any]] = {}
    for e in entries:
        if isinstance(e, dict) and isinstance(e.get("run"), str) and valid_run_name(e["run"]):
            cmd = _words(e.get("command"))
            first = out.get(e["run"], {}).get("first_at")
            at = _time(e.get("at"))
            out[e["run"]] = {"command": cmd, "durable": _text(e.get("durable")), "box": _text(e.get("box"), 256),
                             "at": at, "first_at": first if first is not None else at, "source": "launches.json"}
    return out


def _keeper_launch(path: str) -> Dict[str, Any]:
    doc = untrusted.read_json(path, untrusted.CONFIG_MAX_BYTES, "launch record")
    if not isinstance(doc, dict):
        raise ValueError("not a launch record")
    policy: Dict[str, Any] = doc["policy"] if isinstance(doc.get("policy"), dict) else {}
    boxes = doc.get("boxes")
    return {"command": _words(doc.get("command")), "durable": _text(doc.get("durable")),
            "at": _time(doc.get("created")), "pool": _text(policy.get("pool"), 64),
            "box": _text(boxes[0], 256) if isinstance(boxes, list) and boxes else None,
            "heartbeat_interval": _time(doc.get("heartbeat_interval")), "source": "runs/<run>/launch.json"}


class RunFacts:
    """The facts of the config dir `directory` (None: none known)."""

    def __init__(self, directory: Optional[str]) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._files: Dict[str, _Cached] = {}

    def _file(self, name: str, parse: Callable[[str], Any], empty: Any) -> Any:
        if not self.directory:
            return empty
        with self._lock:
            cached = self._files.get(name)
            if cached is None:
                cached = self._files[name] = _Cached(os.path.join(self.directory, name), parse, empty)
            return cached.get()

    def boxes(self) -> Dict[str, Dict[str, Any]]:
        """box -> {profile, pool, price} from the inventory (boxes.toml, else boxes.json)."""
        if self.directory and os.path.lexists(os.path.join(self.directory, "boxes.json")) and not os.path.lexists(
                os.path.join(self.directory, "boxes.toml")):
            return self._file("boxes.json", _inventory, {})
        return self._file("boxes.toml", _inventory, {})

    def prices(self) -> Dict[str, float]:
        from controller.goodput.prices import FILE, load_prices

        return self._file(FILE, lambda p: load_prices(os.path.dirname(p)), {})

    def price(self, box: Optional[str]) -> Optional[float]:
        """What an hour of `box` costs (its own price, else its profile's), None when unknown."""
        from controller.goodput.prices import price_of

        entry = self.boxes().get(box or "", {})
        return price_of(entry.get("price"), entry.get("profile"), self.prices())

    def launch(self, run: str) -> Optional[Dict[str, Any]]:
        """How `run` was launched: {command, durable, box, at, source, ...}, None when this machine did not."""
        if not valid_run_name(run):
            return None
        found = self._file("launches.json", _launches, {}).get(run)
        keeper = self._file(os.path.join("runs", run, "launch.json"), _keeper_launch, None)
        if keeper is not None and (found is None or (keeper.get("at") or 0) >= (found.get("at") or 0)):
            return dict(keeper, first_at=(found or {}).get("first_at") or keeper.get("at"))
        return found

    def problems(self) -> List[str]:
        with self._lock:
            return sorted(c.problem for c in self._files.values() if c.problem)
