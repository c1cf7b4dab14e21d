"""Orbax (JAX, Flax): a CheckpointManager saves step `N` into `<dir>/N.orbax-checkpoint-tmp*` (with a timestamp
suffix in some versions) holding `_CHECKPOINT_METADATA` from the start; at the commit it records the commit time in
that file, writes `commit_success.txt` and renames the dir to `<dir>/N/` (orbax-checkpoint 0.12). An async save
preempted midway leaves only the tmp dir.

  names     `*.orbax-checkpoint-tmp*`: work in progress, never a candidate (a replacement box handed one restores
            something Orbax ignores: it trains from step 0 although a step was committed);
  complete  a step dir holding `commit_success.txt`, or `_CHECKPOINT_METADATA` with its commit time; never by
            quiet nor by its rename alone;
  step      the dir's name (the manager's step);
  restore   `<ckpt_dir>/<step>/`, the manager's own layout, when the manager's directory is $ONBOX_CKPT_DIR.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional

from onbox.checkpoints.formats.base import Format, Layout, StepReading, read_json_object

TMP_RE = re.compile(r"\.orbax-checkpoint-tmp(-.*)?$")
STEP_DIR_RE = re.compile(r"^\d+$")
METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
ITEM_FILES = ("/_METADATA", "manifest.ocdbt", "/_sharding")  # what an Orbax item dir holds


class OrbaxFormat(Format):
    name = "orbax"

    def in_progress(self, name: str) -> bool:
        return bool(TMP_RE.search(name))

    def layout(self, path: str, files: List[str]) -> Optional[Layout]:
        top = {f for f in files if "/" not in f}
        stepdir = bool(STEP_DIR_RE.match(os.path.basename(path)))
        if METADATA not in top and not (stepdir and (COMMIT_SUCCESS in top or any(
                f.endswith(ITEM_FILES) for f in files))):
            return None
        if COMMIT_SUCCESS in top:
            return Layout(self.name, None, "%s present (written at the commit)" % COMMIT_SUCCESS)
        doc = read_json_object(os.path.join(path, METADATA)) if METADATA in top else None
        if doc is not None and isinstance(doc.get("commit_timestamp_nsecs"), int):
            return Layout(self.name, None, "%s records its commit time" % METADATA)
        return Layout(self.name, "not committed yet: no %s, and no commit time in %s (Orbax writes them when "
                                 "the save is committed)" % (COMMIT_SUCCESS, METADATA))

    def step_of_dir(self, path: str, files: List[str]) -> Optional[StepReading]:
        name = os.path.basename(path)
        return StepReading(int(name), "name (the Orbax step)") if STEP_DIR_RE.match(name) else None

    def step_of_name(self, name: str) -> Optional[int]:
        return int(name) if STEP_DIR_RE.match(name) else None


FORMAT = OrbaxFormat()
