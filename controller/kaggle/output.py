"""A Kaggle run's output brought home (`onboxctl kaggle pull`) and what its session said (`onboxctl kaggle status`).

`kaggle kernels output` downloads the newest version's output; only the run's committed tree
(`onbox-durable/<run>/`) and the session's outcome (`onbox-kaggle.json`) are asked for (--file-pattern). They land
in a staging dir beside DEST, then each committed checkpoint (one with its MANIFEST.json) moves to
DEST/<run>/checkpoints/<name>/ (the layout `onboxctl pull` writes), is verified here with onbox's own verifier
(sizes and hashes against the manifest, format checks, a torch load when torch is installed) and recorded in the
pulls record under the box `kaggle:<owner>` (a name no inventory box can have), like every pull.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import time
from typing import Any, Callable, Dict, List, Optional

from controller.kaggle.cli import KaggleCli
from controller.kaggle.kernel_main import DURABLE_DIR, LOG_PREFIX, OUTCOME_FILE, OUTCOME_SCHEMA
from controller.results.pull import PullReport, PullsRecord, verified_line, verify_local
from onbox import untrusted
from onbox.errors import JobFailed

MANIFEST = "MANIFEST.json"


def box_of(owner: str) -> str:
    """The pulls record's box for a Kaggle owner's kernels."""
    return "kaggle:" + owner


def outcome_in_log(lines: List[str]) -> Optional[Dict[str, Any]]:
    """The session's outcome from its log: the last `onbox-kaggle: {...}` line kernel_main.py printed."""
    for line in reversed(lines):
        if line.startswith(LOG_PREFIX + "{"):
            try:
                doc = untrusted.loads_json(line[len(LOG_PREFIX):], "the session's outcome line")
            except ValueError:  # malformed, or nested past the bound
                return None
            return doc if isinstance(doc, dict) and doc.get("schema") == OUTCOME_SCHEMA else None
    return None


def _step(manifest_path: str) -> Optional[int]:
    try:
        step = untrusted.read_json(manifest_path, untrusted.MANIFEST_MAX_BYTES, "manifest").get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def output_pattern(run: str) -> str:
    """The --file-pattern of a pull: the run's committed tree and the session's outcome, and no name with a `.` or
    `..` part, an empty part, a backslash or a control character. The kaggle CLI joins each listed name to the
    download dir; the names come from the kernel's output, which the session's code (the trainer, anything it
    installs) writes: one leading out of DEST is never even fetched (the pinned CLI refuses such a name too, but
    by failing the whole download)."""
    part = r"(?!\.\.?(?:/|\Z))[^/\\\x00-\x1f\x7f-\x9f]+"
    return r"\A(?:%s/%s(?:/%s)+|%s)\Z" % (re.escape(DURABLE_DIR), re.escape(run), part, re.escape(OUTCOME_FILE))


def check_tree(root: str) -> None:
    """What a download left under `root` is regular files and directories only, all of them inside it (JobFailed
    naming the first that is not: nothing of it is moved into DEST)."""
    real = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) or not untrusted.is_under(path, real):
                raise JobFailed("the downloaded output holds %s, which is no plain file: nothing was moved into "
                                "the destination" % untrusted.printable(os.path.relpath(path, root)),
                                hint="see what the session wrote to /kaggle/working (onboxctl kaggle logs)")


def _replace(src: str, dst: str, aside: str) -> None:
    """dst becomes src; what was at dst goes to `aside` (inside the staging dir, removed with it)."""
    if os.path.lexists(dst):
        os.rename(dst, aside)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)


def pull(cli: KaggleCli, ref: str, owner: str, run: str, dest: str, load: Optional[bool] = None,
         record: Optional[PullsRecord] = None, say: Callable[[str], None] = lambda m: None) -> PullReport:
    """Download the newest version's committed run, verify each checkpoint, record the outcome."""
    t0 = time.monotonic()
    dest_root = os.path.abspath(dest)
    local_root = os.path.join(dest_root, run)
    staging = os.path.join(dest_root, ".onbox-kaggle-" + run)
    if os.path.lexists(staging):
        shutil.rmtree(staging)  # what an interrupted pull of this run left: fetched anew
    os.makedirs(staging)
    try:
        say("downloading the output of %s (the run's committed tree only)" % ref)
        cli.output(ref, staging, output_pattern(run))
        check_tree(staging)
        tree = os.path.join(staging, DURABLE_DIR, run)
        ckpt_root = os.path.join(tree, "checkpoints")
        names = sorted(n for n in os.listdir(ckpt_root) if os.path.isfile(os.path.join(ckpt_root, n, MANIFEST))) \
            if os.path.isdir(ckpt_root) else []
        if not names:
            raise JobFailed("the newest output of %s holds no committed checkpoint of run %s" % (ref, run),
                            hint="see how its session ended: onboxctl kaggle status %s" % run)
        record = record or PullsRecord()
        results = []
        for name in names:
            if untrusted.name_problem(name):
                continue
            # one name (listed, checked): it cannot lead out of DEST; DEST's own symlinks are the user's choice
            staged, local = os.path.join(ckpt_root, name), os.path.join(local_root, "checkpoints", name)
            fresh = _sha256(os.path.join(staged, MANIFEST))
            if not (os.path.isfile(os.path.join(local, MANIFEST)) and _sha256(os.path.join(local, MANIFEST)) == fresh):
                _replace(staged, local, os.path.join(staging, "replaced-" + name))
            step = _step(os.path.join(local, MANIFEST))
            v = verify_local(local, load)
            say(untrusted.printable(verified_line(name, v)))  # the manifest's names are the session's
            result = {"name": name, "step": step, "manifest_sha256": fresh, "path": local, "attempts": 1,
                      "pulled_at": time.time(), "ok": v["ok"], "loaded": v.get("loaded"), "checked": v.get("checked"),
                      "error": v.get("error"), "verified_at": time.time(), "kernel": ref}
            record.record(box_of(owner), run, local_root, name, result)
            results.append(result)
        for rel in ("checkpoints_index.json", "logs"):
            if os.path.lexists(os.path.join(tree, rel)):
                _replace(os.path.join(tree, rel), os.path.join(local_root, rel), os.path.join(staging, "old-" + rel))
        if os.path.isfile(os.path.join(staging, OUTCOME_FILE)):
            os.replace(os.path.join(staging, OUTCOME_FILE), os.path.join(local_root, OUTCOME_FILE))
        logs = [n for n in os.listdir(staging) if n.endswith(".log")]
        if logs:  # the session's log, which `kaggle kernels output` always writes as <slug>.log
            os.replace(os.path.join(staging, logs[0]), os.path.join(local_root, "kaggle-session.log"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    newest = max(results, key=lambda r: (r["step"] if isinstance(r["step"], int) else -1, r["name"]))
    return PullReport(box=box_of(owner), run=run, dest=local_root, checkpoints=results, newest=newest["name"],
                      ok=all(r["ok"] for r in results), seconds=round(time.monotonic() - t0, 3))
