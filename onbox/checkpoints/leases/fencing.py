"""Fencing: the lease this agent holds on its run's durable storage, taken once per agent launch, renewed from a
thread of its own, and checked before every write that changes what readers see (leases.py has the rules).

- `RunLease.take` (before the first restore): the newest lease, if live and another agent's, refuses the launch
  (LeaseRefused, exit 2) unless `take_over`; the checkpoints are listed, then the lease of epoch newest + 1 is
  written and the leases listed again (a launch that lost the tie stands back: LeaseRefused too).
- `RunLease.check(what)`, the guard: lists the leases; one that holds the run over ours fences this agent for good
  (the `fenced` event, once; Fenced raised to the writer). A listing that fails fails the write (fail closed).
- The thread (`start`): every `check_every` seconds a check, every ttl / 3 a renewal (itself checked first).
- `close(release)`: the thread stops; a run that ended for good (not fenced) marks its lease released, so the
  next launch elsewhere need not wait out the ttl.
- `PassiveLease`: for a committer that is not the agent (`onbox sync`, the stop of an agentless run, tests): it
  holds the lease the box's agent recorded in checkpoint_status.json, never renews it, and fences the same way;
  with no lease recorded it may write only while the run has no leases at all (an agent without leases).

Tests hold a commit between its lease check and its manifest write at hashcopy.fault_point (hashcopy.fault_hook).

Past 400 lines on purpose: the agent's RunLease and the PassiveLease of every other committer fence by the same
check, kept in one module so that there is one fencing rule.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox import untrusted, vocab
from onbox.checkpoints import SyncFailed
from onbox.checkpoints.durable import LEASES_DIR, DurableTarget, hashcopy
from onbox.checkpoints.leases import (
    ENDED_STATES,
    MAX_EPOCH,
    BadLease,
    Committed,
    LeaseFile,
    Lineage,
    base_for,
    beats,
    blocks,
    box_id,
    box_of,
    committed_of,
    document,
    fencing_lease,
    holder_of_run,
    is_live,
    lease_name,
    new_holder,
    parse,
    renewed_ago,
    ttl_of,
)
from onbox.errors import UsageError
from onbox.untrusted import UntrustedInput

Emit = Callable[..., None]


class LeaseRefused(UsageError):
    """This launch may not take the run (exit 2): another agent holds it, its lease cannot be read, or another
    launch won the same epoch."""


class Fenced(SyncFailed):
    """A newer lease holds the run: this agent writes nothing more to durable storage. `info`: the fenced event."""

    def __init__(self, info: Dict[str, Any]) -> None:
        super().__init__("fenced: %s (lease epoch %s) holds run %s now; this agent (epoch %s) writes nothing more "
                         "to durable storage" % (info.get("newer_holder"), info.get("newer_epoch"), info.get("run"),
                                                 info.get("epoch")),
                         hint=continues_hint(info))
        self.info = dict(info)


def continues_hint(info: Dict[str, Any]) -> str:
    where = info.get("newer_holder") or "?"
    if info.get("host"):
        where = "%s (%s)" % (where, info["host"])
    return "the run continues on %s; nothing to do on this box" % where


class LeaseStore:
    """The leases of one run on its durable target: list, read (checked), write."""

    def __init__(self, target: DurableTarget, run: str) -> None:
        self.target = target
        self.run = run
        self.url = "%s/%s" % (target.url, LEASES_DIR)

    def files(self) -> List[LeaseFile]:
        from onbox.checkpoints.leases import lease_files

        return lease_files(self.target.list_leases())

    def read(self, f: LeaseFile) -> Dict[str, Any]:
        """The checked document of `f`; BadLease when it cannot be acted on (or is gone), SyncFailed when the
        storage cannot be read."""
        where = "%s/%s" % (self.url, f.name)
        try:
            raw = self.target.read_lease(f.name)
        except FileNotFoundError:
            raise BadLease("lease file %s vanished while it was read" % where)
        except IsADirectoryError:
            raise BadLease("lease file %s is a directory, not a file" % where)
        except UntrustedInput as e:
            raise BadLease("lease file %s is refused: %s" % (where, e.reason))
        return parse(raw, f, self.run, where)

    def read_or_none(self, f: LeaseFile) -> Optional[Dict[str, Any]]:
        try:
            return self.read(f)
        except (BadLease, SyncFailed, OSError):
            return None

    def write(self, f: LeaseFile, doc: Dict[str, Any]) -> None:
        self.target.put_lease(f.name, doc)


def default_check_every(ttl: float, sync_interval: float) -> float:
    """How often the holder looks for a newer lease when nothing is written: at least every half sync interval
    (a fenced trainer is stopped within one), and often enough to renew at ttl / 3."""
    bound = ttl / 3.0
    if sync_interval > 0:
        bound = min(bound, sync_interval / 2.0)
    return max(0.05, bound)


class RunLease:
    """The lease this agent took: its file, its document, the lineage it restores, and whether it is fenced."""

    def __init__(self, store: LeaseStore, mine: LeaseFile, doc: Dict[str, Any], lineage: Lineage, clock: Any,
                 ttl: float, check_every: float) -> None:
        self.store = store
        self.mine = mine
        self.doc = doc
        self.lineage = lineage
        self.clock = clock
        self.ttl = ttl
        self.check_every = check_every
        self.fence: Optional[Dict[str, Any]] = None  # the fenced event's fields, once fenced (for good)
        self._emit: Optional[Emit] = None
        self._on_change: Optional[Callable[[], None]] = None
        self._pending: List[Tuple[str, Dict[str, Any]]] = []  # events from before the run's recorder existed
        self._lock = threading.RLock()  # one renewal at a time (the thread, a resume); check() inside it
        self._said_missing = False
        self._failing: Optional[str] = None
        self._next_renew = clock.monotonic() + ttl / 3.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def epoch(self) -> int:
        return self.mine.epoch

    @property
    def holder(self) -> str:
        return self.mine.holder

    # -- taking ---------------------------------------------------------------------------------------------------
    @classmethod
    def take(cls, target: DurableTarget, run: str, ttl: float, take_over: bool, clock: Any,
             committed: Callable[[], List[Dict[str, Any]]], check_every: float, host: Optional[str] = None,
             box: Optional[str] = None, pid: Optional[int] = None, start_time: Optional[int] = None,
             alive: Optional[Callable[[int, Optional[int]], bool]] = None,
             slurm_job: Optional[str] = None) -> "RunLease":
        """Take run `run` (see the module docstring). `committed()`: the committed checkpoints' index entries.
        `alive(pid, start_time)`: whether a process of this box runs (the same box's earlier agent). `slurm_job`:
        the Slurm job this agent runs in: a live lease of an earlier incarnation of the same job (a requeue, on
        any node) does not block, as Slurm never runs two at once."""
        from onbox.proc import is_alive
        from onbox.proc import start_time as start_time_of

        store = LeaseStore(target, run)
        host = host or socket.gethostname() or "box"
        box = box or box_id()
        pid = pid or os.getpid()
        start_time = start_time if start_time is not None else start_time_of(pid)
        alive = alive or (lambda p, s: is_alive(p, s))
        now = clock.time()
        pending: List[Tuple[str, Dict[str, Any]]] = []
        files = store.files()
        prev = holder_of_run(files)
        prev_doc: Optional[Dict[str, Any]] = None
        if prev is not None and prev.epoch >= MAX_EPOCH:
            raise LeaseRefused("run %s's newest lease %s/%s has the last epoch there is" % (run, store.url, prev.name),
                               hint="someone wrote it by hand: move the run's leases/ aside, or use another --name")
        if prev is not None:
            try:
                prev_doc = _read_settled(store, prev, clock)
            except BadLease as e:
                if not take_over:
                    raise LeaseRefused("the lease that holds run %s cannot be read: %s" % (run, e),
                                       hint="the file is kept as it is; if the agent that wrote it is gone for "
                                            "good, relaunch with --take-over (the new lease supersedes it)")
                pending.append((vocab.EV_LEASE_UNREADABLE, {"lease": prev.name, "problem": str(e), "durable": store.url}))
            if prev_doc is not None and is_live(prev_doc, now, ttl):
                mine_dead = not blocks(prev_doc, prev.holder, box, alive, slurm_job, now, ttl)
                if not mine_dead and not take_over:
                    raise LeaseRefused(
                        "run %s is held by another agent: %s on %s (lease epoch %d), renewed %s (it stays live "
                        "%.0f s after a renewal)" % (run, prev.holder, prev_doc["host"], prev.epoch,
                                                     renewed_ago(now, prev_doc["renewed_at"]), ttl_of(prev_doc, ttl)),
                        hint="stop it there (`onbox stop %s` on %s); if that box is gone for good, relaunch with "
                             "--take-over (onboxctl keep does once it has declared the box lost)" % (
                                 run, prev_doc["host"]))
                if not mine_dead:
                    pending.append((vocab.EV_LEASE_TAKEN_OVER, {
                        "from_epoch": prev.epoch, "from_holder": prev.holder, "from_host": prev_doc["host"],
                        "renewed_ago_s": round(max(0.0, now - float(prev_doc["renewed_at"])), 3),
                        "warning": "--take-over: the live lease of %s on %s is superseded; that agent is fenced at "
                                   "its next check" % (prev.holder, prev_doc["host"])}))
        # the checkpoints BEFORE the lease is written: one the old holder commits from now on is not in the base
        ckpts = committed_of(committed())
        older = [] if prev is None or prev_doc is not None else _older_winners(store, files, prev)
        base = base_for(prev, prev_doc, older, ckpts)
        mine = LeaseFile("", max(f.epoch for f in files) + 1 if files else 1, new_holder(box))
        mine = mine._replace(name=lease_name(mine.epoch, mine.holder))
        doc = document(run, mine, host, pid, start_time, now, ttl, base, slurm_job=slurm_job)
        hashcopy.fault_point("before-lease")  # tests hold two launches here to make them tie
        store.write(mine, doc)
        winner = fencing_lease(store.files(), mine.epoch, mine.holder)
        if winner is not None:  # another launch took the run at the same moment and won: stand back, write nothing
            other = store.read_or_none(winner) or {}
            raise LeaseRefused("run %s was taken at the same moment by another agent: %s on %s (lease epoch %d); "
                               "this launch stands back" % (run, winner.holder, other.get("host") or "?",
                                                            winner.epoch),
                               hint="nothing was written for this launch but its own lease file; `onbox status %s` "
                                    "on that box shows the run" % run)
        hashcopy.fault_point("after-lease")  # tests hold a new holder here, before its first write
        lineage = Lineage(mine.epoch, mine.holder, base, local_ok=prev is None or box_of(prev.holder) == box)
        lease = cls(store, mine, doc, lineage, clock, ttl, check_every)
        taken = {"epoch": mine.epoch, "holder": mine.holder, "host": host, "ttl": ttl, "durable": store.url,
                 "previous": None if prev is None else {"epoch": prev.epoch, "holder": prev.holder,
                                                        "host": (prev_doc or {}).get("host")},
                 "base": base[:20], "base_count": len(base)}
        lease._pending = [*pending, (vocab.EV_LEASE_TAKEN, taken)]
        return lease

    # -- the run's recorder -----------------------------------------------------------------------------------------
    def attach(self, emit: Emit, on_change: Optional[Callable[[], None]] = None) -> None:
        """The run's event recorder and a callback for a renewal (checkpoint_status.json); says what happened at
        the take."""
        self._emit, self._on_change = emit, on_change
        pending, self._pending = self._pending, []
        for event, fields in pending:
            emit(event, **fields)
        self._changed()

    def _say(self, event: str, **fields: Any) -> None:
        if self._emit is not None:
            self._emit(event, **fields)
        else:
            self._pending.append((event, fields))

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def status(self) -> Dict[str, Any]:
        """What checkpoint_status.json (and from there `onbox status` and the heartbeat) say of the lease."""
        return {"epoch": self.epoch, "holder": self.holder, "host": self.doc.get("host"),
                "taken_at": self.doc.get("taken_at"), "renewed_at": self.doc.get("renewed_at"), "ttl": self.ttl,
                "durable": self.store.url, "resumed_from": self.doc.get("resumed_from"), "fenced": self.fence}

    # -- the guard ----------------------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        """Before a write (`what`: the manifest, the index, a removal ...): Fenced when a newer lease holds the run;
        the listing's SyncFailed when the leases cannot be listed (the write must not happen)."""
        if self.fence is not None:
            raise Fenced(self.fence)
        files = self.store.files()
        newer = fencing_lease(files, self.epoch, self.holder)
        if newer is None:
            if self.mine not in files and not self._said_missing:
                self._said_missing = True  # still ours to hold: the next renewal writes it again
                self._say("lease_missing", lease=self.mine.name, durable=self.store.url)
            return
        self._fenced(newer, what)
        assert self.fence is not None
        raise Fenced(self.fence)

    def _fenced(self, newer: LeaseFile, what: str) -> None:
        other = self.store.read_or_none(newer) or {}
        info = {"run": self.store.run, "epoch": self.epoch, "holder": self.holder, "newer_epoch": newer.epoch,
                "newer_holder": newer.holder, "host": other.get("host"), "refused": what,
                "durable": self.store.url}
        with self._lock:
            if self.fence is not None:
                return
            self.fence = info
        halt(self.store.target)
        self._say("fenced", **info, hint=continues_hint(info))
        self._changed()

    def stamp(self) -> Dict[str, Any]:
        """What each manifest committed under this lease records of it."""
        return {"epoch": self.epoch, "holder": self.holder}

    # -- renewing -----------------------------------------------------------------------------------------------------
    def renew(self, resumed_from: Optional[str] = None) -> None:
        """Rewrite the lease with a new renewed_at (and the checkpoint the run resumed from), after a check."""
        with self._lock:
            self.check("lease renewal")
            doc = dict(self.doc, renewed_at=self.clock.time())
            if resumed_from is not None:
                doc["resumed_from"] = resumed_from
            self.store.write(self.mine, doc)
            self.doc = doc
            self._next_renew = self.clock.monotonic() + self.ttl / 3.0
        self._changed()

    def resumed(self, name: Optional[str]) -> None:
        """The run resumed from committed checkpoint `name`: recorded in the lease at once."""
        if name is None or name == self.doc.get("resumed_from") or self.fence is not None:
            return
        try:
            self.renew(resumed_from=name)
        except Fenced:
            pass
        except (SyncFailed, OSError) as e:
            self._say("lease_renew_failed", error=str(e), durable=self.store.url)

    def tick(self) -> None:
        """One round of the thread: a renewal when one is due, else a check."""
        if self.fence is not None:
            return
        try:
            if self.clock.monotonic() >= self._next_renew:
                self.renew()
            else:
                self.check("lease check")
        except Fenced:
            return
        except (SyncFailed, OSError) as e:
            if self._failing is None:  # said once per streak of failures, and when it ends
                self._say("lease_check_failed", error=str(e), durable=self.store.url,
                          hint="no write happens while the lease cannot be checked; the lease expires %.0f s "
                               "after its last renewal, and another box may then take the run" % self.ttl)
            self._failing = str(e)
            return
        if self._failing is not None:
            self._failing = None
            self._say("lease_check_ok", durable=self.store.url)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="onbox-lease", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.check_every) and self.fence is None:
            try:
                self.tick()
            except Exception as e:  # a bug here must not pass unseen: without checks nothing stops a fenced trainer
                self._say("thread_died", thread="onbox-lease", what="lease renewals and fence checks",
                          error="%s: %s" % (type(e).__name__, e),
                          hint="writes are still checked; the lease expires and another box may take the run")
                return

    def close(self, release: bool, ended: Optional[str] = None) -> None:
        """The agent ends: stop the thread; `release` (the run ended for good here, not fenced): mark the lease
        released, so that a launch elsewhere need not wait out its ttl, with how the run `ended` (done, failed,
        stopped, preempted), so that a launch on another box can tell a finished run from one to resume."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            self._release(release, ended)
        finally:
            halt(self.store.target)  # the agent writes nothing more: its rclone rcd goes with it

    def _release(self, release: bool, ended: Optional[str]) -> None:
        if not release or self.fence is not None:
            return
        try:
            with self._lock:
                self.check("lease release")
                doc = dict(self.doc, released_at=self.clock.time())
                if ended in ENDED_STATES:
                    doc["ended"] = ended
                self.store.write(self.mine, doc)
                self.doc = doc
        except (SyncFailed, OSError) as e:  # not released: a launch elsewhere waits out the ttl (or takes over)
            self._say("lease_release_failed", error=str(e), durable=self.store.url)
            return
        self._say("lease_released", epoch=self.epoch, holder=self.holder)
        self._changed()


def halt(target: DurableTarget) -> None:
    """Stop what the target keeps running for its calls (an rclone remote's rclone rcd): the agent is fenced or
    ends. A call of the committer still on its way there fails (whatever it was writing is no commit: the manifest
    comes after a check that now refuses it); a later call starts another daemon."""
    close = getattr(target, "close", None)
    if close is not None:
        close()


def _read_settled(store: LeaseStore, f: LeaseFile, clock: Any, tries: int = 3, pause: float = 0.3) -> Dict[str, Any]:
    """The lease's document; a read that fails its checks is tried again a moment later before it counts (an
    upload on some remotes is not atomic: a renewal may be caught half-written)."""
    for attempt in range(tries):
        try:
            return store.read(f)
        except BadLease:
            if attempt == tries - 1:
                raise
            clock.sleep(pause)
    raise AssertionError("unreachable")


def _older_winners(store: LeaseStore, files: List[LeaseFile], prev: LeaseFile) -> List[Tuple[LeaseFile, Any]]:
    """(winner, its document or None) of every epoch before prev's, newest first: the lineage of an unreadable
    prev continues from the newest one that can be read."""
    winners: Dict[int, LeaseFile] = {}
    for f in files:
        if f.epoch < prev.epoch and (f.epoch not in winners or beats(f, winners[f.epoch])):
            winners[f.epoch] = f
    out: List[Tuple[LeaseFile, Any]] = []
    for epoch in sorted(winners, reverse=True):
        doc = store.read_or_none(winners[epoch])
        out.append((winners[epoch], doc))
        if doc is not None:
            break
    return out


class NotHeldHere(SyncFailed):
    """A committer that is not the agent (`onbox sync`, `onbox verify`'s record, the stop of an agentless run) was
    pointed at a target on which this box holds no lease of the run: it writes nothing there."""


class PassiveLease:
    """The lease of a committer that is not the run's agent (`onbox sync`, the stop of an agentless run): the one
    this box's agent recorded (`recorded`: {epoch, holder, durable} from checkpoint_status.json, None when it held
    none). It never takes, renews or releases; it fences like the agent's (the Fenced error, no thread).

    A lease holds a run on ONE target: the recorded lease must be a file on the target written to. A box whose
    run took its lease on another target (`onbox sync RUN --durable OTHER`) would otherwise pass the epoch check
    against that target's leases and commit into another box's run there, whose retention then counted the
    stranger's checkpoint as the newest and removed the holder's own (NotHeldHere instead)."""

    def __init__(self, target: DurableTarget, run: str, recorded: Optional[Dict[str, Any]]) -> None:
        self.store = LeaseStore(target, run)
        epoch, holder = (recorded or {}).get("epoch"), (recorded or {}).get("holder")
        self.mine = (LeaseFile(lease_name(epoch, holder), epoch, holder)
                     if isinstance(epoch, int) and isinstance(holder, str) else None)
        self.recorded_on = (recorded or {}).get("durable")
        self.fence: Optional[Dict[str, Any]] = None
        self.lineage: Optional[Lineage] = None

    def check(self, what: str) -> None:
        if self.fence is not None:
            raise Fenced(self.fence)
        files = self.store.files()
        if not files and self.mine is None:
            return  # a run without leases (its agents predate them): nothing to fence
        if self.mine is not None and self.mine not in files:
            raise self._not_held_here(what)
        if self.mine is None:
            best = holder_of_run(files)
            assert best is not None
            info = {"run": self.store.run, "epoch": None, "holder": None, "newer_epoch": best.epoch,
                    "newer_holder": best.holder, "host": (self.store.read_or_none(best) or {}).get("host"),
                    "refused": what, "durable": self.store.url}
            self.fence = info
            raise Fenced(info)
        newer = fencing_lease(files, self.mine.epoch, self.mine.holder)
        if newer is not None:
            self.fence = {"run": self.store.run, "epoch": self.mine.epoch, "holder": self.mine.holder,
                          "newer_epoch": newer.epoch, "newer_holder": newer.holder,
                          "host": (self.store.read_or_none(newer) or {}).get("host"), "refused": what,
                          "durable": self.store.url}
            raise Fenced(self.fence)

    def _not_held_here(self, what: str) -> NotHeldHere:
        assert self.mine is not None
        on = self.recorded_on if isinstance(self.recorded_on, str) else "another target"
        where = self.store.target.url
        return NotHeldHere(
            "refusing to write %s to %s: run %s's agent on this box holds its lease (epoch %d, %s) on %s, and no "
            "such lease is on %s" % (what, where, self.store.run, self.mine.epoch, self.mine.holder,
                                     untrusted.printable(on), where),
            hint="a writer writes to a target only under the lease it holds there: commit to the run's own durable "
                 "storage (leave out --durable), or launch the run with this --durable (`onbox run` takes its "
                 "lease there)")

    def stamp(self) -> Optional[Dict[str, Any]]:
        return None if self.mine is None else {"epoch": self.mine.epoch, "holder": self.mine.holder}


__all__ = ["Committed", "Fenced", "LeaseRefused", "LeaseStore", "NotHeldHere", "PassiveLease", "RunLease",
           "continues_hint", "default_check_every"]
