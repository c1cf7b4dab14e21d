"""Who owns a GPU holder: this agent's runs, by the session ids the supervisor records for every attempt.

Owners (from each run's state.json `attempts: [{n, pid, sid, pgid, start_time, ...}]` under $ONBOX_HOME/runs):
  self     this process or one of its ancestors: never touched
  current  the newest attempt of a run that is still live (its leader process lives): never touched
  earlier  an earlier attempt of a run this agent supervises: our own orphans, e.g. DataLoader workers forked
           after CUDA init whose parent was SIGKILLed (they keep the session id)
  foreign  anything else
A session id can be recycled: a holder that started before the attempt it would belong to is not its.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from onbox.telemetry.holders import Holder, ScanResult

# Run states after which no attempt of the run is live (the supervisor's RunState values, lower-cased).
TERMINAL_STATES = frozenset({"succeeded", "failed", "stopped", "done", "finished", "crashed", "exited",
                             "preempted", "cancelled"})
START_SLACK_S = 5.0  # a holder started before its session's attempt (minus this) is a recycled session id


@dataclasses.dataclass
class Attempt:
    run: str
    n: int
    sid: Optional[int]
    pgid: Optional[int]
    pid: Optional[int]
    start_time: Optional[float]  # epoch seconds, when the state file records a number
    current: bool


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class AttemptIndex:
    """Every attempt of every run under $ONBOX_HOME/runs, by session id."""

    def __init__(self, attempts: Iterable[Attempt]) -> None:
        self.by_sid: Dict[int, List[Attempt]] = {}
        for a in attempts:
            if a.sid is not None:
                self.by_sid.setdefault(a.sid, []).append(a)

    @classmethod
    def load(cls, runs_dir: str) -> "AttemptIndex":
        out: List[Attempt] = []
        for path in sorted(glob.glob(os.path.join(runs_dir, "*", "state.json"))):
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue  # a torn or foreign file: its holders stay "foreign" (never auto-reaped)
            if not isinstance(doc, dict):
                continue
            out.extend(attempts_of(doc, os.path.basename(os.path.dirname(path))))
        return cls(out)

    def owner_of(self, h: Holder) -> Optional[Attempt]:
        """The attempt whose session the holder is in, unless it started before that attempt (sid reuse)."""
        for a in self.by_sid.get(h.sid, []):
            if a.start_time is not None and h.start_time < a.start_time - START_SLACK_S:
                continue
            return a
        return None


def _pid_alive(pid: Optional[int]) -> bool:
    """Conservative: unknown or unreadable counts as alive (a live attempt is never reaped)."""
    if pid is None:
        return True
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            st = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return st[st.rfind(")") + 2:st.rfind(")") + 3] not in ("Z", "X")


def attempts_of(state: Dict[str, Any], run: str, pid_alive: Callable[[Optional[int]], bool] = _pid_alive
                ) -> List[Attempt]:
    """Attempts recorded in one state.json. The newest is current while the run is not in a terminal state and
    the attempt's leader process lives; once its leader died (restart pending), what it left is an orphan."""
    raw = [a for a in state.get("attempts") or [] if isinstance(a, dict)]
    live = str(state.get("state", "")).lower() not in TERMINAL_STATES
    out = []
    for i, a in enumerate(raw):
        sid = a.get("sid")
        out.append(Attempt(
            run=str(state.get("run") or run), n=int(a.get("n", i)),
            sid=int(sid) if isinstance(sid, int) else None,
            pgid=a.get("pgid") if isinstance(a.get("pgid"), int) else None,
            pid=a.get("pid") if isinstance(a.get("pid"), int) else None,
            start_time=_num(a.get("start_time")),
            current=live and i == len(raw) - 1 and pid_alive(a.get("pid") if isinstance(a.get("pid"), int) else None),
        ))
    return out


def ancestors(pid: int, proc: str = "/proc") -> List[int]:
    """pid and its parents up to init: a holder among them is the caller itself (never reaped)."""
    out: List[int] = []
    while pid > 0 and pid not in out and len(out) < 512:
        out.append(pid)
        try:
            with open("%s/%d/stat" % (proc, pid), "rb") as f:
                st = f.read().decode("utf-8", "replace")
        except OSError:
            break
        pid = int(st[st.rfind(")") + 2:].split()[1])
    return out


def classify(scan: ScanResult, index: AttemptIndex, my_pid: Optional[int] = None,
             extra_earlier_sids: Sequence[int] = (), proc: str = "/proc") -> None:
    """Set each holder's owner/run/attempt. `extra_earlier_sids`: sessions the caller knows to be dead attempts."""
    me = set(ancestors(os.getpid() if my_pid is None else my_pid, proc))
    for h in scan.holders:
        a = index.owner_of(h)
        if h.pid in me and not h.other_pid_ns:
            h.owner = "self"
        elif h.sid in extra_earlier_sids:  # the supervisor says so: that attempt is over
            h.owner = "earlier"
            if a is not None:
                h.run, h.attempt = a.run, a.n
        elif a is not None:
            h.owner, h.run, h.attempt = ("current" if a.current else "earlier"), a.run, a.n
        else:
            h.owner = "foreign"
