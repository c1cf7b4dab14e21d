"""Verify a checkpoint: manifest sizes and hashes, format checks without torch, and optionally a real load.

U33: "synced" in a log proves nothing; trust the artifact you checked. The report says "ok" only about what was
checked: a directory without MANIFEST.json is not a committed checkpoint (onbox writes the manifest last, so
without it the copy may be partial), a file of no checkable format is not verified by a look at it, and a load
that was asked for but could not run (no torch) is not a load that passed.
"""
from __future__ import annotations

import dataclasses
import os
import stat
from typing import Any, Dict, List, Optional, Tuple

from onbox import untrusted
from onbox.checkpoints import MANIFEST, formats
from onbox.checkpoints.durable import hashcopy
from onbox.checkpoints.durable import manifest as manifest_mod
from onbox.checkpoints.formats import stepread
from onbox.checkpoints.local.detect import walk_files
from onbox.errors import UsageError

TORCH_SUFFIXES = formats.TORCH_SUFFIXES
NO_MANIFEST = ("no MANIFEST.json: not a committed checkpoint (onbox writes the manifest last; without it the copy "
               "may be partial)")
KIND_CHECKS = {  # what check_file(full=True) looked at, per kind, for the report
    "torch-zip": "torch zip: central directory, CRC-32 of every member, data.pkl and its storages",
    "torch-legacy": "torch pickle: header pickles, object pickle, every storage record (the format has no checksums)",
    "safetensors": "safetensors: header and buffer bounds",
    "json": "JSON: parses",
    "zip": "zip: central directory and CRC-32 of every member",
}


