"""Keras 3 (KERAS_BACKEND=jax) fit() with one of its two documented checkpoint callbacks:

  --mode model   ModelCheckpoint(filepath=$ONBOX_CKPT_DIR/model.{epoch:02d}.keras): a .keras zip per epoch,
                 written in place; a restart loads $ONBOX_RESUME_FROM (keras.models.load_model) and goes on
                 from the epoch in its name (initial_epoch), as the docs' resume recipe does.
  --mode backup  BackupAndRestore(backup_dir=$ONBOX_CKPT_DIR/backup): the dir rewritten every epoch; fit()
                 itself goes on from the epoch it recorded.
"""
from __future__ import annotations

import argparse
import os
import re
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np
import seam


class Report(keras.callbacks.Callback):
    """Prints each epoch's progress (before the checkpoint callbacks run) and the epoch a restart begins at."""

    def __init__(self, sleep: float, backup: bool) -> None:
        super().__init__()
        self.sleep, self.first, self.backup = sleep, True, backup

    def on_epoch_begin(self, epoch, logs=None):  # type: ignore[no-untyped-def]
        if self.first and epoch > 0 and self.backup:
            seam.resumed(epoch, "BackupAndRestore")
        self.first = False

    def on_train_batch_end(self, batch, logs=None):  # type: ignore[no-untyped-def]
        time.sleep(self.sleep)

    def on_epoch_end(self, epoch, logs=None):  # type: ignore[no-untyped-def]
        seam.progress(epoch + 1, (logs or {}).get("loss", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("model", "backup"), required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--sleep", type=float, default=0.02)
    a = ap.parse_args()
    seam.install()
    ckpt = os.environ["ONBOX_CKPT_DIR"]
    os.makedirs(ckpt, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.random((256, 8)).astype("float32")
    y = (x @ rng.random((8, 1))).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    initial_epoch = 0
    callbacks: list = [Report(a.sleep, a.mode == "backup")]
    if a.mode == "model":
        resume = os.environ.get("ONBOX_RESUME_FROM")
        if resume:
            model = keras.models.load_model(resume)
            initial_epoch = int(re.search(r"model\.(\d+)\.keras$", resume).group(1))  # type: ignore[union-attr]
            seam.resumed(initial_epoch, resume)
        callbacks.append(keras.callbacks.ModelCheckpoint(filepath=os.path.join(ckpt, "model.{epoch:02d}.keras")))
    else:
        callbacks.append(keras.callbacks.BackupAndRestore(backup_dir=os.path.join(ckpt, "backup")))
    model.fit(x, y, batch_size=32, epochs=a.epochs, initial_epoch=initial_epoch, verbose=0, callbacks=callbacks)


if __name__ == "__main__":
    main()
