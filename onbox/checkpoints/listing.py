"""What `onbox checkpoints --json` says of a run (schema onbox.checkpoints/1): its local checkpoints (complete or
why not), the committed ones, and, on a mounted durable target, every MANIFEST.json byte for byte. onboxctl pull
and its teardown gate read this over ssh instead of sending a script of their own (onbox/commands/README.md, "What onboxctl
reads", lists the fields). Fields are added, never renamed. `nothing_committed`: one line, why the run has no
committed checkpoint (local/whynone.py), None when it has one.

`manifests` is not `committed`: it lists every checkpoint dir whose MANIFEST.json is a regular file of at most
MANIFEST_MAX_BYTES, also one this box refuses (`problem` says why; step and time then read leniently), with the
sha256 of the manifest's bytes. The gate needs that: a refused newest checkpoint must block a teardown until it is
pulled and verified (or abandoned), never leave an older one looking like the newest.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List, Optional

from onbox import fsutil, paths, untrusted, vocab
from onbox.checkpoints import INDEX, MANIFEST
from onbox.checkpoints.durable import manifest

SCHEMA = vocab.SCHEMA_CHECKPOINTS
LIST_SCHEMA = vocab.SCHEMA_CHECKPOINTS_LIST  # `--all`: {"schema", "runs": [one onbox.checkpoints/1 document a run]}


def trainer_alive(run_dir: str) -> bool:
    """The run's child (the trainer) is alive now: its pid and start time in state.json match a process."""
    from onbox.proc import is_alive

    try:
        state = fsutil.read_json(os.path.join(run_dir, paths.STATE_FILE))
    except (OSError, ValueError):
        return False
    if not isinstance(state, dict) or not isinstance(state.get("child_pid"), int):
        return False
    return is_alive(state["child_pid"], state.get("child_start_time"))


def run_listing(ctx: Any, ask_remote: bool = True, state: Optional[Dict[str, Any]] = None,
                node: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The onbox.checkpoints/1 document of the run `ctx` (a RunContext). Reads only: checkpoint_status.json
    belongs to the live agent (a read-modify-write from here could put back a stale last_sync). `ask_remote`:
    list what an rclone remote holds (`committed`); without it `committed` is None for a remote target. `state`
    (state.json) and `node` ({rank, run, nnodes} of a multi-node group's node) come from the caller."""
    from onbox.checkpoints.durable.localpath import LocalPathTarget
    from onbox.checkpoints.hook import CheckpointCommitHook
    from onbox.checkpoints.local import whynone
    from onbox.checkpoints.local.completion import CompletionTracker, read_progress
    from onbox.checkpoints.local.detect import CheckpointDirTooLarge, ScanBound, Selection, scan

    hook = CheckpointCommitHook(ctx)
    writing = trainer_alive(ctx.run_dir)
    # with no trainer alive nothing is being written: what fails a check is torn, what lacks its last file
    # stays incomplete, and nothing is "still changing"
    problem = None
    try:
        found = scan(ctx.ckpt_dir, ScanBound.of(ctx.config), select=Selection.of(ctx.config))
    except CheckpointDirTooLarge as too_large:
        found, problem = [], str(too_large)
    cands = CompletionTracker(ctx.config.settle_seconds if writing else 0.0).update(
        found, ctx.clock.monotonic(), ctx.clock.time(), read_progress(ctx))
    local: List[Dict[str, Any]] = [{"name": c.name, "path": c.path, "step": c.step, "bytes": c.bytes,
                                    "complete": c.complete, "reason": c.reason, "format": c.format,
                                    "complete_by": c.complete_by} for c in cands]
    mounted = hook.target if isinstance(hook.target, LocalPathTarget) else None
    committed: Optional[List[Dict[str, Any]]] = []
    if hook.committer is not None and (mounted is not None or ask_remote):
        committed = hook.committer.committed()
    elif hook.committer is not None:
        committed = None  # an rclone remote, not asked: `onbox checkpoints NAME` asks it
    root = mounted.run_root if mounted is not None else None
    doc = blank(ctx.name, state)
    doc.update(ckpt_dir=ctx.ckpt_dir, durable=ctx.config.durable, local=local, committed=committed,
               status=hook.status, trainer_alive=writing, local_problem=problem, node=node)
    if committed == [] and not (hook.status or {}).get("latest_durable"):  # why, in words (local/whynone.py)
        select = Selection.of(ctx.config)
        doc["nothing_committed"] = whynone.nothing_committed(
            hook.target.url if hook.target else None, hook.status, problem or whynone.explain(
                ctx.ckpt_dir, whynone.survey(ctx.ckpt_dir, select, cands), select))
    if root is not None:  # a mounted path: what pull copies from, and every manifest on it
        doc.update(durable_root=root, has_index=os.path.isfile(os.path.join(root, INDEX)),
                   has_logs=os.path.isdir(os.path.join(root, "logs")),
                   manifests=durable_manifests(os.path.join(root, "checkpoints")))
    return doc


def blank(run: str, state: Optional[Dict[str, Any]], problem: Optional[str] = None) -> Dict[str, Any]:
    """Every field of the document, empty: what `--all` says of a run it cannot read (`problem` says why).
    `state`: the run's state.json (the caller reads it: this package never reads the supervisor's files)."""
    return {"schema": SCHEMA, "run": run, "state": (state or {}).get("state"), "problem": problem,
            "ckpt_dir": None, "durable": None, "durable_root": None, "has_index": False, "has_logs": False,
            "node": None, "local": [], "local_problem": None, "trainer_alive": False, "committed": [],
            "manifests": [], "status": {}, "nothing_committed": None}


def durable_manifests(ckpts: str) -> List[Dict[str, Any]]:
    """Every checkpoint dir under `ckpts` with a MANIFEST.json that is a regular file of at most
    MANIFEST_MAX_BYTES, oldest name first: {name, manifest_sha256, step, created, bytes, problem}."""
    try:
        names = sorted(n for n in os.listdir(ckpts) if not n.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        try:
            raw = untrusted.read_bytes(os.path.join(ckpts, name, MANIFEST), untrusted.MANIFEST_MAX_BYTES, MANIFEST)
        except (OSError, ValueError):  # none (or a dir), a FIFO, a device, too large: no committed checkpoint
            continue
        out.append(manifest_row(name, raw))
    return out


def manifest_row(name: str, raw: bytes) -> Dict[str, Any]:
    """One checkpoint as `manifests` lists it; a refused manifest keeps what can be read of its step and time."""
    problem = None
    try:
        doc: Any = manifest.parse(raw, name)
    except manifest.BadManifest as e:
        problem = str(e)
        try:
            doc = untrusted.loads_json(raw, MANIFEST)
        except ValueError:
            doc = {}
    doc = doc if isinstance(doc, dict) else {}
    files = doc.get("files") if isinstance(doc.get("files"), list) else []
    sizes = [f.get("size") for f in files if isinstance(f, dict)]
    step, created = doc.get("step"), doc.get("created")
    return {"name": name, "manifest_sha256": hashlib.sha256(raw).hexdigest(),
            "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "created": created if isinstance(created, (int, float)) and not isinstance(created, bool) else None,
            "bytes": sum(n for n in sizes if isinstance(n, int) and not isinstance(n, bool)),
            "problem": problem}
