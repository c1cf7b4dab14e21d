"""Run leases. This module is the pure part: lease file names, the lease document and its checks, who holds a run,
and the lineage a new holder restores from. No I/O here:

  fencing.py    the lease an agent holds: take, the check before every write, renewals, release; PassiveLease for
                every other committer on the box. It reads and writes the lease files through the durable target.

May import: the shared leaves, onbox.checkpoints (the base) and onbox.checkpoints.durable.

A lease is one file per agent launch that took the run, never deleted:

  <durable>/<run>/leases/<epoch:010d>.<holder>.json
  {"schema": "onbox.lease/1", "run", "epoch", "holder", "host", "agent": {"pid", "start_time"}, "taken_at",
   "renewed_at", "ttl", "base": [checkpoint names], "resumed_from": name | null, "released_at": time | null,
   "ended": the run's final state | null (with released_at: done, failed, stopped or preempted)}

- The newest epoch holds the run; among leases of the same epoch (two launches that raced) the lowest holder wins
  (plain string order: deterministic on every box). Every other holder is fenced: it writes nothing more.
- Who holds a run is decided by the file NAMES alone, so that a lease whose content cannot be read still fences
  (the safe side: never two writers). The content tells whether the holder is alive (`renewed_at` within `ttl`,
  no `released_at`) and what its lineage is (`base`).
- A lease file is untrusted input (anyone with the bucket's keys can write one): `parse` refuses, with the reason,
  anything that is not exactly what `document` writes.

Lineage: a holder restores only its own checkpoints (the manifest's `epoch` and `holder` are its own) and those of
its `base`: the previous holder's own checkpoints and that holder's base, as listed BEFORE the new lease was
written (so a checkpoint the old holder commits in the race window is never in it). Anything else committed by an
older epoch (or by the loser of a tie) is a fenced orphan: quarantined, never restored, never deleted.
"""
from __future__ import annotations

import math
import os
import re
import socket
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Set

from onbox import untrusted, vocab

LEASE_SCHEMA = vocab.SCHEMA_LEASE
LEASE_NAME_RE = re.compile(r"^([0-9]{10})\.([A-Za-z0-9][A-Za-z0-9_-]{0,127})\.json$")
MAX_EPOCH = 10 ** 10 - 1
MAX_BASE = 100_000
NONCE_HEX = 8
ENDED_STATES = (vocab.DONE, vocab.FAILED, vocab.STOPPED, vocab.PREEMPTED)  # how a released lease's run ended (`ended`)


class BadLease(untrusted.UntrustedInput):
    """A lease file that is there but cannot be acted on; the message says which file and what is wrong."""


class LeaseFile(NamedTuple):
    """A lease as its file name says: which epoch, which holder."""

    name: str
    epoch: int
    holder: str


def lease_name(epoch: int, holder: str) -> str:
    return "%010d.%s.json" % (epoch, holder)


def parse_name(name: str) -> Optional[LeaseFile]:
    """The lease a file name stands for, or None for any other file (an atomic write's temp, a stranger's)."""
    m = LEASE_NAME_RE.match(name)
    return LeaseFile(name, int(m.group(1)), m.group(2)) if m else None


def lease_files(names: Iterable[str]) -> List[LeaseFile]:
    """The lease files among a listing, oldest first (by epoch, then holder)."""
    found = [f for f in (parse_name(n) for n in names) if f is not None]
    return sorted(found, key=lambda f: (f.epoch, f.holder))


def beats(a: LeaseFile, b: LeaseFile) -> bool:
    """Lease `a` holds the run over lease `b`: a newer epoch, or the same epoch and the lower holder."""
    return a.epoch > b.epoch or (a.epoch == b.epoch and a.holder < b.holder)


def holder_of_run(files: Iterable[LeaseFile]) -> Optional[LeaseFile]:
    """The lease that holds the run: the newest epoch's, the lowest holder among a tie. None without leases."""
    best: Optional[LeaseFile] = None
    for f in files:
        if best is None or beats(f, best):
            best = f
    return best


def fencing_lease(files: Iterable[LeaseFile], epoch: int, holder: str) -> Optional[LeaseFile]:
    """The lease that fences the holder of (epoch, holder), or None while that holder still holds the run."""
    mine = LeaseFile("", epoch, holder)
    best = holder_of_run(files)
    return best if best is not None and beats(best, mine) else None


def box_id(hostname: Optional[str] = None, boot: Optional[str] = None) -> str:
    """This box, as a lease holder names it: the hostname (letters, digits, '-') and 8 characters of the boot id
    (containers may share a hostname; pids only compare within one boot)."""
    from onbox.proc import boot_id

    host = re.sub(r"[^A-Za-z0-9]+", "-", hostname if hostname is not None else socket.gethostname()).strip("-")
    boot = (boot if boot is not None else boot_id() or "").replace("-", "")[:NONCE_HEX] or "noboot"
    return "%s-%s" % ((host or "box")[:64], boot)


