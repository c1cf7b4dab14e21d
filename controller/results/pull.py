"""Pull a run's committed checkpoints (and logs, index) home, resumably, then verify each one locally.

What is there to pull, the box's agent says (`onbox checkpoints RUN --json`, `--all` for the gate; schema
onbox.checkpoints/1, onbox/checkpoints/listing.py): the run's state, its durable dir and every checkpoint whose
MANIFEST.json is there, with the sha256 of the manifest's bytes. Layout read on the box (onbox/checkpoints/README.md):
    <durable>/<run>/checkpoints/<name>/MANIFEST.json   a checkpoint exists only once its manifest does
    <durable>/<run>/checkpoints_index.json
    <durable>/<run>/logs/
Layout written here: <dest>/<run>/... the same tree. Each checkpoint is its own rsync (U12: one dropped link
loses one checkpoint's progress, not the run's), with --partial-dir so a half-copied file resumes and never looks
complete, the manifest copied LAST, each attempt bounded (rsync --timeout for stalls plus a wall-clock cap) and
retried with backoff. Then `onbox verify` (manifest hashes, format checks, --load when torch is importable) and
the outcome, with what was checked in words, goes into the pulls record, which the teardown gate reads.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional

from controller.boxes.agent import agent_json
from controller.boxes.inventory import Box, config_dir
from controller.boxes.ssh import RSYNC_MISSING, RemoteCommandFailed, Ssh, rsync_lost_link
from controller.boxes.sshfail import unreachable
from onbox import untrusted
from onbox.checkpoints.listing import LIST_SCHEMA
from onbox.checkpoints.listing import SCHEMA as LISTING_SCHEMA
from onbox.checkpoints.local.whynone import nothing_committed
from onbox.clock import Clock, SystemClock
from onbox.errors import JobFailed, OnboxError, UnfitError, UsageError
from onbox.fsutil import atomic_write_json
from onbox.toolrun import DEVNULL, Says, Tool, stderr_tail

PARTIAL_DIR = ".onbox-partial"
# pulls.json grows by ~300 bytes for every checkpoint ever pulled, like a checkpoints index: the index's bound
PULLS_MAX_BYTES = untrusted.INDEX_MAX_BYTES

PROGRESS_RE = re.compile(r"^\s*([\d,]+)\s+(\d+)%\s+(\S+/s)\s+(\S+)")
# each attempt through the tool runner: rsync's lines streamed for the progress, the attempt killed with its ssh at
# the wall-clock cap (rsync's own --timeout ends a stall sooner); a Ctrl-C lets rsync keep its half-copied file
RSYNC_FROM = Tool("rsync", RemoteCommandFailed, missing=RSYNC_MISSING,
                  timed_out=Says("pulling {label} took longer than {timeout:.0f} s", error=JobFailed),
                  failed=Says("rsync of {label} from {box} exited {rc}: {stderr}"), tail=stderr_tail(chars=400))


@dataclasses.dataclass
class RemoteCheckpoint:
    name: str
    manifest_sha256: str
    step: Optional[int] = None
    created: Any = None
    bytes: Optional[int] = None


def newest(ckpts: List[RemoteCheckpoint]) -> Optional[RemoteCheckpoint]:
    """The newest committed checkpoint: highest step, then creation time, then name."""
    if not ckpts:
        return None
    return max(ckpts, key=lambda c: (c.step if isinstance(c.step, int) else -1, str(c.created or ""), c.name))


def _checkpoint(box: Box, m: Any) -> RemoteCheckpoint:
    """One entry of the agent's `manifests`, its types checked: the name becomes a local path."""
    if not isinstance(m, dict) or untrusted.name_problem(m.get("name")) or not isinstance(m.get("manifest_sha256"), str):
        raise JobFailed("the box %s listed a checkpoint that is no directory entry with a manifest hash: %r"
                        % (box.name, m if not isinstance(m, dict) else m.get("name")))
    step, size = m.get("step"), m.get("bytes")
    return RemoteCheckpoint(name=m["name"], manifest_sha256=m["manifest_sha256"],
                            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                            created=m.get("created"),
                            bytes=size if isinstance(size, int) and not isinstance(size, bool) else None)


