"""`onbox init KIND DIR`: ready training code that keeps onbox's child contract, written from package data.

Each template is a directory here (shipped inside onbox.pyz as data files) plus what every template shares in
common/: onbox_trainkit.py (config reader, JSON logs, LR schedule, precision, seeds, atomic checkpoints, the stop
flag) and train.sh (the `onbox run` line, with @NAME@-style fields filled in per template).

  plain     a minimal torch loop                    step_<N>.pt files        resume: $ONBOX_RESUME_FROM
  nanogpt   a nanoGPT-style single-file GPT         <out>/ckpt.pt            resume: $ONBOX_RESUME_FROM
  hf        transformers.Trainer around a tiny model <out>/checkpoint-<N>/    resume: resume_from_checkpoint
  litgpt    LitGPT's config names and layout, plain torch <out>/step-<N>/    resume: --resume (LitGPT's flag)

May import: the shared leaves only. The template files themselves import nothing of onbox (they run with the
box's own Python and torch, U28).
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, NamedTuple

from onbox import fsutil
from onbox.errors import UsageError

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = os.path.join(HERE, "common")
TRAINKIT = "onbox_trainkit.py"


class Template(NamedTuple):
    files: List[str]  # the template's own files (in its directory), written as they are
    ckpt_subdir: str  # train.sh's default CKPT_DIR under the template dir
    resume_arg: str  # an `onbox run --resume-arg` (empty: train.py reads $ONBOX_RESUME_FROM itself)
    summary: str


OWN_RESUME = ("# train.py resumes from $ONBOX_RESUME_FROM by itself (onbox sets it to the newest verified "
              "checkpoint):\n# no --resume-arg needed.")
TEMPLATES: Dict[str, Template] = {
    "plain": Template(["train.py", "training_config.yaml"], "checkpoints", "",
                      "a minimal PyTorch loop (toy model and data to replace)"),
    "nanogpt": Template(["train.py", "training_config.yaml"], "out", "",
                        "a nanoGPT-style single-file GPT (random tokens, or data_dir/train.bin)"),
    "hf": Template(["train.py", "training_config.yaml"], "output", "",
                   "a transformers.Trainer script (tiny GPT-2 from a config, random data by default)"),
    "litgpt": Template(["train.py", "training_config.yaml"], "out/pretrain", "--resume-arg=--resume={ckpt}",
                       "LitGPT's config names and checkpoint layout with plain torch (litgpt itself not needed)"),
}
KINDS = tuple(TEMPLATES)


def render(kind: str, name: str) -> Dict[str, bytes]:
    """The files of template `kind`, by relative path, for a run called `name`."""
    t = TEMPLATES[kind]
    out: Dict[str, bytes] = {}
    for fn in t.files:
        with open(os.path.join(HERE, kind, fn), "rb") as f:
            out[fn] = f.read()
    with open(os.path.join(COMMON, TRAINKIT), "rb") as f:
        out[TRAINKIT] = f.read()
    with open(os.path.join(COMMON, "train.sh"), encoding="utf-8") as f:
        sh = f.read()
    note = OWN_RESUME if not t.resume_arg else (
        "# --resume-arg: onbox appends `%s` to train.py's arguments, {ckpt} being the newest verified checkpoint,\n"
        "# only when there is one to resume from." % t.resume_arg.split("=", 1)[1])
    for field, value in (("@KIND@", kind), ("@NAME@", name), ("@CKPT_SUBDIR@", t.ckpt_subdir),
                         ("@RESUME_NOTE@", note), ("@RESUME_ARG@", t.resume_arg + " " if t.resume_arg else "")):
        sh = sh.replace(field, value)
    out["train.sh"] = sh.encode("utf-8")
    return out


def write(kind: str, dest: str, force: bool = False, name: str = "") -> List[str]:
    """Write template `kind` into `dest` (created when missing); returns the paths written. Refuses (UsageError,
    nothing written) when a file it would write exists, unless `force`; other files in `dest` are never
    touched. Each file is written atomically; train.sh is made executable."""
    if kind not in TEMPLATES:
        raise UsageError("unknown template %r" % kind, hint="one of: %s" % ", ".join(KINDS))
    dest = os.path.abspath(os.path.expanduser(dest))
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise UsageError("%s exists and is not a directory" % dest, hint="give onbox init a directory")
    base = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.basename(dest.rstrip(os.sep)))[:100] or "run"
    files = render(kind, name or "%s-%s" % (kind, base))
    existing = sorted(fn for fn in files if os.path.lexists(os.path.join(dest, fn)))
    if existing and not force:
        raise UsageError("%s already holds %s" % (dest, ", ".join(existing)),
                         hint="choose an empty directory, or add --force to overwrite these files (others stay)")
    os.makedirs(dest, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    written = []
    for fn in sorted(files):
        path = os.path.join(dest, fn)
        # the user's own source code: the modes a new file gets from their umask, train.sh executable
        mode = (0o777 if fn.endswith(".sh") else 0o666) & ~umask
        fsutil.atomic_write(path, files[fn], mode=mode)
        written.append(path)
    return written
