"""TensorFlow checkpoints (tf.train.Checkpoint / CheckpointManager, Keras 2's save_weights in TF format): one save
of prefix `P` is `P.index` and its shards `P.data-00000-of-0000N`, all at the top of the directory, and the state
file `checkpoint` (text: `model_checkpoint_path: "P"`, `all_model_checkpoint_paths: ...`), which the manager
rewrites after the save to name it. tf.train.latest_checkpoint(dir) reads that state file.

  names     the state file is not a checkpoint of its own; `*.tempstate*` and `*_temp/` are TF's work in progress;
  groups    `P.index` with every `P.data-*-of-N` shard: one checkpoint named `P`, its files restored together;
  complete  every shard of N present and `P.index` written (TF writes the index after the shards); and the state
            file names P (or a later save), or nothing has been written for the quiet period (a bare
            Checkpoint.write never updates the state file);
  step      the number after the prefix's last `-` (`ckpt-12`), as CheckpointManager names them;
  restore   the files back under their names, and a state file naming P written beside them, so that
            latest_checkpoint(dir) and CheckpointManager.restore_or_initialize() find it.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Set

from onbox import fsutil
from onbox.checkpoints.formats.base import Format, Group, Layout

STATE_FILE = "checkpoint"
DATA_RE = re.compile(r"^(?P<prefix>.+)\.data-(?P<i>\d{5})-of-(?P<n>\d{5})$")
INDEX_SUFFIX = ".index"
STEP_RE = re.compile(r"-(\d+)$")
TEMP_RE = re.compile(r"(\.tempstate\d*$)|(_temp(_[0-9a-f]+)?(/|$))")
PATH_RE = re.compile(r'^(model_checkpoint_path|all_model_checkpoint_paths):\s*"(?P<p>[^"]*)"\s*$')


def state_paths(ckpt_dir: str) -> List[str]:
    """The prefixes the state file names, newest (model_checkpoint_path) first; [] without one."""
    try:
        with open(os.path.join(ckpt_dir, STATE_FILE), "rb") as f:
            text = f.read(1024 * 1024).decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = PATH_RE.match(line.strip())
        if m:
            out.append(os.path.basename(m.group("p")))
    return out


class TfCheckpointFormat(Format):
    name = "tf-checkpoint"

    def in_progress(self, name: str) -> bool:
        return name == STATE_FILE or bool(TEMP_RE.search(name))

    def groups(self, names: List[str]) -> List[Group]:
        shards: Dict[str, Set[str]] = {}
        for n in names:
            m = DATA_RE.match(n)
            if m:
                shards.setdefault(m.group("prefix"), set()).add(n)
        out = []
        for prefix in sorted(set(shards) | {n[:-len(INDEX_SUFFIX)] for n in names if n.endswith(INDEX_SUFFIX)}):
            files = sorted(shards.get(prefix, set()))
            index = prefix + INDEX_SUFFIX
            if index in names:
                files = [index, *files]
            if not files or (index not in names and not shards.get(prefix)):
                continue
            out.append(Group(prefix, tuple(files), self.name))
        return out

    def group_layout(self, root: str, group: Group, names: List[str]) -> Layout:
        index = group.name + INDEX_SUFFIX
        data = [f for f in group.files if DATA_RE.match(f)]
        if index not in group.files:
            return Layout(self.name, "no %s yet (TensorFlow writes it after the data shards)" % index)
        if not data:
            return Layout(self.name, "no data shard beside %s" % index)
        want = int(DATA_RE.match(data[0]).group("n"))  # type: ignore[union-attr]
        if len(data) != want:
            return Layout(self.name, "%d of %d data shards present" % (len(data), want))
        if not self.named_by_state(root, group):  # a bare Checkpoint.write: the generic rules (quiet) decide
            return Layout(self.name, None, "")
        return Layout(self.name, None, "%s and its %d data shard(s) present, named by the state file" % (
            index, want))

    def named_by_state(self, root: str, group: Group) -> bool:
        """The state file names this save or a later one (the manager wrote it after this save)."""
        named = state_paths(root)
        if not named:
            return False
        if group.name in named:
            return True
        mine, newest = self.step_of_name(group.name), self.step_of_name(named[0])
        return mine is not None and newest is not None and newest >= mine

    def step_of_name(self, name: str) -> Optional[int]:
        m = STEP_RE.search(name)
        return int(m.group(1)) if m else None

    def after_restore(self, ckpt_dir: str, local_name: str, files: List[str]) -> Optional[str]:
        path = os.path.join(ckpt_dir, STATE_FILE)
        text = 'model_checkpoint_path: "%s"\nall_model_checkpoint_paths: "%s"\n' % (local_name, local_name)
        fsutil.atomic_write(path, text, mode=0o644)
        return path


FORMAT = TfCheckpointFormat()