def _run_doc(box: Box, doc: Any) -> Dict[str, Any]:
    """An onbox.checkpoints/1 document as pull and the teardown gate read it."""
    if not isinstance(doc, dict) or not isinstance(doc.get("run"), str):
        raise JobFailed("could not read the runs on %s: an entry that is no run: %r" % (box.name, doc))
    root, node, durable = doc.get("durable_root"), doc.get("node"), doc.get("durable")
    out: Dict[str, Any] = {"run": doc["run"], "exists": True, "state": doc.get("state"),
                           "durable": durable if isinstance(durable, str) else None,
                           "has_index": doc.get("has_index") is True, "has_logs": doc.get("has_logs") is True,
                           "checkpoints": [_checkpoint(box, m) for m in doc.get("manifests") or []]}
    if isinstance(root, str) and root:
        out["run_root"] = root
    if isinstance(node, dict):  # a node of a multi-node group: only node 0 commits
        out["node"] = node
    if doc.get("problem"):
        out["problem"] = doc["problem"]
    said = doc.get("nothing_committed")  # why, in the agent's words (onbox/checkpoints/local/whynone.py)
    out["nothing_committed"] = untrusted.printable(said)[:2000] if isinstance(said, str) and said else \
        nothing_committed(out["durable"], doc.get("status") if isinstance(doc.get("status"), dict) else None)
    return out


