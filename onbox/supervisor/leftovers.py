"""What an attempt leaves running, found three ways and remembered by pid AND start time.

An attempt's child leads its own session, and the loop stops that session when the attempt ends. What left the
session is not found that way: `setsid cmd &`, a daemon's double fork, a `nohup ... &` under a new session. Those
are still the attempt's, and a user expects them gone when the run is (U16: a stale background process outlives
what it served). So the supervisor also

- polls the process tree under the child at every tick while the attempt runs, and remembers each descendant by
  pid and start time (a forked-and-detached process is seen while its parent still lives);
- sets a per-attempt marker in the child's environment (`ONBOX_ATTEMPT_ID`), which every descendant inherits
  unless it scrubs its environment: at the end, every process carrying it is the attempt's, wherever it went
  (reparented to init or to the agent, another session). It is recorded in state.json, so an agent that adopts
  the child later, or relaunches the run, finds them too.

A cgroup per attempt would see everything, but rented boxes and containers rarely delegate one (cgroup v2 with
a writable subtree, the no-internal-processes rule): the tree and the marker work everywhere /proc does.

The stop itself is the seam's one escalation (ProcessSeam.kill_session: TERM, a bounded wait, KILL), and every
signal is checked against the start time first, so a pid recycled since it was seen is never signalled.
"""
from __future__ import annotations

import secrets
from typing import Any, Callable, Dict, List, Optional

from onbox.proc import ProcRef, Stopped, boot_id

MARKER_VAR = "ONBOX_ATTEMPT_ID"
PRUNE_AT = 2000  # remembered processes past which the dead ones are forgotten


def new_marker(run: str, attempt: int) -> str:
    """A marker no other attempt (of this run or another, on this box or a previous life of it) carries."""
    return "%s/%d/%s" % (run, attempt, secrets.token_hex(6))


class AttemptProcesses:
    """Every process one attempt started, as far as the tree polls and the marker tell."""

    def __init__(self, seam: Any, root: Optional[ProcRef], marker: Optional[str]) -> None:
        self.seam = seam
        self.root = root  # the attempt's child; None when its start time is unknown (then the tree is not polled)
        self.marker = marker
        self.seen: Dict[ProcRef, None] = {}  # insertion-ordered: the order they were first seen

    @classmethod
    def of_attempt(cls, seam: Any, attempt: Dict[str, Any]) -> "AttemptProcesses":
        """From an attempt's record in state.json (an earlier agent's attempt: only the marker is known then)."""
        pid, start = attempt.get("pid"), attempt.get("start_time")
        root = ProcRef(int(pid), int(start)) if isinstance(pid, int) and isinstance(start, int) else None
        marker = attempt.get("marker")
        return cls(seam, root, marker if isinstance(marker, str) and marker else None)

    def poll(self) -> None:
        """Remember the child's descendants as they are now (cheap: /proc/<pid>/task/*/children)."""
        if self.root is None:
            return
        for found in self.seam.descendants(self.root):
            self.seen.setdefault(found.ref, None)
        if len(self.seen) > PRUNE_AT:  # a long attempt forks many short-lived helpers: only live ones matter
            self.seen = {r: None for r in self.seen if self.seam.start_time_of(r.pid) == r.start_time}

    def discover(self) -> List[ProcRef]:
        """At the attempt's end: one more poll, then every process carrying the marker. Reads each process's
        environment once; call it once per stop, then leftovers() while waiting."""
        self.poll()
        if self.marker:
            for found in self.seam.marked(MARKER_VAR, self.marker):
                self._remember(found.ref)
        return self.leftovers()

    def leftovers(self) -> List[ProcRef]:
        """What is remembered and still alive (same pid, same start time), with everything under it now."""
        out: List[ProcRef] = []
        for ref in list(self.seen):
            if self.seam.start_time_of(ref.pid) != ref.start_time:
                continue
            if ref not in out:
                out.append(ref)
            for found in self.seam.descendants(ref):
                self._remember(found.ref)
                if found.ref not in out:
                    out.append(found.ref)
        return out

    def _remember(self, ref: ProcRef) -> None:
        # A process that started before the attempt's child cannot descend from it, whatever it inherited.
        if self.root is None or ref.start_time >= self.root.start_time:
            self.seen.setdefault(ref, None)


def stop_attempt(seam: Any, attempt: Dict[str, Any], tracked: AttemptProcesses, timeout: float,
                 log: Callable[[str], None], emit: Callable[..., None]) -> None:
    """Stop what an attempt left running: every process of its session and what left it (`tracked`), in one
    escalation. Each step is an event (`attempt_leftovers_signal` {signal, pids, commands}); the outcome is
    `attempt_leftovers_stopped` {sid, pids, commands, killed, survived}.

    A session id is a pid, recycled once the session emptied: after a reboot (another boot id) nothing of the
    attempt survives, and a relaunch days later must not TERM whoever leads session <sid> now (the leader's start
    time tells, see ProcessSeam.kill_session)."""
    sid = attempt.get("sid")
    if not sid or attempt.get("boot_id") not in (None, boot_id()):
        return
    tracked.discover()

    def step(name: str, refs: List[ProcRef], report: Stopped) -> None:
        if name in ("SIGTERM", "SIGKILL"):
            emit("attempt_leftovers_signal", signal=name, pids=[r.pid for r in refs],
                 commands=[report.commands.get(r, "") for r in refs])

    stopped = seam.kill_session(sid, timeout, log=log, leader_start=attempt.get("start_time"),
                                also=tracked.leftovers, on_step=step)
    if stopped.found:
        emit("attempt_leftovers_stopped", sid=sid, pids=stopped.pids,
             commands=[stopped.commands.get(r, "") for r in stopped.found],
             killed=[r.pid for r in stopped.killed], survived=[r.pid for r in stopped.survived])
