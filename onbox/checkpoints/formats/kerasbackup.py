"""Keras 3 BackupAndRestore(backup_dir): every epoch (or every save_freq batches) it rewrites, in place,
`latest.weights.h5` and then `training_metadata.json` ({"epoch": E, "batch": B}: E epochs done, keras 3.15);
`fit()` reloads them at its start and goes on with epoch index E. A directory rewritten every epoch is never quiet for long, so quiet would commit it
only at the final stop; its own completion signal is the metadata file, written after the weights.

  complete  training_metadata.json parses with an int epoch, is at least as new as latest.weights.h5, and the
            weights pass the HDF5 check (its end-of-file address is the file's size);
  step      the epochs done: the metadata's epoch;
  restore   the dir as a dir, at its name (BackupAndRestore's backup_dir).
"""
from __future__ import annotations

import os
from typing import List, Optional

from onbox.checkpoints.formats.base import Format, Layout, StepReading, read_json_object

METADATA = "training_metadata.json"
WEIGHTS = "latest.weights.h5"


class KerasBackupFormat(Format):
    name = "keras-backup"

    def layout(self, path: str, files: List[str]) -> Optional[Layout]:
        top = {f for f in files if "/" not in f}
        if WEIGHTS not in top:
            return None
        if METADATA not in top:
            return Layout(self.name, "no %s yet (Keras writes it after the weights)" % METADATA)
        doc = read_json_object(os.path.join(path, METADATA))
        if doc is None or type(doc.get("epoch")) is not int:
            return Layout(self.name, "%s is not complete JSON with an epoch (still being written?)" % METADATA)
        try:
            if os.stat(os.path.join(path, METADATA)).st_mtime_ns < os.stat(os.path.join(path, WEIGHTS)).st_mtime_ns:
                return Layout(self.name, "%s is older than %s: the weights of the next epoch are being written"
                              % (METADATA, WEIGHTS))
        except OSError as e:
            return Layout(self.name, "cannot read: %s" % e)
        return Layout(self.name, None, "%s written after %s" % (METADATA, WEIGHTS))

    def step_of_dir(self, path: str, files: List[str]) -> Optional[StepReading]:
        doc = read_json_object(os.path.join(path, METADATA))
        epoch = doc.get("epoch") if doc is not None else None
        if type(epoch) is int and epoch >= 0:
            return StepReading(epoch, "%s:epoch" % METADATA)
        return None


FORMAT = KerasBackupFormat()
