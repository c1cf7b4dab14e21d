"""A real Lightning `Trainer` run with `ModelCheckpoint`, CPU only, seconds per run, nothing downloaded.

  python tests/trainers/lightning_trainer.py --ckpt_dir D --max_steps N --every K [--ckpt_path PATH|last]
         [--save_top_k T]

Checkpoints are Lightning's own: ModelCheckpoint(dirpath=D, every_n_train_steps=K, save_top_k=T (default -1: keep
all), save_last=True) writes D/epoch=E-step=S.ckpt and then D/last.ckpt (a second full save, not a link) every K
optimizer steps. `--ckpt_path last` resumes from the newest last*.ckpt in D (Lightning's own lookup). Log lines
are Lightning's own (banner, model summary, progress bar with `train_loss`, "`Trainer.fit` stopped: ...").

Die-at points (ONBOX_TEST_DIE_AT, see harness.py), each wrapping the real code:
  before-save   entering Trainer.save_checkpoint (nothing of this save on disk)
  during-dump   inside the torch.save into Lightning's in-memory buffer (nothing of this save on disk)
  before-move   the whole checkpoint written to the temp file, before fsspec moves it over the target: the target
                absent, the temp file left in the temp dir ($TMPDIR)
  during-move   when the temp dir is on another filesystem than D (shutil.move then copies): after half the bytes
                were copied to the target: a torn <target>.ckpt. Never fires when the move is a rename.
  before-last   the epoch=..-step=..ckpt saved, before last.ckpt is written
  after-save    right after a Trainer.save_checkpoint returned
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

harness.offline()

DIE_POINTS = ("before-save", "during-dump", "before-move", "during-move", "before-last", "after-save")


def _args(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="every_n_train_steps")
    p.add_argument("--save_top_k", type=int, default=-1)
    p.add_argument("--ckpt_path", default=None, help="a .ckpt to resume from, or 'last'")
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args(argv)


def _install_die_points(die_at: harness.DieAt) -> None:
    import shutil

    import lightning.fabric.utilities.cloud_io as cloud_io
    from lightning.pytorch import Trainer

    real_save = Trainer.save_checkpoint

    def save_checkpoint(self, filepath, *args, **kwargs):
        if os.path.basename(str(filepath)).startswith("last"):
            die_at.reached("before-last")
        die_at.reached("before-save")
        out = real_save(self, filepath, *args, **kwargs)
        die_at.reached("after-save")
        return out

    real_torch_save = cloud_io.torch.save

    def torch_save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            die_at.reached("during-dump")
        return real_torch_save(obj, f, *args, **kwargs)

    real_move = shutil.move

    def move(src, dst, *args, **kwargs):
        die_at.reached("before-move")
        if not die_at.arrive("during-move"):
            return real_move(src, dst, *args, **kwargs)
        real_sendfile = os.sendfile

        def sendfile_half(out_fd, in_fd, offset, count):
            sent = real_sendfile(out_fd, in_fd, offset, max(1, os.fstat(in_fd).st_size // 2))
            harness.die("during-move")
            return sent

        os.sendfile = sendfile_half
        try:
            return real_move(src, dst, *args, **kwargs)
        finally:
            os.sendfile = real_sendfile

    Trainer.save_checkpoint = save_checkpoint
    cloud_io.torch.save = torch_save  # the torch module object: _atomic_save calls torch.save(checkpoint, buffer)
    shutil.move = move  # fsspec's LocalFileOpener.commit calls shutil.move(temp, path)


def main(argv: list) -> int:
    args = _args(argv)
    die_at = harness.DieAt(DIE_POINTS)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    import torch
    from lightning.pytorch import LightningModule, Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn

    harness.install_trace(args.ckpt_dir)
    _install_die_points(die_at)
    seed_everything(args.seed)
    vocab, seq = 64, 16

    class TinyLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, 32)
            self.head = nn.Linear(32, vocab)
            ballast = harness.ballast_numel()
            if ballast:
                self.register_buffer("ballast", torch.zeros(ballast))

        def training_step(self, batch, batch_idx):
            x = batch[0]
            logits = self.head(self.emb(x[:, :-1]))
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def on_train_start(self) -> None:
            # The one line the tests read to see where a (resumed) run starts.
            print("train begins at global_step %d" % self.trainer.global_step, flush=True)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=10)}

    data = torch.randint(vocab, (64, seq), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4, num_workers=0)
    checkpoint = ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every, save_top_k=args.save_top_k,
                                 save_last=True)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=args.max_steps, callbacks=[checkpoint],
                      default_root_dir=os.path.dirname(os.path.abspath(args.ckpt_dir)), logger=False,
                      enable_progress_bar=True, log_every_n_steps=1, num_sanity_val_steps=0)
    trainer.fit(TinyLM(), loader, ckpt_path=args.ckpt_path)
    print("global_step %d" % trainer.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