def new_holder(box: str, nonce: Optional[str] = None) -> str:
    """A holder for one agent launch on `box`: the box id and a random nonce."""
    return "%s-%s" % (box, nonce if nonce is not None else os.urandom(NONCE_HEX // 2).hex())


def box_of(holder: str) -> str:
    """The box id a holder was made from (new_holder's inverse)."""
    return holder[:-(NONCE_HEX + 1)] if len(holder) > NONCE_HEX + 1 else holder


def document(run: str, f: LeaseFile, host: str, pid: int, start_time: Optional[int], now: float, ttl: float,
             base: List[str], resumed_from: Optional[str] = None, slurm_job: Optional[str] = None) -> Dict[str, Any]:
    """The lease a holder writes when it takes the run. `slurm_job`: the Slurm job it runs in (Slurm runs one
    incarnation of a job at a time: a requeued job's earlier agent is gone, wherever it ran)."""
    return {"schema": LEASE_SCHEMA, "run": run, "epoch": f.epoch, "holder": f.holder, "host": host,
            "agent": {"pid": pid, "start_time": start_time}, "taken_at": now, "renewed_at": now, "ttl": ttl,
            "base": list(base), "resumed_from": resumed_from, "released_at": None, "slurm_job": slurm_job}


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def problem(doc: Any, f: LeaseFile, run: str) -> Optional[str]:
    """What makes `doc` (the parsed content of lease file `f` of run `run`) unusable, or None."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("schema") != LEASE_SCHEMA:
        return "schema %r is not %r" % (doc.get("schema"), LEASE_SCHEMA)
    if doc.get("run") != run:
        return "it is a lease of run %r, not %r" % (doc.get("run"), run)
    if doc.get("epoch") != f.epoch or not _count(doc.get("epoch")):
        return "epoch %r, but its file name says %d" % (doc.get("epoch"), f.epoch)
    if doc.get("holder") != f.holder:
        return "holder %r, but its file name says %r" % (doc.get("holder"), f.holder)
    host = doc.get("host")
    if not isinstance(host, str) or not 0 < len(host) <= 256:
        return "host %r is not a host name" % (host,)
    agent = doc.get("agent")
    if not isinstance(agent, dict):
        return "agent is not an object"
    if not (_count(agent.get("pid")) and agent["pid"] > 0):
        return "agent.pid %r is not a process id" % (agent.get("pid"),)
    if agent.get("start_time") is not None and not _count(agent["start_time"]):
        return "agent.start_time %r is not a start time" % (agent.get("start_time"),)
    for key in ("taken_at", "renewed_at"):
        if not _time(doc.get(key)):
            return "%s %r is not a time" % (key, doc.get(key))
    if doc.get("released_at") is not None and not _time(doc["released_at"]):
        return "released_at %r is not a time" % (doc["released_at"],)
    ttl = doc.get("ttl")
    if ttl is not None and not (_time(ttl) and ttl > 0):
        return "ttl %r is not a number of seconds" % (ttl,)
    base = doc.get("base")
    if not isinstance(base, list):
        return "base is not a list"
    if len(base) > MAX_BASE:
        return "base names more than %d checkpoints" % MAX_BASE
    for i, name in enumerate(base):
        why = untrusted.name_problem(name)
        if why:
            return "base[%d] %r: %s" % (i, name, why)
    job = doc.get("slurm_job")
    if job is not None and not (isinstance(job, str) and re.fullmatch(r"[0-9]{1,20}(_[0-9]{1,20})?", job)):
        return "slurm_job %r is not a Slurm job id" % (job,)
    resumed = doc.get("resumed_from")
    if resumed is not None and untrusted.name_problem(resumed):
        return "resumed_from %r: %s" % (resumed, untrusted.name_problem(resumed))
    ended = doc.get("ended")
    if ended is not None and ended not in ENDED_STATES:
        return "ended %r is not one of %s" % (ended, ", ".join(ENDED_STATES))
    return None


def parse(raw: bytes, f: LeaseFile, run: str, where: str) -> Dict[str, Any]:
    """The bytes of lease file `f` (at `where`, for messages), parsed with the nesting bound and checked; BadLease
    otherwise."""
    try:
        doc = untrusted.loads_json(raw, "lease file %s" % where)
    except untrusted.UntrustedInput as e:
        raise BadLease("lease file %s is refused: %s" % (where, e.reason))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadLease("lease file %s is not JSON: %s" % (where, e))
    why = problem(doc, f, run)
    if why:
        raise BadLease("lease file %s is refused: %s" % (where, why))
    return doc


def ttl_of(doc: Dict[str, Any], default: float) -> float:
    """The seconds a lease stays live after its last renewal: the holder's own (it renews at a third of it)."""
    ttl = doc.get("ttl")
    return float(ttl) if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0 else default


CLOCK_SLACK_S = 5.0  # a renewal this little ahead of the reader's clock is NTP's ordinary disagreement


def renewed_ago(now: float, then: Any) -> str:
    """When a lease was renewed, in words, by the reader's clock: "12 s ago". A renewal later than now is the two
    boxes' clocks disagreeing (or a lease written by hand), said so: "0 s ago" for a lease renewed a year ahead
    hid why it stays live."""
    if not isinstance(then, (int, float)) or isinstance(then, bool) or not math.isfinite(then):
        return "at an unknown time"
    ahead = float(then) - now
    if ahead <= CLOCK_SLACK_S:
        return "%.0f s ago" % max(0.0, -ahead)
    return ("%s IN THE FUTURE by this box's clock (the clocks of the two boxes disagree by that much, or the lease "
            "was written by hand)" % _span(ahead))


def _span(seconds: float) -> str:
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return "%.1f %s" % (seconds / size, unit)
    return "%.0f s" % seconds


def is_live(doc: Dict[str, Any], now: float, default_ttl: float) -> bool:
    """Renewed within its ttl and not released. Wall clocks of two boxes are compared here: they must agree to
    well within a ttl (NTP does; a box whose clock is off by minutes is not one to train on)."""
    if doc.get("released_at") is not None:
        return False
    return now - float(doc["renewed_at"]) <= ttl_of(doc, default_ttl)


def blocks(doc: Dict[str, Any], holder: str, box: str, alive: Any, slurm_job: Optional[str], now: float,
           default_ttl: float) -> bool:
    """Whether the live lease `doc` of `holder` refuses a launch by an agent on `box` (without --take-over): it is
    live, and it is not this box's own earlier agent that is gone (`alive(pid, start_time)`), nor an earlier
    incarnation of the same Slurm job `slurm_job`."""
    if not is_live(doc, now, default_ttl):
        return False
    agent = doc.get("agent") or {}
    mine_dead = (box_of(holder) == box and not alive(agent["pid"], agent.get("start_time"))) or (
        slurm_job is not None and doc.get("slurm_job") == slurm_job)
    return not mine_dead


class Committed(NamedTuple):
    """A committed checkpoint as lineage sees it: its name and the lease it was committed under (None: an agent
    without leases committed it)."""

    name: str
    epoch: Optional[int]
    holder: Optional[str]


def committed_of(entries: Iterable[Dict[str, Any]]) -> List[Committed]:
    """Committed (name, epoch, holder) of index entries (commit.CheckpointCommitter.committed)."""
    out = []
    for e in entries:
        epoch, holder = e.get("epoch"), e.get("holder")
        out.append(Committed(e["name"], epoch if _count(epoch) else None,
                             holder if isinstance(holder, str) else None))
    return out


def own(ckpts: Iterable[Committed], f: LeaseFile) -> Set[str]:
    """The checkpoints committed under lease `f`."""
    return {c.name for c in ckpts if c.epoch == f.epoch and c.holder == f.holder}


class Lineage:
    """What one holder may restore and what retention counts: its own checkpoints and its base.

    `local_ok`: local checkpoints this box holds may be resumed from (newer than the durable ones) -- only when the
    previous holder was this same box (a relaunch after its own agent ended), or there was none. Checkpoints a
    box wrote under an older lease that another box superseded are another timeline."""

    def __init__(self, epoch: int, holder: str, base: Iterable[str], local_ok: bool = True) -> None:
        self.epoch = epoch
        self.holder = holder
        self.base = frozenset(base)
        self.local_ok = local_ok

    def contains(self, entry: Dict[str, Any]) -> bool:
        return entry.get("name") in self.base or (entry.get("epoch") == self.epoch and
                                                  entry.get("holder") == self.holder)

    def orphan(self, entry: Dict[str, Any]) -> bool:
        """Committed by an older epoch (or without a lease, or by the loser of this epoch's tie) outside the
        lineage: never restored, moved to quarantine/. A newer epoch's is not ours to judge (we are fenced)."""
        if self.contains(entry):
            return False
        epoch = entry.get("epoch")
        if not isinstance(epoch, int) or not _count(epoch):
            return True
        return epoch < self.epoch or (epoch == self.epoch and entry.get("holder") != self.holder)


def base_for(prev: Optional[LeaseFile], prev_doc: Optional[Dict[str, Any]], older: List[Any],
             ckpts: List[Committed]) -> List[str]:
    """The base of a lease taken over `prev` (the lease that held the run; `prev_doc` its content, None when it
    could not be read), from the checkpoints committed now (`ckpts`, listed before the new lease is written):
    the previous holder's own checkpoints and its base. `older`: (LeaseFile, doc or None) of the epochs before
    prev, newest first, for a prev whose content cannot be read. No lease at all (or none readable): every
    committed checkpoint (an agent without leases committed them)."""
    existing = {c.name for c in ckpts}
    if prev is None:
        return sorted(existing)
    if prev_doc is not None:
        lineage = own(ckpts, prev) | set(prev_doc.get("base") or [])
    else:
        lineage = own(ckpts, prev)
        for f, doc in older:
            lineage |= own(ckpts, f)
            if doc is not None:
                lineage |= set(doc.get("base") or [])
                break
        else:
            lineage = set(existing)
    return sorted(lineage & existing)
