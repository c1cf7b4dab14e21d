"""Who owns a GPU holder: this agent's runs, by the session ids the supervisor records for every attempt.

Owners (from each run's state.json `attempts: [{n, pid, sid, pgid, start_time, ...}]` under $ONBOX_HOME/runs):
  self     this process or one of its ancestors: never touched
  current  the attempt a live run's state names (`current_sid`), while its leader process lives: never touched
  earlier  an earlier attempt of a run this agent supervises: our own orphans, e.g. DataLoader workers forked
           after CUDA init whose parent was SIGKILLed (they keep the session id)
  foreign  anything else
A holder belongs to an attempt by its container (a container job's attempt records the container's id in
`<run dir>/containers/<n>.cid`), else by its session id (orphaned workers keep it), or, failing that, by the
ONBOX_RUN and ONBOX_RESTART_COUNT its environment inherited. A session id can be recycled: a holder that started before the
attempt's leader is not its.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from onbox import fsutil, paths, untrusted, vocab
from onbox.gpu.holders import Holder, ScanResult
from onbox.proc import environ_of, is_alive, read_stat
from onbox.untrusted import CONFIG_MAX_BYTES

# Run states after which no attempt of the run is live (supervisor.RunState's terminal values).
TERMINAL_STATES = frozenset(vocab.TERMINAL_STATES)
START_SLACK_S = 5.0  # wall-clock slack for the recycled-session guard when only `started_at` is known


@dataclasses.dataclass
class Attempt:
    run: str
    n: int
    sid: Optional[int]
    pgid: Optional[int]
    pid: Optional[int]
    start_ticks: Optional[int]  # the leader's /proc start time in clock ticks (supervisor's `start_time`)
    started_at: Optional[float]  # wall clock (supervisor's `started_at`)
    current: bool
    ended_at: Optional[float] = None  # wall clock (supervisor's `ended_at`): its session was emptied then
    container: Optional[str] = None  # the container it ran in (`<run dir>/containers/<n>.cid`, container jobs)


def _int(v: Any) -> Optional[int]:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class AttemptIndex:
    """Every attempt of every run under $ONBOX_HOME/runs, by session id and by (run, attempt number)."""

    def __init__(self, attempts: Iterable[Attempt]) -> None:
        self.by_sid: Dict[int, List[Attempt]] = {}
        self.by_run: Dict[Tuple[str, int], Attempt] = {}
        self.by_container: Dict[str, Attempt] = {}
        for a in attempts:
            if a.sid is not None:
                self.by_sid.setdefault(a.sid, []).append(a)
            self.by_run[(a.run, a.n)] = a
            if a.container:
                self.by_container[a.container] = a

    @classmethod
    def load(cls, runs_dir: str) -> "AttemptIndex":
        out: List[Attempt] = []
        for path in sorted(glob.glob(os.path.join(runs_dir, "*", paths.STATE_FILE))):
            try:  # bounded, regular files only: a run dir's state.json is nobody's to make /dev/zero or a FIFO
                doc = fsutil.read_json(path, CONFIG_MAX_BYTES, "state file")
            except (OSError, ValueError):
                continue  # a torn or foreign file: its holders stay "foreign" (never auto-reaped)
            if not isinstance(doc, dict):
                continue
            found = attempts_of(doc, os.path.basename(os.path.dirname(path)))
            containers = container_ids(os.path.dirname(path))
            for a in found:
                a.container = containers.get(a.n)
            out.extend(found)
        return cls(out)

    def owner_of(self, h: Holder) -> Optional[Attempt]:
        """The attempt whose session the holder is in. A session's members start after its leader, so a holder
        that started before the attempt's leader is in a recycled session id, not ours. When a session id was
        recycled (the kernel reuses a pid once its session emptied), the holder belongs to the NEWEST session of
        that id that began before it: another run's live attempt may now lead session S that an old attempt of
        ours once had."""
        if h.container and h.container in self.by_container:  # a container's processes are its attempt's
            return self.by_container[h.container]
        best: Optional[Attempt] = None
        for a in self.by_sid.get(h.sid, []):
            if a.start_ticks is not None and h.start_ticks < a.start_ticks:
                continue
            if a.start_ticks is None and a.started_at is not None and h.start_time < a.started_at - START_SLACK_S:
                continue
            if a.ended_at is not None and h.start_time > a.ended_at + START_SLACK_S:
                continue  # started after the attempt ended (and its session was cleared): a recycled session id
            if best is None or _started_later(a, best):
                best = a
        return best


def container_ids(run_dir: str) -> Dict[int, str]:
    """attempt number -> container id, from the cidfiles docker wrote for a container job's attempts."""
    out: Dict[int, str] = {}
    for path in glob.glob(os.path.join(run_dir, paths.CONTAINERS_DIR, "*.cid")):
        stem = os.path.basename(path)[:-len(".cid")]
        try:  # bounded, regular files only: a FIFO named *.cid must not hang the holder scan
            cid = untrusted.read_text(path, 4096, "cidfile").strip()
        except (OSError, ValueError):
            continue
        if stem.isdigit() and len(cid) == 64 and all(c in "0123456789abcdef" for c in cid):
            out[int(stem)] = cid
    return out