def remote_runs(ssh: Ssh, box: Box, runs: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Each run's state, durable dir and committed checkpoints on the box (all runs when `runs` is None), from
    the agent's `onbox checkpoints --json` (an rclone remote is not asked: what it holds is off the box)."""
    if runs is None:
        listed = agent_json(ssh, box, ["checkpoints", "--all", "--json"], LIST_SCHEMA, timeout=120).get("runs")
        if not isinstance(listed, list):
            raise JobFailed("could not read the runs on %s: %s without a run list" % (box.name, LIST_SCHEMA))
    else:
        listed = [agent_json(ssh, box, ["checkpoints", run, "--json"], LISTING_SCHEMA) for run in runs]
    return [_run_doc(box, d) for d in listed]


def remote_run(ssh: Ssh, box: Box, run: str) -> Dict[str, Any]:
    """One run's durable dir and committed checkpoints on the box."""
    return remote_runs(ssh, box, [run])[0]


def read_pulls(path: str) -> Dict[str, Any]:
    """pulls.json as {"pulls": {BOX/RUN: {"checkpoints": {NAME: {...}}, ...}}}: read through onbox.untrusted (a
    regular file of at most PULLS_MAX_BYTES, nested at most 64 deep), its shape checked. OSError when it cannot
    be read, ValueError (UntrustedInput included) when it is not such a record. The tracker reads it too."""
    doc = untrusted.read_json(path, PULLS_MAX_BYTES, "pulls record")
    pulls = doc.setdefault("pulls", {}) if isinstance(doc, dict) else None
    if not isinstance(pulls, dict):
        raise ValueError("not {\"pulls\": {...}}")
    for key, entry in pulls.items():
        ckpts = entry.get("checkpoints", {}) if isinstance(entry, dict) else None
        if not isinstance(ckpts, dict) or not all(isinstance(c, dict) for c in ckpts.values()):
            raise ValueError("its entry %r is not {\"checkpoints\": {NAME: {...}}}" % key)
    return doc


class PullsRecord:
    """$ONBOX_CONFIG_DIR/pulls.json: what was pulled from which box and run, and whether it verified."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path or os.path.join(config_dir(), "pulls.json")

    def load(self) -> Dict[str, Any]:
        """The record; one that is not a regular file, too large, too deep or not {"pulls": {BOX/RUN: {...}}}
        is refused as corrupt (the teardown gate then refuses too: it cannot prove anything was pulled)."""
        try:
            doc = read_pulls(self.path)
        except FileNotFoundError:
            return {"pulls": {}}
        except (OSError, ValueError) as e:
            raise UsageError("pulls record %s is corrupt: %s" % (self.path, untrusted.reason(e)),
                             hint="move it aside and pull again; the gate will refuse until then")
        return doc

    def get(self, box: str, run: str) -> Dict[str, Any]:
        return self.load()["pulls"].get("%s/%s" % (box, run), {})

    def record(self, box: str, run: str, dest: str, name: str, result: Dict[str, Any]) -> None:
        doc = self.load()
        entry = doc["pulls"].setdefault("%s/%s" % (box, run), {"box": box, "run": run, "checkpoints": {}})
        entry["dest"] = dest
        entry["checkpoints"][name] = result
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        atomic_write_json(self.path, doc, mode=0o600)

    def verified(self, box: str, run: str, ckpt: RemoteCheckpoint) -> Optional[Dict[str, Any]]:
        """The record proving `ckpt` (same manifest bytes) was pulled and verified, or None."""
        rec = self.get(box, run).get("checkpoints", {}).get(ckpt.name)
        if rec and rec.get("ok") and rec.get("manifest_sha256") == ckpt.manifest_sha256:
            return rec
        return None


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def verify_local(path: str, load: Optional[bool] = None) -> Dict[str, Any]:
    """Verify a pulled checkpoint on this machine with onbox's own verifier: every manifest size and hash, format
    checks (zip CRCs, safetensors bounds), and torch.load(weights_only=True) when torch is installed. `checked`
    says in words what was checked, from the verifier's own report (checked_words)."""
    from onbox.checkpoints.verify import verify_path

    auto = load is None
    load = torch_available() if load is None else load
    rep = verify_path(path, load=load).to_dict()
    if not rep.get("has_manifest"):
        rep["problems"] = [*(rep.get("problems") or []), "no MANIFEST.json: not a committed checkpoint"]
        rep["ok"] = False
    if not load:
        rep["load_note"] = "not loaded: %s" % ("torch is not installed here" if auto else "--no-load")
    return {"ok": bool(rep.get("ok")), "loaded": rep.get("loaded"), "report": rep, "checked": checked_words(rep),
            "error": "; ".join(rep.get("problems") or [])[:500] or None}


def checked_words(rep: Dict[str, Any]) -> str:
    """What a verification checked, in words, from onbox's verify report (onbox/checkpoints/verify.py): the sizes
    and hashes against MANIFEST.json, each format check by kind, the files only a hash vouches for, and the load as
    its own note says it (`loaded N file(s) with torch X`, or `not loaded: why`). Nothing it did not check."""
    from onbox.checkpoints.verify import KIND_CHECKS

    rows = [r for r in rep.get("files") or [] if isinstance(r, dict) and r.get("kind") != "uncommitted"]
    parts = []
    if rep.get("has_manifest"):
        rows_checked = (rep.get("checkpoints") or [{}])[0].get("checked") or []
        algo = rows_checked[1] if len(rows_checked) > 1 else "hash"
        parts.append("size and %s of %d file(s) against MANIFEST.json" % (algo, len(rows)))
    kinds: Dict[str, int] = {}
    for r in rows:
        if r.get("kind") in KIND_CHECKS:
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    if kinds:
        parts.append("format of %s" % ", ".join("%d %s" % (n, k) for k, n in sorted(kinds.items())))
    plain = len(rows) - sum(kinds.values())
    if plain:
        parts.append("%d file(s) of no format onbox checks (hash only)" % plain)
    if rep.get("load_note"):
        parts.append(str(rep["load_note"]))
    return "; ".join(parts) or "nothing"


class Transfer:
    """rsync from the box with retries, progress parsing and bounded attempts."""

    def __init__(self, ssh: Ssh, box: Box, clock: Optional[Clock] = None, attempts: int = 5,
                 io_timeout: int = 30, attempt_timeout: float = 3600.0, backoff: float = 1.0,
                 progress: Optional[Callable[[str, int, str], None]] = None, bwlimit_kbps: Optional[int] = None) -> None:
        self.ssh, self.box, self.clock = ssh, box, clock or SystemClock()
        self.attempts, self.io_timeout, self.attempt_timeout, self.backoff = attempts, io_timeout, attempt_timeout, backoff
        self.progress = progress
        self.bwlimit_kbps = bwlimit_kbps

    def fetch(self, label: str, sources: List[str], dest: str, extra: List[str]) -> int:
        """Copy with retries; returns the number of attempts used. Raises JobFailed after the last one."""
        os.makedirs(dest, exist_ok=True)
        last = ""
        for attempt in range(1, self.attempts + 1):
            try:
                self._once(label, sources, dest, extra)
                return attempt
            except UnfitError:  # rsync or ssh not installed here: no retry brings them
                raise
            except OnboxError as e:
                last = e.message
                if attempt < self.attempts:
                    self.clock.sleep(min(30.0, self.backoff * 2 ** (attempt - 1)))
        raise JobFailed("pulling %s from %s failed after %d attempts: %s" % (label, self.box.name, self.attempts, last),
                        hint="run the same pull again: it resumes from what already arrived")

    def _once(self, label: str, sources: List[str], dest: str, extra: List[str]) -> None:
        target = self.box.target()
        self.ssh.ensure_master(target)
        argv = self.ssh.rsync_argv(target, sources, dest, upload=False, io_timeout=self.io_timeout,
                                   extra=["--partial-dir=" + PARTIAL_DIR, "--info=progress2", "--no-inc-recursive",
                                          *(["--bwlimit=%d" % self.bwlimit_kbps] if self.bwlimit_kbps else []),
                                          *extra])
        done = RSYNC_FROM.run(argv, self.attempt_timeout, check=False, stdin=DEVNULL, new_session=True,
                              on_line=functools.partial(self._line, label), label=label, box=self.box.name)
        err = done.stderr.strip()
        if rsync_lost_link(done.returncode, err):
            raise unreachable(target, err or "rsync exited %d" % done.returncode)
        RSYNC_FROM.check(done, label=label, box=self.box.name)

    def _line(self, label: str, line: str) -> None:
        m = PROGRESS_RE.match(line)
        if m and self.progress:
            self.progress(label, int(m.group(2)), m.group(3))


def verified_line(name: str, v: Dict[str, Any]) -> str:
    """`verified NAME: OK (what was checked)` or `verified NAME: FAILED: the problems (what was checked)`."""
    checked = " (checked: %s)" % v["checked"] if v.get("checked") else ""
    return "verified %s: %s%s" % (name, "OK" if v.get("ok") else "FAILED: %s" % v.get("error"), checked)


@dataclasses.dataclass
class PullReport:
    box: str
    run: str
    dest: str
    checkpoints: List[Dict[str, Any]]
    newest: Optional[str]
    ok: bool
    seconds: float

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def pull_run(ssh: Ssh, box: Box, run: str, dest: str, latest_only: bool = False, verify: bool = True,
             load: Optional[bool] = None, transfer: Optional[Transfer] = None, record: Optional[PullsRecord] = None,
             say: Callable[[str], None] = lambda m: None,
             verifier: Optional[Callable[[str, Optional[bool]], Dict[str, Any]]] = None) -> PullReport:
    """Copy the run's committed checkpoints, index and logs to dest/<run>/, verify each, record the outcome."""
    t0 = time.monotonic()
    info = remote_run(ssh, box, run)
    if not info.get("exists"):
        raise UsageError("no run %r on box %s" % (run, box.name), hint="list runs with `onboxctl status`")
    durable = info.get("durable")
    if not durable:
        raise UsageError("run %s on %s has no durable storage configured: nothing is committed to pull" % (run, box.name),
                         hint="launch with --durable PATH (the box's persistent disk) so checkpoints outlive it")
    if not info.get("run_root"):
        raise UsageError("run %s commits to %s, an rclone remote: pull it from there with rclone" % (run, durable))
    ckpts: List[RemoteCheckpoint] = info["checkpoints"]
    if not ckpts:  # why, in the agent's words: a live run may still commit at its next sync, an ended one will not
        raise JobFailed("run %s on %s (%s) has no committed checkpoint: %s" % (
            run, box.name, info.get("state") or "?", info["nothing_committed"]),
            hint="a live run commits a complete checkpoint at its next sync (now: `onbox sync %s --now` on the box); "
                 "for one that ended, fix what the line says and the same `onboxctl run` line resumes it" % run)
    top = newest(ckpts)
    wanted = [top] if latest_only and top else sorted(ckpts, key=lambda c: (c.step if isinstance(c.step, int) else -1, c.name))
    root = info["run_root"].rstrip("/")
    local_root = os.path.join(os.path.abspath(dest), run)
    tr = transfer or Transfer(ssh, box)
    record = record or PullsRecord()
    results = []
    for c in wanted:
        assert c is not None
        local = os.path.join(local_root, "checkpoints", c.name)
        src = "%s/checkpoints/%s/" % (root, c.name)
        say("pulling %s (%s)" % (c.name, "step %s" % c.step if c.step is not None else "no step"))
        # payload first, manifest last: locally too, a checkpoint without its manifest is not there yet
        try:
            tries = tr.fetch(c.name, [src], local + "/", ["--exclude=/MANIFEST.json"])
            tr.fetch(c.name + " manifest", [src + "MANIFEST.json"], local + "/", [])
        except OnboxError as e:
            if c is top:
                raise
            # an older checkpoint may be retired by the box's retention while we pull: the newest is what counts
            say("skipped %s: %s" % (c.name, e.message))
            continue
        # the hash of the manifest we HAVE (the box may have re-committed since it was listed)
        with open(os.path.join(local, "MANIFEST.json"), "rb") as f:
            local_manifest = hashlib.sha256(f.read()).hexdigest()
        result: Dict[str, Any] = {"name": c.name, "step": c.step, "manifest_sha256": local_manifest,
                                  "path": local, "attempts": tries, "pulled_at": time.time()}
        if verify:
            v = (verifier or verify_local)(local, load)
            result.update(ok=v["ok"], loaded=v.get("loaded"), checked=v.get("checked"), error=v.get("error"),
                          verified_at=time.time())
            say(verified_line(c.name, v))
        else:
            result.update(ok=False, error="not verified (--no-verify)")
        record.record(box.name, run, local_root, c.name, result)
        results.append(result)
    extra: List[str] = []
    for label, src in (("index", root + "/checkpoints_index.json"), ("logs", root + "/logs/")):
        if not info.get("has_" + label):
            continue
        try:
            tr.fetch(label, [src], local_root + ("/logs/" if label == "logs" else "/"), extra)
        except OnboxError as e:  # the index and logs are a convenience; checkpoints are what the gate needs
            say("could not pull the %s: %s" % (label, e.message))
    ok = all(r.get("ok") for r in results)
    return PullReport(box=box.name, run=run, dest=local_root, checkpoints=results,
                      newest=top.name if top else None, ok=ok, seconds=round(time.monotonic() - t0, 3))