@dataclasses.dataclass
class VerifyReport:
    path: str
    has_manifest: bool
    files: List[Dict[str, Any]]  # {path, size, kind, ok, problem, note}
    problems: List[str]  # "file: what is wrong"
    loaded: Optional[bool] = None  # True: at least one file loaded. None: --load not asked, not possible, nothing
    # to load (no torch or safetensors file, or weights_only refused each one), or not reached
    load_note: str = ""
    load_unavailable: bool = False  # --load was asked and torch could not be imported (and --no-load-ok was not)
    step: Optional[int] = None  # the step the checkpoint records about itself (stepread), when it does
    step_source: Optional[str] = None  # e.g. "ckpt.pt:iter_num", "trainer_state.json:global_step"
    manifest_step: Optional[int] = None  # the step MANIFEST.json records, when there is one
    checked: List[str] = dataclasses.field(default_factory=list)  # what was checked, in words
    # one row per committed checkpoint checked (name, manifest digest, ok, problems, checked): what `onbox verify`
    # records in checkpoints_index.json. A load that could not run (no torch here) is not a problem of the
    # checkpoint: its row says what was checked instead.
    checkpoints: List[Dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def check_manifest_files(ckpt_dir: str, manifest: Dict[str, Any], formats_too: bool = True,
                         rows: Optional[List[Dict[str, Any]]] = None) -> List[str]:
    """Every file the manifest lists: present, the right size, the right hash (and formats when asked: the full
    check, every zip member's CRC too). See manifest_mod.check_files."""
    return manifest_mod.check_files(ckpt_dir, manifest, _full_format_check if formats_too else None, rows)


def _full_format_check(path: str) -> Tuple[str, str, Optional[str]]:
    res = formats.check_file(path, True)
    return res.kind, res.note or ("" if res.kind in KIND_CHECKS else "hash only"), res.problem


KERNEL_FILESYSTEMS = ("/proc", "/sys", "/dev")


def path_problem(path: str) -> Optional[str]:
    """Why `path` cannot be a checkpoint at all, in one line (a FIFO would hang the read, /proc/self would list
    every kernel file as a problem), or None."""
    real = os.path.realpath(path)
    for top in KERNEL_FILESYSTEMS:
        if real == top or real.startswith(top + "/"):
            return "%s is on the kernel's %s filesystem" % (real, top)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # the checks below say what is missing or unreadable
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return "it is %s" % untrusted.describe_mode(mode)
    return None


def _not_regular(top: str) -> int:
    """Entries under `top` that walk_files leaves out and a checkpoint never holds."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(top):
        for fn in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, fn)
            if os.path.islink(full) or not os.path.isfile(full):
                n += 1
    return n


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


def verify_path(path: str, load: bool = False, no_load_ok: bool = False) -> VerifyReport:
    """Verify a committed checkpoint dir (with MANIFEST.json), a durable run dir (every committed checkpoint in
    it), or one file. A dir without a manifest gets its format checks listed and fails: it is not committed.
    `load`: also torch.load every torch/safetensors file; without an importable torch that is a problem unless
    `no_load_ok` (then the report says the checks were format and hash only)."""
    path = os.path.abspath(path)
    problem = path_problem(path)
    if problem:
        raise UsageError("%s is not a checkpoint: %s" % (path, problem),
                         hint="give a committed checkpoint dir, a checkpoint file or a durable run dir")
    many = committed_dirs(path)
    if many is not None:
        return _verify_run_dir(path, many, load, no_load_ok)
    rows: List[Dict[str, Any]] = []
    problems: List[str] = []
    checked: List[str] = []
    manifest_path = os.path.join(path, MANIFEST)
    has_manifest = os.path.isdir(path) and os.path.exists(manifest_path)
    if has_manifest:
        try:
            manifest = manifest_mod.parse(untrusted.read_bytes(manifest_path, untrusted.MANIFEST_MAX_BYTES,
                                                               MANIFEST))
        except manifest_mod.BadManifest as e:  # the message names the field that is wrong
            problems.append(str(e))
            manifest = {"files": []}
        except (OSError, ValueError) as e:
            problems.append("%s: unreadable: %s" % (MANIFEST, e))
            manifest = {"files": []}
        problems += check_manifest_files(path, manifest, formats_too=True, rows=rows)
        checked.append("size and %s of %d file(s) against %s" % (
            manifest.get("hash", hashcopy.HASH_NAME), len(rows), MANIFEST))
        files = [os.path.join(path, r["path"]) for r in rows]
    else:
        files = [os.path.join(path, r) for r in walk_files(path)] if os.path.isdir(path) else [path]
        skipped = _not_regular(path) if os.path.isdir(path) else 0
        if skipped:
            problems.append("%s: %d entr%s neither a regular file nor a directory (symlink, FIFO, device, "
                            "socket): not checked" % (os.path.basename(path), skipped, "y is" if skipped == 1
                                                      else "ies are"))
        for f in files:
            rel = os.path.relpath(f, path) if os.path.isdir(path) else os.path.basename(f)
            res = formats.check_file(f, full=True)
            rows.append({"path": rel, "size": os.path.getsize(f) if os.path.exists(f) else None, "kind": res.kind,
                         "ok": res.ok, "problem": res.problem, "note": res.note})
            if res.problem:
                problems.append("%s: %s" % (rel, res.problem))
        if os.path.isdir(path):
            problems.append("%s: %s" % (os.path.basename(path) or path, NO_MANIFEST))
            if not files:
                problems.append("%s: empty directory" % path)
        elif rows and rows[0]["ok"] and rows[0]["kind"] not in KIND_CHECKS:
            problems.append("%s: nothing to verify: not a format onbox can check (torch, safetensors, JSON, zip), "
                            "and a single file has no manifest to hash it against" % rows[0]["path"])
    kinds = sorted({r["kind"] for r in rows if r["kind"] in KIND_CHECKS})
    checked += [KIND_CHECKS[k] for k in kinds]
    reading = (stepread.step_of_dir(path) if os.path.isdir(path) else stepread.step_of_file(path))
    report = VerifyReport(path=path, has_manifest=has_manifest, files=rows, problems=problems, checked=checked,
                          step=reading.step if reading else None, step_source=reading.source if reading else None,
                          manifest_step=manifest.get("step") if has_manifest else None)
    if load:
        if problems:
            report.load_note = "not loaded: the checks above failed"
        else:
            _load_with_torch(report, [f for f in files if f.endswith((*TORCH_SUFFIXES, ".safetensors"))],
                             no_load_ok)
    if has_manifest:
        own = report.problems[:-1] if report.load_unavailable else report.problems
        report.checkpoints = [{"name": os.path.basename(path), "digest": manifest.get("digest"), "ok": not own,
                               "problems": list(own),
                               "checked": ["size", manifest.get("hash", hashcopy.HASH_NAME), "format"]
                               + (["load"] if report.loaded else [])}]
    return report


def _verify_run_dir(path: str, many: List[str], load: bool, no_load_ok: bool) -> VerifyReport:
    """Every committed checkpoint in a durable run dir; manifest-less dirs are listed as uncommitted."""
    report = VerifyReport(path=path, has_manifest=True, files=[], problems=[])
    loaded = []
    committed = 0
    unloadable = ""
    for d in many:
        rel = os.path.relpath(d, path)
        if not os.path.exists(os.path.join(d, MANIFEST)):  # not committed: does not exist for readers
            report.files.append({"path": rel, "size": None, "kind": "uncommitted", "ok": True, "note": "",
                                 "problem": "no MANIFEST.json (interrupted commit): ignored"})
            continue
        committed += 1
        sub = verify_path(d, load=load, no_load_ok=no_load_ok)
        report.checkpoints += sub.checkpoints
        report.files += [dict(r, path=os.path.join(rel, r["path"])) for r in sub.files]
        if sub.load_unavailable:  # its one problem (the load is tried only after every check passed): said once
            unloadable = sub.problems[-1]
        else:
            report.problems += [os.path.join(rel, p) for p in sub.problems]
        report.checked += [c for c in sub.checked if c not in report.checked]
        report.load_unavailable = report.load_unavailable or sub.load_unavailable
        loaded.append(sub.loaded)
        if sub.load_note:
            report.load_note = sub.load_note
    if unloadable:
        report.problems.append(unloadable)
    if not committed:
        report.problems.append("%s: no committed checkpoint (no MANIFEST.json anywhere)" % path)
    else:
        report.checked.insert(0, "%d committed checkpoint(s)" % committed)
    if load and loaded:
        report.loaded = all(x is not False for x in loaded) if any(x is not None for x in loaded) else None
    return report


def _load_with_torch(report: VerifyReport, files: List[str], no_load_ok: bool) -> None:
    if not files:  # a load that loads nothing is no load: never "loaded" (U33: say only what was checked)
        report.load_note = "not loaded: no torch or safetensors file to load"
        return
    missing = []
    try:
        import torch  # the box's own torch (U28): never installed by onbox
    except ImportError as e:  # any failure to import it (absent, broken install, CUDA mismatch) is the same here
        missing.append("torch is not importable here (%s: %s)" % (type(e).__name__, e))
    if any(f.endswith(".safetensors") for f in files):
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            missing.append("safetensors.torch is not importable here (%s: %s)" % (type(e).__name__, e))
    if missing:
        why = "; ".join(missing)
        if no_load_ok:
            report.load_note = "not loaded: %s; --no-load-ok: format and hash checks only" % why
        else:
            report.load_unavailable = True
            report.load_note = "not loaded: %s" % why
            report.problems.append("%s: --load asked for a load, but %s" % (os.path.basename(report.path), why))
        return
    refused = []
    for f in files:
        try:
            if f.endswith(".safetensors"):
                load_file(f)
            else:
                torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # any load failure is the finding we report, with its type
            if "Unsupported global" in str(e) or ("weights_only" in str(e) and "GLOBAL" in str(e)):
                # not corruption: the file pickles Python objects (HF training_args.bin, numpy RNG state), which
                # weights_only=True refuses by design (loading them would run the file's code)
                refused.append(os.path.basename(f))
                continue
            report.problems.append("%s: torch.load(weights_only=True) failed: %s: %s" % (
                os.path.basename(f), type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
            report.loaded = False
            return
    loaded = len(files) - len(refused)
    why = "weights_only refused (Python objects, not corruption; format checks only): %s" % ", ".join(refused)
    if not loaded:
        report.load_note = "not loaded: %s" % why
        return
    report.loaded = True
    report.load_note = "loaded %d file(s) with torch %s" % (loaded, torch.__version__)
    if refused:
        report.load_note += "; %s" % why
    report.checked.append(report.load_note)
