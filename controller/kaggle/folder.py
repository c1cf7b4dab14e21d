"""The kernel folder `onboxctl kaggle push` writes and hands to `kaggle kernels push -p`: kernel-metadata.json and
one script, `onbox_kernel.py`, that carries onbox.pyz (and the --code tree) inside it.

Why inside the script and not as a dataset: one push is one upload, with nothing to create, version and wait for
before the kernel can mount it (a dataset is processed asynchronously after `kaggle datasets create`), and the
agent on Kaggle is exactly the build this controller pushed (its sha256 is in the script and checked before use).
The price is the script's size: onbox.pyz is about 1.5 MB, 2 MB as base64, stored with every version.

The script is SPEC (a Python literal), PYZ_B64, CODE_B64, then the text of kernel_main.py, which runs on Kaggle.
Continuing a run (a push after the first, no --durable remote): the kernel lists ITSELF under kernel_sources, so
Kaggle mounts the previous version's output read-only under /kaggle/input and the next session resumes from it.
"""
from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import io
import json
import os
import pprint
import re
import tarfile
from typing import Any, Dict, List, Optional

from controller.launch.secretfiles import Selection
from onbox import __version__
from onbox.errors import UsageError
from onbox.fsutil import atomic_write

METADATA_FILE = "kernel-metadata.json"
SCRIPT_FILE = "onbox_kernel.py"
MAIN_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_main.py")
CODE_MAX_BYTES = 20 * 1024 * 1024  # compressed: it travels inside the script, with every version
# left out without a word: caches and virtualenvs (secret-looking paths, .git among them, are left out and named:
# controller/launch/secretfiles.py)
CODE_SKIP_DIRS = {"__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache"}
TITLE_PREFIX = "onbox "  # Kaggle wants a title of at least 5 characters; a run name may be shorter
SLUG_MAX = 50
OWNER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
SOURCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}/[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
CPU = "cpu"


def slug_of(run: str) -> str:
    """The kernel's slug for run RUN: the title ("onbox RUN") lowercased with every run of other characters
    made one dash, as Kaggle derives a slug from a title."""
    return re.sub(r"[^a-z0-9]+", "-", (TITLE_PREFIX + run).lower()).strip("-")[:SLUG_MAX].rstrip("-")


@dataclasses.dataclass
class KernelSpec:
    """What one push of run RUN asks of Kaggle and of the session."""

    owner: str
    run: str
    command: List[str]
    accelerator: Optional[str] = None  # a machine shape (NvidiaTeslaT4, TpuV38, ...), "cpu", or Kaggle's default GPU
    internet: bool = True
    private: bool = True
    durable: Optional[str] = None  # an rclone remote: the chain resumes from it instead of the previous output
    continuing: bool = False  # a version before this one exists: list the kernel itself as a source
    datasets: List[str] = dataclasses.field(default_factory=list)
    resume_args: List[str] = dataclasses.field(default_factory=list)
    onbox_args: List[str] = dataclasses.field(default_factory=list)

    @property
    def slug(self) -> str:
        return slug_of(self.run)

    @property
    def ref(self) -> str:
        return "%s/%s" % (self.owner, self.slug)

    @property
    def title(self) -> str:
        return TITLE_PREFIX + self.run

    def check(self) -> None:
        if not OWNER_RE.fullmatch(self.owner):
            raise UsageError("Kaggle username %r is not one Kaggle gives" % self.owner,
                             hint="set KAGGLE_USERNAME or the username in ~/.kaggle/kaggle.json")
        if not self.command:
            raise UsageError("no command to run on Kaggle", hint="put it after --: onboxctl kaggle push DIR "
                                                                  "--name RUN -- python train.py")
        for src in self.datasets:
            if not SOURCE_RE.fullmatch(src):
                raise UsageError("--dataset %r is not OWNER/DATASET-SLUG" % src)
            if src.split("/", 1)[1] == self.slug:  # it would mount where the previous output is looked for
                raise UsageError("--dataset %s has the kernel's own slug (%s)" % (src, self.slug),
                                 hint="a session resumes from what is mounted under that name: rename the dataset")
        if self.accelerator is not None and not re.fullmatch(r"[A-Za-z0-9]{2,64}", self.accelerator):
            raise UsageError("--accelerator %r is no machine shape (e.g. NvidiaTeslaT4, TpuV38, cpu)"
                             % self.accelerator)


def metadata(spec: KernelSpec) -> Dict[str, Any]:
    """kernel-metadata.json as the kaggle CLI reads it (docs/kernels_metadata.md of the kaggle CLI)."""
    acc = spec.accelerator
    tpu = bool(acc and acc.lower().startswith("tpu"))
    doc: Dict[str, Any] = {
        "id": spec.ref,
        "title": spec.title,
        "code_file": SCRIPT_FILE,
        "language": "python",
        "kernel_type": "script",
        "is_private": spec.private,
        "enable_gpu": acc is None or (acc.lower() != CPU and not tpu),
        "enable_tpu": tpu,
        "enable_internet": spec.internet,
        "dataset_sources": list(spec.datasets),
        "competition_sources": [],
        # the previous version's output, mounted read-only under /kaggle/input: what the next session resumes from
        "kernel_sources": [spec.ref] if spec.continuing and not spec.durable else [],
        "model_sources": [],
    }
    if acc is not None and acc.lower() != CPU:
        doc["machine_shape"] = acc
    return doc


def session_spec(spec: KernelSpec, pyz_sha256: str) -> Dict[str, Any]:
    """SPEC, the script's first line of data: what kernel_main.py runs."""
    return {"run": spec.run, "kernel": spec.ref, "command": list(spec.command), "durable": spec.durable,
            "resume_args": list(spec.resume_args), "onbox_args": list(spec.onbox_args),
            "pyz_sha256": pyz_sha256, "onbox_version": __version__}


def _wrapped(b64: str, width: int = 76) -> str:
    if not b64:
        return '""'
    return "(\n" + "".join('    "%s"\n' % b64[i:i + width] for i in range(0, len(b64), width)) + ")"


def script(spec: KernelSpec, pyz: bytes, code: Optional[bytes] = None) -> str:
    """The kernel's script: SPEC, the payloads as base64, then kernel_main.py's text."""
    with open(MAIN_SOURCE, encoding="utf-8") as f:
        main = f.read()
    doc = session_spec(spec, hashlib.sha256(pyz).hexdigest())
    head = ("# Written by `onboxctl kaggle push` (onbox %s) for run %s: Kaggle runs it; push again instead of "
            "editing it.\n" % (__version__, spec.run))
    return (head + "SPEC = " + pprint.pformat(doc, width=110) + "\n"
            + "PYZ_B64 = " + _wrapped(base64.b64encode(pyz).decode("ascii")) + "\n"
            + "CODE_B64 = " + _wrapped(base64.b64encode(code).decode("ascii") if code else "") + "\n\n" + main)


def pack_code(path: str, selection: Optional[Selection] = None) -> bytes:
    """The --code tree as a reproducible tar.gz (sorted, fixed times and owners; caches and venvs left out, and
    secret-looking files unless `selection` includes them: it records what was left out, for the caller to say)."""
    if not os.path.isdir(path):
        raise UsageError("--code %s is not a directory" % path)
    sel = selection or Selection(path)
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for dirpath, dirnames, filenames in os.walk(path):
            here = os.path.relpath(dirpath, path)
            prefix = "" if here == "." else here.replace(os.sep, "/") + "/"
            dirnames[:] = [d for d in sorted(dirnames) if d not in CODE_SKIP_DIRS
                           and not os.path.islink(os.path.join(dirpath, d)) and sel.keep_dir(prefix + d)]
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                if os.path.islink(full) or not os.path.isfile(full) or name.endswith(".pyc"):
                    continue
                if not sel.keep_file(prefix + name, full):
                    continue
                info = tar.gettarinfo(full, arcname=prefix + name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(full, "rb") as f:
                    tar.addfile(info, f)
                if buf.tell() > CODE_MAX_BYTES:
                    raise UsageError("--code %s is larger than %d MiB compressed: it travels inside the script"
                                     % (path, CODE_MAX_BYTES // (1024 * 1024)),
                                     hint="attach large files as a Kaggle dataset (--dataset OWNER/SLUG)")
    return buf.getvalue()


def check_folder(folder: str) -> None:
    """DIR may be new, empty or a kernel folder written before; one holding anything else is refused."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError("%s is not a directory" % folder)
    if os.path.isdir(folder):
        strangers = sorted(set(os.listdir(folder)) - {METADATA_FILE, SCRIPT_FILE})
        if strangers:
            raise UsageError("%s holds files that are not a kernel folder's (%s): nothing written"
                             % (folder, ", ".join(strangers[:5])),
                             hint="give an empty or new directory: `kaggle kernels push -p` uploads what it holds")


def write(folder: str, spec: KernelSpec, pyz: bytes, code: Optional[bytes] = None) -> List[str]:
    """Write the kernel folder (each file atomically)."""
    spec.check()
    check_folder(folder)
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, SCRIPT_FILE), os.path.join(folder, METADATA_FILE)]
    # 0644: the files are uploaded as they are; nothing secret is in them (credentials stay with the kaggle CLI)
    atomic_write(paths[0], script(spec, pyz, code), mode=0o644)
    atomic_write(paths[1], json.dumps(metadata(spec), indent=2) + "\n", mode=0o644)
    return paths