def _started_later(a: Attempt, b: Attempt) -> bool:
    """Whether attempt a's session began after b's (ticks when both are known, else wall clock; a current
    attempt wins a tie it cannot break, so a live one is never mistaken for an old one)."""
    if a.start_ticks is not None and b.start_ticks is not None and a.start_ticks != b.start_ticks:
        return a.start_ticks > b.start_ticks
    if a.started_at is not None and b.started_at is not None and a.started_at != b.started_at:
        return a.started_at > b.started_at
    return a.current and not b.current


def _leader_alive(pid: Optional[int], start_ticks: Optional[int]) -> bool:
    """Conservative: an unknown leader counts as alive (a live attempt is never reaped)."""
    return pid is None or is_alive(pid, start_ticks)


def attempts_of(state: Dict[str, Any], run: str,
                leader_alive: Callable[[Optional[int], Optional[int]], bool] = _leader_alive) -> List[Attempt]:
    """Attempts recorded in one state.json (supervisor: `attempts`, `current_sid`, `state`). An attempt is current
    while the run is not in a terminal state, it is the newest (or the one `current_sid` names) and its leader
    process lives; once its leader died (restart pending), what it left behind is an orphan."""
    raw = [a for a in state.get("attempts") or [] if isinstance(a, dict)]
    live = str(state.get("state", "")).lower() not in TERMINAL_STATES
    named = _int(state.get("current_sid"))
    out = []
    for i, a in enumerate(raw):
        sid, pid, ticks, n = _int(a.get("sid")), _int(a.get("pid")), _int(a.get("start_time")), _int(a.get("n"))
        # the supervisor names the running attempt's session (None between attempts); older files do not
        newest = (named is not None and sid == named) if "current_sid" in state else (i == len(raw) - 1)
        out.append(Attempt(
            run=str(state.get("run") or run), n=i if n is None else n,
            sid=sid, pgid=_int(a.get("pgid")), pid=pid, start_ticks=ticks, started_at=_num(a.get("started_at")),
            current=live and newest and leader_alive(pid, ticks), ended_at=_num(a.get("ended_at")),
        ))
    return out


def ancestors(pid: int, proc: str = "/proc") -> List[int]:
    """pid and its parents up to init: a holder among them is the caller itself (never reaped)."""
    out: List[int] = []
    while pid > 0 and pid not in out and len(out) < 512:
        out.append(pid)
        st = read_stat(pid, proc)
        if st is None:
            break
        pid = st.ppid
    return out


def run_marker(pid: int, proc: str = "/proc") -> Optional[Tuple[str, int]]:
    """(ONBOX_RUN, ONBOX_RESTART_COUNT) from a process's environment: every descendant of an attempt inherits
    them (the child's environment contract), also one that left the attempt's session with setsid. None when absent or
    unreadable (another user's process)."""
    env = environ_of(pid, proc)
    run = env.get("ONBOX_RUN")
    try:
        count = int(env["ONBOX_RESTART_COUNT"]) if "ONBOX_RESTART_COUNT" in env else None
    except ValueError:
        return None
    return (run, count) if run and count is not None else None


def classify(scan: ScanResult, index: AttemptIndex, my_pid: Optional[int] = None,
             extra_earlier_sids: Sequence[int] = (), proc: str = "/proc") -> None:
    """Set each holder's owner/run/attempt: by session id first, then by the run marker in its environment.
    `extra_earlier_sids`: sessions the caller (the supervisor) knows to be finished attempts."""
    me = set(ancestors(os.getpid() if my_pid is None else my_pid, proc))
    for h in scan.holders:
        a = index.owner_of(h)
        if a is None:
            marker = run_marker(h.pid, proc)
            a = index.by_run.get(marker) if marker else None
        if h.pid in me and not h.other_pid_ns:
            h.owner = "self"
        elif a is not None and a.current:  # a live attempt (of any run) is never an orphan, whatever the caller says
            h.owner, h.run, h.attempt = "current", a.run, a.n
        elif h.sid in extra_earlier_sids and (a is not None or not index.by_sid.get(h.sid)):
            # the supervisor says so: that attempt is over (unless the index knows that session id and the
            # holder is not of it: the id was recycled)
            h.owner = "earlier"
            if a is not None:
                h.run, h.attempt = a.run, a.n
        elif a is not None:
            h.owner, h.run, h.attempt = ("current" if a.current else "earlier"), a.run, a.n
        else:
            h.owner = "foreign"
