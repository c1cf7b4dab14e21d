"""A real Hugging Face transformers `Trainer` run, CPU only, seconds per run, nothing downloaded.

The model is a tiny GPT-2 built from a config (random weights); the data are random token ids (no tokenizer).
Checkpoints are the Trainer's own: <output_dir>/checkpoint-<global_step>/ every --save_steps, at most
--save_total_limit kept (the Trainer deletes older ones itself). Log lines are the Trainer's own dicts
({'loss': ..., 'grad_norm': ..., 'learning_rate': ..., 'epoch': ...}) every --logging_steps.

  python tests/trainers/hf_trainer.py --output_dir D --max_steps N --save_steps K
         [--save_total_limit L] [--logging_steps S] [--resume_from_checkpoint PATH|True]

Die-at points (ONBOX_TEST_DIE_AT, see harness.py), each wrapping the real Trainer method:
  after-model-before-optimizer  entering Trainer._save_optimizer_and_scheduler: weights, config and
                                training_args.bin written; no optimizer.pt, scheduler.pt, rng_state.pth,
                                trainer_state.json
  during-optimizer              inside the torch.save of optimizer.pt after ONBOX_TEST_DIE_RECORDS tensor
                                records: a torn optimizer.pt, nothing after it
  before-trainer-state          entering TrainerState.save_to_json for the checkpoint: every file but
                                trainer_state.json
  trainer-state-empty           inside TrainerState.save_to_json, after its open() created the file, before the
                                write: a 0-byte trainer_state.json
  during-rotate                 inside the Trainer's rotation of old checkpoints, after the first file of the
                                oldest checkpoint was deleted (needs --save_total_limit): a half-deleted old dir
  after-save                    right after Trainer._save_checkpoint returned (a complete checkpoint)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

harness.offline()

DIE_POINTS = ("after-model-before-optimizer", "during-optimizer", "before-trainer-state", "trainer-state-empty",
              "during-rotate", "after-save")
VOCAB, SEQ = 128, 16


def _args(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--save_steps", type=int, default=5)
    p.add_argument("--save_total_limit", type=int, default=None)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint-N dir, or True for the newest")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def _install_die_points(die_at: harness.DieAt) -> None:
    """Wrap the real Trainer/TrainerState methods; the original runs unchanged unless the armed point is hit."""
    import builtins

    import transformers.trainer as trainer_mod
    from transformers import Trainer
    from transformers.trainer_callback import TrainerState

    real_opt = Trainer._save_optimizer_and_scheduler

    def save_optimizer_and_scheduler(self, output_dir):
        die_at.reached("after-model-before-optimizer")
        if die_at.arrive("during-optimizer"):
            with harness.dying_torch_save("during-optimizer", die_at.records,
                                          only=lambda p: p.endswith("optimizer.pt")):
                return real_opt(self, output_dir)
        return real_opt(self, output_dir)

    real_json = TrainerState.save_to_json

    def save_to_json(self, json_path):
        die_at.reached("before-trainer-state")
        if not die_at.arrive("trainer-state-empty"):
            return real_json(self, json_path)
        real_open = builtins.open

        class _DieOnWrite:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def write(self, data):
                harness.die("trainer-state-empty")

        def open_then_die(*args, **kwargs):
            return _DieOnWrite(real_open(*args, **kwargs))

        builtins.open = open_then_die
        try:
            return real_json(self, json_path)
        finally:
            builtins.open = real_open

    real_rotate = trainer_mod.rotate_checkpoints

    def rotate_checkpoints(*args, **kwargs):
        if not die_at.arrive("during-rotate"):
            return real_rotate(*args, **kwargs)
        # shutil.rmtree removes the files of a directory with os.unlink(name, dir_fd=...): die after the first.
        real_unlink = os.unlink

        def unlink_then_die(*a, **kw):
            real_unlink(*a, **kw)
            harness.die("during-rotate")

        os.unlink = unlink_then_die
        try:
            return real_rotate(*args, **kwargs)
        finally:
            os.unlink = real_unlink

    real_ckpt = Trainer._save_checkpoint

    def save_checkpoint(self, model, trial):
        out = real_ckpt(self, model, trial)
        die_at.reached("after-save")
        return out

    Trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler
    TrainerState.save_to_json = save_to_json
    trainer_mod.rotate_checkpoints = rotate_checkpoints
    Trainer._save_checkpoint = save_checkpoint


def main(argv: list) -> int:
    args = _args(argv)
    die_at = harness.DieAt(DIE_POINTS)
    os.makedirs(args.output_dir, exist_ok=True)
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    harness.install_trace(args.output_dir)
    _install_die_points(die_at)
    set_seed(args.seed)

    class RandomTokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.ids = torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
    ballast = harness.ballast_numel()
    if ballast:
        model.register_buffer("ballast", torch.zeros(ballast))
    resume = args.resume_from_checkpoint
    if resume in ("True", "true"):
        resume = True
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        logging_steps=args.logging_steps,
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
    )
    class SayStart(TrainerCallback):
        """The one line the tests read to see where a (resumed) run starts; the Trainer itself says nothing."""

        def on_train_begin(self, args, state, control, **kwargs):
            print("train begins at global_step %d" % state.global_step, flush=True)

    trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(64), callbacks=[SayStart()])
    trainer.train(resume_from_checkpoint=resume)
    print("global_step %d" % trainer.state.global_step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
