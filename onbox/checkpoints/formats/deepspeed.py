"""DeepSpeed saves: a tag dir (`global_step<N>/` with mp_rank_* and zero_pp_rank_* files) beside a `latest` file
naming the newest tag, written after every rank saved. A dir holding `latest` is complete once the tag it names
holds files; a tag dir of its own once `latest` beside it names it or a later tag.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional

from onbox.checkpoints.formats.base import Format, Layout

DEEPSPEED_LATEST = "latest"
DEEPSPEED_STEP_RE = re.compile(r"^global_step(\d+)$")


class DeepSpeedFormat(Format):
    name = "deepspeed"

    def layout(self, path: str, files: List[str]) -> Optional[Layout]:
        top = {f for f in files if "/" not in f}
        if DEEPSPEED_LATEST in top:
            with open(os.path.join(path, DEEPSPEED_LATEST), "rb") as f:
                tag = f.read(4096).decode("utf-8", "replace").strip()
            if tag and any(f.startswith(tag + "/") for f in files):
                return Layout(self.name, None, "`latest` names %s (written after every rank saved)" % tag)
            return Layout(self.name, "`latest` names %r, which holds no files" % tag)
        ds = DEEPSPEED_STEP_RE.fullmatch(os.path.basename(path))
        if ds and any(f.startswith("mp_rank_") or f.startswith("zero_pp_rank_") for f in top):
            return _tag(path, int(ds.group(1)))
        return None


def _tag(path: str, step: int) -> Layout:
    """A DeepSpeed tag dir (global_stepN/) beside its `latest` file: complete once `latest` names it or a later
    tag (DeepSpeed writes `latest` after every rank's files of the tag)."""
    try:
        with open(os.path.join(os.path.dirname(path), DEEPSPEED_LATEST), "rb") as f:
            latest = f.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return Layout("deepspeed", "no `latest` file beside it yet (DeepSpeed writes it after the save)")
    m = DEEPSPEED_STEP_RE.fullmatch(latest)
    if m and int(m.group(1)) >= step:
        return Layout("deepspeed", None, "`latest` names %s" % latest)
    return Layout("deepspeed", "`latest` names %r, not this tag yet" % latest)


FORMAT = DeepSpeedFormat()
