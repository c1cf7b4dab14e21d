"""The committer: copy a complete checkpoint to the durable target so that a reader sees all of it or nothing.

Protocol (onbox/checkpoints/README.md): preflight bytes+inodes -> one read pass that copies and hashes each file into
a staging dir -> fsync files -> fsync dirs -> rename staging to <name> -> fsync parent -> MANIFEST.json with the
atomic-write recipe, LAST (the commit point) -> checkpoints_index.json (atomic) -> retention.
Idempotent: a checkpoint already committed (same source fingerprint, or same hashes) is skipped. Leftovers of an
interrupted commit (staging dirs, manifest-less dirs that
carry durable.PARTIAL_MARKER) are removed when the committer starts; a manifest-less dir without it is not ours.

Fencing (fencing.py): `guard(what)` runs before every write to durable storage -- the cleanup of leftovers, the
payload, the manifest (right before it: the commit point), the index, each retention removal, a quarantine --
and raises (fencing.Fenced) when a newer lease holds the run. Each manifest records the lease it was committed
under (`stamp()`: epoch and holder); retention counts only the checkpoints `in_lineage` says are this holder's.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set

from onbox import fsutil
from onbox.checkpoints import INDEX_SCHEMA, MANIFEST_SCHEMA, DurableFull, SyncFailed, formats
from onbox.checkpoints.durable import DurableTarget, FileHashes, hashcopy, manifest, retention, steptimes
from onbox.checkpoints.durable.index import entry_from_manifest, record_checks, upgrade_entry
from onbox.checkpoints.local.detect import Candidate, durable_name, fingerprint_of

MiB = 1024 * 1024


class CommitResult(NamedTuple):
    name: str
    step: Optional[int]
    status: str  # "committed" | "already" | "source_changed"
    bytes: int
    seconds: float
    digest: str
    url: str


def checkpoint_digest(files: List[Dict[str, Any]], algo: str) -> str:
    """One hash for a whole checkpoint: over the sorted (path, size, file hash) lines."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f["path"]):
        h.update(("%s\0%d\0%s\n" % (f["path"], f["size"], f[algo])).encode("utf-8"))
    return h.hexdigest()


def _fp_list(fp: Any) -> List[List[Any]]:
    return [[rel, size, mtime_ns] for rel, size, mtime_ns, _ino in fp]


