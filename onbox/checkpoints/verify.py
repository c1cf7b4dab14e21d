"""Verify a checkpoint: manifest sizes and hashes, format checks without torch, and optionally a real load.

U33: "synced" in a log proves nothing; trust the artifact you loaded.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional

from onbox import fsutil
from onbox.checkpoints import MANIFEST, formats, hashcopy

TORCH_SUFFIXES = formats.TORCH_SUFFIXES


@dataclasses.dataclass
class VerifyReport:
    path: str
    has_manifest: bool
    files: List[Dict[str, Any]]  # {path, size, kind, ok, problem}
    problems: List[str]  # "file: what is wrong"
    loaded: Optional[bool] = None  # None: --load not asked or torch absent
    load_note: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def check_manifest_files(ckpt_dir: str, manifest: Dict[str, Any], formats_too: bool = True,
                         rows: Optional[List[Dict[str, Any]]] = None) -> List[str]:
    """Every file the manifest lists: present, the right size, the right hash (and formats when asked).

    The hash of one file and the CRC pass of another run in parallel threads (hashlib and zlib release the GIL
    on large buffers), so a verify costs about one hash pass of wall time on a box with two cores or more.
    """
    from concurrent.futures import ThreadPoolExecutor

    problems = []
    algo = manifest.get("hash", hashcopy.HASH_NAME)
    entries = [e for e in manifest.get("files", []) if isinstance(e, dict)]
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        jobs = []
        for entry in entries:
            path = os.path.join(ckpt_dir, entry.get("path", ""))
            ok_size = os.path.isfile(path) and os.path.getsize(path) == entry.get("size")
            jobs.append((pool.submit(hashcopy.hash_file, path, algo) if ok_size else None,
                         pool.submit(formats.check_file, path, True) if ok_size and formats_too else None))
        for entry, (hash_job, format_job) in zip(entries, jobs):
            rel = entry.get("path", "")
            path = os.path.join(ckpt_dir, rel)
            row: Dict[str, Any] = {"path": rel, "size": entry.get("size"), "kind": "", "ok": True, "problem": None}
            problem = None
            if not os.path.isfile(path):
                problem = "missing"
            elif hash_job is None:
                problem = "size %d, manifest says %s (truncated or replaced)" % (os.path.getsize(path), entry.get("size"))
            elif hash_job.result()[1] != entry.get(algo, entry.get("hash")):
                problem = "%s mismatch (content corrupted)" % algo
            elif format_job is not None:
                res = format_job.result()
                row["kind"] = res.kind
                problem = res.problem
            if problem:
                problems.append("%s: %s" % (rel, problem))
                row.update(ok=False, problem=problem)
            if rows is not None:
                rows.append(row)
    return problems


def committed_dirs(path: str) -> Optional[List[str]]:
    """When `path` is a durable run dir (<run>/ with checkpoints/) or its checkpoints/ dir: every checkpoint
    dir in it (committed or not); else None."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST)):
        return None
    ckpts = os.path.join(path, "checkpoints")
    root = ckpts if os.path.isdir(ckpts) else path
    subdirs = sorted(os.path.join(root, n) for n in os.listdir(root)
                     if not n.startswith(".") and os.path.isdir(os.path.join(root, n)))
    if root == path and not any(os.path.exists(os.path.join(d, MANIFEST)) for d in subdirs):
        return None  # a plain checkpoint dir (HF checkpoint-N/ ...), not a durable layout
    return subdirs


def verify_path(path: str, load: bool = False) -> VerifyReport:
    """Verify a committed checkpoint dir (with MANIFEST.json), a durable run dir (every committed checkpoint in
    it), a plain checkpoint dir, or one file."""
    path = os.path.abspath(path)
    many = committed_dirs(path)
    if many is not None:
        report = VerifyReport(path=path, has_manifest=True, files=[], problems=[])
        loaded = []
        for d in many:
            rel = os.path.relpath(d, path)
            if not os.path.exists(os.path.join(d, MANIFEST)):  # not committed: does not exist for readers
                report.files.append({"path": rel, "size": None, "kind": "uncommitted", "ok": True,
                                     "problem": "no MANIFEST.json (interrupted commit): ignored"})
                continue
            sub = verify_path(d, load=load)
            report.files += [dict(r, path=os.path.join(rel, r["path"])) for r in sub.files]
            report.problems += [os.path.join(rel, p) for p in sub.problems]
            loaded.append(sub.loaded)
            if sub.load_note:
                report.load_note = sub.load_note
        if not any(os.path.exists(os.path.join(d, MANIFEST)) for d in many):
            report.problems.append("%s: no committed checkpoint (no MANIFEST.json anywhere)" % path)
        if load and loaded:
            report.loaded = all(x is not False for x in loaded) if any(x is not None for x in loaded) else None
        return report
    rows: List[Dict[str, Any]] = []
    problems: List[str] = []
    manifest_path = os.path.join(path, MANIFEST)
    has_manifest = os.path.isdir(path) and os.path.exists(manifest_path)
    if has_manifest:
        try:
            manifest = fsutil.read_json(manifest_path)
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
                raise ValueError("no file list")
        except (OSError, ValueError) as e:
            problems.append("%s: unreadable manifest: %s" % (MANIFEST, e))
            manifest = {"files": []}
        problems += check_manifest_files(path, manifest, formats_too=True, rows=rows)
        files = [os.path.join(path, r["path"]) for r in rows]
    else:
        if os.path.isdir(path):
            from onbox.checkpoints.detect import _walk_files

            files = [os.path.join(path, r) for r in _walk_files(path)]
            if not files:
                problems.append("%s: empty directory" % path)
        else:
            files = [path]
        for f in files:
            rel = os.path.relpath(f, path) if os.path.isdir(path) else os.path.basename(f)
            res = formats.check_file(f, full=True)
            rows.append({"path": rel, "size": os.path.getsize(f) if os.path.exists(f) else None,
                         "kind": res.kind, "ok": res.ok, "problem": res.problem})
            if res.problem:
                problems.append("%s: %s" % (rel, res.problem))
    report = VerifyReport(path=path, has_manifest=has_manifest, files=rows, problems=problems)
    if load and not problems:
        _load_with_torch(report, [f for f in files if f.endswith((*TORCH_SUFFIXES, ".safetensors"))])
    return report


def _load_with_torch(report: VerifyReport, files: List[str]) -> None:
    try:
        import torch  # the box's own torch (U28): never installed by onbox
    except ImportError:
        report.load_note = "torch is not importable here; format and hash checks only"
        return
    refused = []
    for f in files:
        try:
            if f.endswith(".safetensors"):
                try:
                    from safetensors.torch import load_file
                except ImportError:
                    continue
                load_file(f)
            elif formats.sniff(f) == "zip" or f.endswith(TORCH_SUFFIXES):
                torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # any load failure is the finding we report, with its type
            if "Unsupported global" in str(e) or ("weights_only" in str(e) and "GLOBAL" in str(e)):
                # not corruption: the file pickles Python objects (HF training_args.bin, numpy RNG state), which
                # weights_only=True refuses by design
                refused.append(os.path.basename(f))
                continue
            report.problems.append("%s: torch.load(weights_only=True) failed: %s: %s" % (
                os.path.basename(f), type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
            report.loaded = False
            return
    report.loaded = True
    report.load_note = "loaded %d file(s) with torch %s" % (len(files) - len(refused), torch.__version__)
    if refused:
        report.load_note += "; weights_only refused (Python objects, not corruption): %s" % ", ".join(refused)