class CheckpointCommitter:
    def __init__(self, target: DurableTarget, run: str, clock: Any, emit: Callable[..., None],
                 hash_name: str = hashcopy.HASH_NAME, margin_bytes: int = 64 * MiB, margin_fraction: float = 0.02,
                 margin_inodes: int = 16, guard: Optional[Callable[[str], None]] = None,
                 stamp: Optional[Callable[[], Optional[Dict[str, Any]]]] = None,
                 in_lineage: Optional[Callable[[Dict[str, Any]], bool]] = None) -> None:
        self.target = target
        lease_check: Callable[[str], None] = guard or (lambda what: None)

        def checked(what: str) -> None:
            with steptimes.phase("lease checks"):
                lease_check(what)
        self.guard: Callable[[str], None] = checked
        self.stamp = stamp or (lambda: None)
        self.in_lineage = in_lineage
        self.run = run
        self.clock = clock
        self.emit = emit
        self.hash_name = hash_name
        self.margin_bytes = margin_bytes
        self.margin_fraction = margin_fraction
        self.margin_inodes = margin_inodes
        self._started = False
        self._quarantined: List[Dict[str, Any]] = []  # the index's record of quarantined checkpoints
        self._refused: Set[str] = set()  # checkpoints whose manifest was refused, said once each
        self._holding = False  # inside held(): committed() is read once, then follows this committer's writes
        self._known: Optional[List[Dict[str, Any]]] = None
        # the split of the last commit (and of the retention after it): steptimes.py, tests/bench/bench_checkpoints.py
        self.last_phases = steptimes.PhaseTimes()

    def start(self) -> None:
        """Clean what an interrupted commit left behind (once per committer)."""
        if self._started:
            return
        removed = self.target.clean_leftovers(before_write=lambda: self.guard("the cleanup of interrupted commits"))
        if removed:
            self.emit("checkpoint_leftovers_cleaned", durable=self.target.url, removed=removed)
        self._started = True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While the caller holds the run's commit lock (and the lease), this committer is the run's only writer:
        committed() reads the durable side once and then follows the writes made here (a commit, its index, its
        retention, the hook's look at the result: one index read and one listing instead of one each). A failed
        write drops what was read."""
        self._holding, self._known = True, None
        try:
            yield
        finally:
            self._holding, self._known = False, None

    # -- reading what is committed -------------------------------------------------------------------------------
    def committed(self) -> List[Dict[str, Any]]:
        """Index entries of every committed checkpoint, oldest first (rebuilt from manifests when needed)."""
        if self._known is not None:
            return list(self._known)
        entries = self._read_committed()
        if self._holding:
            self._known = list(entries)
        return entries

    def _read_committed(self) -> List[Dict[str, Any]]:
        index = self.target.read_index()
        if index is not None and isinstance(index.get("quarantined"), list):
            self._quarantined = [q for q in index["quarantined"] if isinstance(q, dict)]
        names = set(self.target.list_names())
        entries = []
        if index is not None and isinstance(index.get("checkpoints"), list):
            # a /1 index (an older agent's) reads as /2: its entries were verified at commit, never re-checked
            # an entry of the wrong shape is dropped here and rebuilt from its manifest below
            entries = [upgrade_entry(e) for e in index["checkpoints"]
                       if manifest.entry_problem(e) is None and e.get("name") in names]
        # a checkpoint the index does not list yet (its commit is under way: the manifest is written before the
        # index), or every one when the index is unreadable: from its manifest. The index's entries are kept
        # as they are: they carry what manifests do not (the re-checks)
        listed = {e["name"] for e in entries}
        for n in sorted(names - listed):
            m = self._manifest_or_none(n)
            if m is not None:  # a manifest may leave out its name (manifest.problem): its dir's is the same
                entries.append(entry_from_manifest(dict(m, name=n)))
        return sorted(entries, key=retention.entry_order)

    def _manifest_or_none(self, name: str) -> Optional[Dict[str, Any]]:
        """The checked manifest of `name`; a refused one is said once (an event) and does not exist here."""
        try:
            return self.target.read_manifest(name)
        except manifest.BadManifest as e:
            if name not in self._refused:
                self._refused.add(name)
                self.emit("checkpoint_refused", checkpoint=name, problem=str(e), durable=self.target.url)
            return None

    def _taken(self, name: str) -> bool:
        """A checkpoint by that name exists on durable storage, usable or refused: never committed over."""
        try:
            return self.target.read_manifest(name) is not None
        except manifest.BadManifest:
            return True

    def find_same_source(self, cand: Candidate) -> Optional[Dict[str, Any]]:
        fp = _fp_list(cand.fingerprint)
        for e in self.committed():
            if e.get("local_name") == cand.name and e.get("source_fingerprint") == fp:
                return e
        return None

    # -- committing ---------------------------------------------------------------------------------------------
    def preflight(self, cand: Candidate) -> None:
        """U7: bytes AND inodes, plus a margin, before starting a copy that could not finish."""
        fs = self.target.free_space()
        if fs is None:
            return
        # the fixed margin is capped at 1% of the filesystem, so a small volume is not refused outright
        margin = max(min(self.margin_bytes, fs.total_bytes // 100), int(cand.bytes * self.margin_fraction))
        need_bytes = cand.bytes + margin
        dirs = len({os.path.dirname(f) for f in cand.files}) + 1
        need_inodes = len(cand.files) + dirs + 1 + self.margin_inodes  # files, dirs, manifest, index temp
        short_bytes = fs.free_bytes < need_bytes
        short_inodes = fs.has_inode_limit and fs.free_inodes < need_inodes
        if short_bytes or short_inodes:
            details = {"durable": self.target.url, "checkpoint": cand.name, "need_bytes": need_bytes,
                       "free_bytes": fs.free_bytes, "need_inodes": need_inodes, "free_inodes": fs.free_inodes}
            self.emit("durable_full", **details)
            what = []
            if short_bytes:
                what.append("%.1f MiB free, %.1f MiB needed" % (fs.free_bytes / MiB, need_bytes / MiB))
            if short_inodes:
                what.append("%d inodes free, %d needed" % (fs.free_inodes, need_inodes))
            raise DurableFull("durable storage %s is too full to commit %s: %s" % (
                self.target.url, cand.name, "; ".join(what)),
                hint="free space or inodes there (U7: check `df -h` AND `df -i`), or point --durable elsewhere; "
                     "the local checkpoint is untouched", errno_name="ENOSPC", details=details)

    def commit(self, cand: Candidate) -> CommitResult:
        """Commit one complete candidate. Raises SyncFailed (or DurableFull) loudly; never half-commits."""
        # one commit reads what is committed once (before it, and for the index after it) however it is called
        self.last_phases = steptimes.PhaseTimes()
        with contextlib.nullcontext() if self._holding else self.held(), steptimes.recording(self.last_phases):
            try:
                return self._commit(cand)
            except BaseException:
                self._known = None  # a manifest may have landed all the same: read the durable side again
                raise

    def _commit(self, cand: Candidate) -> CommitResult:
        t0 = self.clock.monotonic()
        name = durable_name(cand)
        with steptimes.phase("look-up"):
            same = self.find_same_source(cand)
            self.start()  # after the first read: a leftover is no committed checkpoint, and its listing serves both
        if same is not None:
            return CommitResult(same["name"], same.get("step"), "already", 0, 0.0, same.get("digest", ""),
                                self.target.url)
        try:
            with steptimes.phase("look-up"):
                existing = self.target.read_manifest(name)
        except manifest.BadManifest:  # the name is taken by a checkpoint restore refuses: commit beside it
            existing = {"files": [], "digest": None}
        if existing is not None:
            sizes = {f["path"]: f["size"] for f in existing["files"]}
            if sizes == {rel: size for rel, size, _m, _i in cand.fingerprint}:
                try:
                    files = [{"path": rel, "size": size, self.hash_name: hashcopy.hash_file(
                        os.path.join(cand.root, rel), self.hash_name)[1]} for rel, size, _m, _i in cand.fingerprint]
                except OSError as e:  # gone or replaced since the scan: look again, it says nothing of durable
                    return self._source_changed(name, cand, t0, "cannot read the source: %s" % e)
                if checkpoint_digest(files, self.hash_name) == existing.get("digest"):
                    return CommitResult(name, existing.get("step"), "already", 0, 0.0, existing["digest"],
                                        self.target.url)
            k = 2
            while self._taken(fsutil.fit_name(name, ".r%d" % k)):
                k += 1
            name = fsutil.fit_name(name, ".r%d" % k)
        if fingerprint_of_safe(cand) != cand.fingerprint:  # rewritten since it was judged complete: look again
            return CommitResult(name, cand.step, "source_changed", 0, self.clock.monotonic() - t0, "",
                                self.target.url)
        with steptimes.phase("preflight"):
            self.preflight(cand)
        self.emit("checkpoint_commit_started", checkpoint=name, step=cand.step, bytes=cand.bytes,
                  durable=self.target.url)
        self.guard("the payload of %s" % name)
        try:
            hashes = self.target.put_payload(name, cand.root, cand.files, self.hash_name)
        except (SyncFailed, OSError) as e:
            if fingerprint_of_safe(cand) == cand.fingerprint:
                raise  # the source is as it was judged: the failure is the copy's or the durable side's
            # the trainer deleted or rewrote it while we copied (HF's save_total_limit retiring checkpoint-N):
            # nothing is wrong with the durable storage; the next scan commits what is there now
            return self._source_changed(name, cand, t0, "source changed or vanished while copying (%s)" % e)
        short = ["%s: %s of %d bytes" % (rel, hashes.get(rel, (None,))[0], size)
                 for rel, size, _m, _i in cand.fingerprint if hashes.get(rel, (None,))[0] != size]
        if short and fingerprint_of_safe(cand) == cand.fingerprint:
            self.guard("the removal of the short copy of %s" % name)
            self.target.remove(name)  # U33: what landed is not what the trainer wrote, and nothing changed it
            raise SyncFailed("copy to %s came out short: %s" % (self.target.url, "; ".join(short)),
                             hint="the durable storage lost data in flight; check it and retry", errno_name="EIO")
        with steptimes.phase("format check"):
            problem = None if fingerprint_of_safe(cand) != cand.fingerprint else self._whole_after_copy(cand)
        if problem is not None or fingerprint_of_safe(cand) != cand.fingerprint:
            # the trainer rewrote it while we copied (nanoGPT's in-place torch.save): this copy may be torn
            self.guard("the removal of the torn copy of %s" % name)
            self.target.remove(name)
            self.emit("checkpoint_commit_aborted", checkpoint=name, reason=problem or "source changed while copying")
            return CommitResult(name, cand.step, "source_changed", 0, self.clock.monotonic() - t0, "",
                                self.target.url)
        doc = self._manifest(name, cand, hashes)
        self.guard("the manifest of %s" % name)  # the last look before the commit point
        hashcopy.fault_point("before-manifest")
        with steptimes.phase("manifest"):
            self.target.put_manifest(name, doc)  # the commit point
        hashcopy.fault_point("after-manifest")
        seconds = max(self.clock.monotonic() - t0, 1e-6)
        with steptimes.phase("index"):
            self._update_index(entry_from_manifest(doc))
        self.emit("checkpoint_committed", checkpoint=name, step=cand.step, bytes=doc["bytes"],
                  seconds=round(seconds, 3), digest=doc["digest"], durable=self.target.url,
                  phases=self.last_phases.rounded())
        return CommitResult(name, cand.step, "committed", doc["bytes"], seconds, doc["digest"],
                            self.target.url)

    def _source_changed(self, name: str, cand: Candidate, t0: float, reason: str) -> CommitResult:
        self.emit("checkpoint_commit_aborted", checkpoint=name, reason=reason)
        return CommitResult(name, cand.step, "source_changed", 0, self.clock.monotonic() - t0, "", self.target.url)

    def _whole_after_copy(self, cand: Candidate) -> Optional[str]:
        """A file committed for its format alone (not quiet, the trainer may rewrite it any moment) gets the full
        check of every zip member's CRC after the copy; with its identity unchanged before and after, the bytes
        copied are the bytes checked. A problem string, or None."""
        if cand.is_dir or cand.complete_by != "format":
            return None
        for rel in cand.files:  # one file, or a group's (TensorFlow's index and shards)
            res = formats.check_file(os.path.join(cand.root, rel), full=True)
            if not res.ok:
                return "the source failed its full check after the copy: %s" % res.problem
        return None

    def _manifest(self, name: str, cand: Candidate, hashes: FileHashes) -> Dict[str, Any]:
        files = [{"path": rel, "size": hashes[rel][0], self.hash_name: hashes[rel][1]} for rel in cand.files]
        return {
            "schema": MANIFEST_SCHEMA, "run": self.run, "name": name, "local_name": cand.name,
            "kind": "dir" if cand.is_dir else "files" if cand.group else "file", "step": cand.step, "step_source": cand.step_source,
            "created": self.clock.time(),
            "hash": self.hash_name, "files": files, "bytes": sum(f["size"] for f in files),
            "digest": checkpoint_digest(files, self.hash_name), "metrics": cand.metrics,
            "format": cand.format, "complete_by": cand.complete_by, "complete_reason": cand.reason,
            "source": {"host": socket.gethostname(), "path": cand.path, "fingerprint": _fp_list(cand.fingerprint)},
            **(self.stamp() or {}),  # the lease it is committed under: epoch, holder (lineage, fencing.py)
        }

    # -- index and retention ---------------------------------------------------------------------------------------
    def _update_index(self, new: Dict[str, Any]) -> None:
        entries = [e for e in self.committed() if e["name"] != new["name"]] + [new]
        self.write_index(entries)

    def write_index(self, entries: List[Dict[str, Any]]) -> None:
        doc = {"schema": INDEX_SCHEMA, "run": self.run, "updated": self.clock.time(),
               "checkpoints": sorted(entries, key=retention.entry_order)}
        if self._quarantined:
            doc["quarantined"] = self._quarantined
        self.guard("the index")
        self._known = None
        self.target.write_index(doc)
        if self._holding:
            self._known = list(doc["checkpoints"])

    def record_checks(self, checks: Dict[str, Dict[str, Any]]) -> List[str]:
        """Record re-checks (a restore's, `onbox verify`'s) of committed checkpoints in the index; the caller holds
        the run's commit lock. See index.record_checks."""
        self.guard("the index")
        self._known = None
        return record_checks(self.target, checks, self.clock.time())

    def quarantine(self, name: str, reason: str) -> str:
        """Take a committed checkpoint out of use (moved whole to <run>/quarantine/, never deleted) and record
        it in the index; returns where it went."""
        entries = self.committed()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.clock.time()))
        self.guard("the quarantine of %s" % name)
        self._known = None
        dest = self.target.quarantine(name, stamp)
        # the whole entry (step, metrics, verification) goes along, so the index still says what it was
        was = next((e for e in entries if e["name"] == name), {"name": name})
        self._quarantined = [*self._quarantined, dict(was, moved_to=dest, reason=reason, at=self.clock.time())]
        self.write_index([e for e in entries if e["name"] != name])
        return dest

    def apply_retention(self, keep_last: int, best_metric: Optional[str] = None, best_mode: str = "min",
                        every_steps: Optional[int] = None, pinned: Sequence[str] = ()) -> List[str]:
        """Delete committed checkpoints outside the keep set; the newest verified one always stays, and so does
        each of `pinned` (the checkpoint the current attempt resumed from: a group's other nodes fetch it while
        node 0 trains on and commits). Only this holder's lineage counts (`in_lineage`): what lies outside it is
        never retired here (it is quarantined)."""
        with steptimes.recording(self.last_phases), steptimes.phase("retention"):
            return self._apply_retention(keep_last, best_metric, best_mode, every_steps, pinned)

    def _apply_retention(self, keep_last: int, best_metric: Optional[str], best_mode: str,
                         every_steps: Optional[int], pinned: Sequence[str]) -> List[str]:
        entries = self.committed()
        pool = [e for e in entries if self.in_lineage is None or self.in_lineage(e)]
        keep = retention.select_keep(pool, keep_last, best_metric, best_mode, every_steps) | set(pinned)
        doomed = [e["name"] for e in pool if e["name"] not in keep]
        if not doomed:
            return []
        self.write_index([e for e in entries if e["name"] not in doomed])  # index first: never lists a deleted one
        for n in doomed:
            self.guard("the retirement of %s" % n)
            try:
                self.target.remove(n)
            except BaseException:
                self._known = None  # not removed, perhaps still committed: read the durable side again
                raise
        self.emit("checkpoints_retired", durable=self.target.url, removed=doomed)
        return doomed


index_entry = entry_from_manifest  # the name older callers import


def fingerprint_of_safe(cand: Candidate) -> Any:
    try:
        with steptimes.phase("fingerprint"):
            return fingerprint_of(cand)
    except OSError:
        return None


__all__ = ["CheckpointCommitter", "CommitResult", "DurableFull", "SyncFailed", "checkpoint_digest"]
