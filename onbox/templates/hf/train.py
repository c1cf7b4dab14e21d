"""A Hugging Face transformers.Trainer script that survives preemption (written by `onbox init hf`).

    python train.py [--config training_config.yaml] [--key=value ...]    # here, in the foreground
    ./train.sh [--key=value ...]                                         # under `onbox run`: detached, committed

Needs transformers 4.41 or newer (tested with 5.17.0) and the box's own torch. By default it trains a tiny GPT-2
built from a config (random weights, nothing downloaded) on synthetic tokens: plug your model and data into
build_model() and build_datasets(). The Trainer brings cosine LR with warm-up (`cosine_with_min_lr`), gradient
clipping, bf16/fp16 and the full checkpoint (weights, optimizer, scheduler, scaler, RNG, trainer_state.json) in
<output_dir>/checkpoint-<step>/. What this script adds:
- the checkpoint directory appears whole or not at all: the Trainer writes into a hidden staging dir, which is
  fsynced and renamed to checkpoint-<step> (the Trainer itself writes in place: a kill mid-save leaves a
  checkpoint-<step> that `resume_from_checkpoint=True` would pick and fail on);
- resume from $ONBOX_RESUME_FROM (the newest verified checkpoint onbox restored) via resume_from_checkpoint;
- SIGTERM/SIGUSR1: the Trainer saves at the end of the current step and stops; exit 75;
- bf16/fp16/fp32 chosen by hardware, and one JSON log line per report (step, loss, eval_loss, lr, tokens_per_s).
"""
from __future__ import annotations

import os
import shutil
import sys

import onbox_trainkit as kit

HERE = os.path.dirname(os.path.abspath(__file__))
STAGING = ".onbox-staging"  # a dot name: neither onbox nor the Trainer's resume ever picks it

DEFAULTS = {
    "output_dir": "output",
    "max_steps": 2000,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 0.0005,
    "min_lr": 0.00005,
    "warmup_steps": 50,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "precision": "auto",
    "logging_steps": 10,
    "eval_steps": 100,
    "save_steps": 100,
    "save_total_limit": 3,
    "seed": 42,
    "dataloader_num_workers": 0,
    "report_to": "none",
    # the tiny default model and the synthetic data
    "seq_len": 32,
    "vocab_size": 128,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "train_samples": 512,
    "eval_samples": 64,
}


def build_model(cfg):
    """>>> Your model here. <<< E.g. AutoModelForCausalLM.from_pretrained("gpt2") (downloads), or a config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=cfg["vocab_size"], n_positions=cfg["seq_len"], n_embd=cfg["n_embd"],
                                      n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                                      bos_token_id=cfg["vocab_size"] - 1, eos_token_id=cfg["vocab_size"] - 1))


def build_datasets(torch, cfg):
    """>>> Your data here. <<< Return (train, eval) datasets of {"input_ids", "labels"} (LongTensor[seq_len]).

    With the datasets library and a tokenizer, for example:
        from datasets import load_dataset
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained("gpt2")
        raw = load_dataset("text", data_files={"train": "train.txt", "validation": "val.txt"})
        ids = raw.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
        # ... concatenate and cut into blocks of seq_len, labels = input_ids; vocab_size = len(tok)
    Stage the data on the box's local disk first (network volumes starve the GPU), and keep
    dataloader_num_workers small: each worker holds its own copy of what the dataset holds in memory.
    The default: synthetic token streams in which each token follows from the one before (a smoke test).
    """
    class Synthetic(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            cols = [torch.randint(cfg["vocab_size"], (n,), generator=g)]
            for _ in range(cfg["seq_len"] - 1):
                cols.append((5 * cols[-1] + 3) % cfg["vocab_size"])
            self.ids = torch.stack(cols, dim=1)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Synthetic(cfg["train_samples"], cfg["seed"]), Synthetic(cfg["eval_samples"], cfg["seed"] + 1)


def make_trainer_class(Trainer):
    """Trainer, with each checkpoint written into a staging dir and renamed into place once whole."""
    if not (hasattr(Trainer, "_save_checkpoint") and hasattr(Trainer, "_get_output_dir")):
        kit.log(event="warning", message="this transformers has no Trainer._save_checkpoint/_get_output_dir: "
                                         "checkpoints are written in place (onbox still commits only whole ones)")
        return Trainer

    class AtomicSaveTrainer(Trainer):
        _onbox_staging = False

        def _get_output_dir(self, trial):
            out = super()._get_output_dir(trial)
            return os.path.join(out, STAGING) if self._onbox_staging else out

        def _save_checkpoint(self, model, trial):
            final_root = super()._get_output_dir(trial)
            name = "checkpoint-%d" % self.state.global_step
            staging = os.path.join(final_root, STAGING, name)
            final = os.path.join(final_root, name)
            if os.path.isdir(staging) and self.args.should_save:  # a killed save's: never resumed from
                shutil.rmtree(staging)
            self._onbox_staging = True
            try:
                super()._save_checkpoint(model, trial)  # the Trainer's own save, all of it, into `staging`
            finally:
                self._onbox_staging = False
            distributed = self.args.world_size > 1
            if distributed:  # every rank wrote its RNG state into the staging dir before it moves
                self.accelerator.wait_for_everyone()
            if self.args.should_save:
                if os.path.isdir(final):  # the same step saved again: replace it whole
                    os.rename(final, final + ".old")
                    kit.publish_dir(staging, final)
                    shutil.rmtree(final + ".old")
                else:
                    kit.publish_dir(staging, final)
                # rotation: the Trainer's own ran inside the staging dir; keep the newest here
                kit.prune(os.path.join(final_root, "checkpoint-*"), self.args.save_total_limit or 0)
            if distributed:
                self.accelerator.wait_for_everyone()

    return AtomicSaveTrainer


def main() -> int:
    cfg = kit.config_or_exit(DEFAULTS, os.path.join(HERE, "training_config.yaml"))
    import torch
    from transformers import TrainerCallback, TrainingArguments, set_seed
    from transformers.trainer import Trainer
    from transformers.trainer_callback import PrinterCallback

    set_seed(cfg["seed"])
    device = kit.pick_device(torch)
    precision = kit.pick_precision(torch, device, cfg["precision"])
    out_dir = kit.checkpoint_dir(cfg["output_dir"])
    stop = kit.StopFlag().install()
    tokens_per_step = cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"] * cfg["seq_len"]

    class Onbox(TrainerCallback):
        """JSON log lines, checkpoint events, and the stop flag acted on at the end of a step."""

        def __init__(self):
            self.meter = kit.Throughput()

        def on_step_end(self, args, state, control, **kwargs):
            self.meter.add(tokens_per_step * max(1, args.world_size))
            if state.global_step >= state.max_steps:
                control.should_save = True  # the Trainer saves only every save_steps: the end is a checkpoint too
            if stop.requested():
                control.should_save = True
                control.should_training_stop = True
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                kit.log(step=state.global_step, loss=logs["loss"], lr=logs.get("learning_rate"),
                        grad_norm=logs.get("grad_norm"), tokens_per_s=self.meter.rate())
            if "eval_loss" in logs:
                kit.log(step=state.global_step, eval_loss=logs["eval_loss"])

        def on_save(self, args, state, control, **kwargs):
            kit.log(event="checkpoint", step=state.global_step,
                    path=os.path.join(args.output_dir, "checkpoint-%d" % state.global_step),
                    reason="signal %s" % stop.reason() if stop.requested() else "periodic")

    args = TrainingArguments(
        output_dir=out_dir, max_steps=cfg["max_steps"], per_device_train_batch_size=cfg["per_device_train_batch_size"],
        per_device_eval_batch_size=cfg["per_device_eval_batch_size"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"], learning_rate=cfg["learning_rate"],
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": cfg["min_lr"]},
        warmup_steps=cfg["warmup_steps"], weight_decay=cfg["weight_decay"], max_grad_norm=cfg["max_grad_norm"],
        bf16=precision == "bf16", fp16=precision == "fp16", use_cpu=device == "cpu",
        logging_steps=cfg["logging_steps"], eval_strategy="steps", eval_steps=cfg["eval_steps"],
        save_strategy="steps", save_steps=cfg["save_steps"], save_total_limit=cfg["save_total_limit"],
        seed=cfg["seed"], dataloader_num_workers=cfg["dataloader_num_workers"], report_to=cfg["report_to"],
        disable_tqdm=True)
    train_ds, eval_ds = build_datasets(torch, cfg)
    trainer = make_trainer_class(Trainer)(model=build_model(cfg), args=args, train_dataset=train_ds,
                                          eval_dataset=eval_ds, callbacks=[Onbox()])
    trainer.remove_callback(PrinterCallback)  # the JSON lines above say it all, once
    resume = kit.resume_path()
    if resume:
        kit.log(event="resumed", step=_step_of(resume), path=resume)
    kit.log(event="start", device=device, precision=precision, config=cfg,
            params=sum(p.numel() for p in trainer.model.parameters()))
    trainer.train(resume_from_checkpoint=resume)
    if stop.requested():
        kit.log(event="stopped", step=trainer.state.global_step, reason=stop.reason())
        return kit.EXIT_PREEMPTED
    kit.log(event="done", step=trainer.state.global_step)
    return 0


def _step_of(checkpoint_dir):
    import json

    with open(os.path.join(checkpoint_dir, "trainer_state.json"), encoding="utf-8") as f:
        return json.load(f)["global_step"]


if __name__ == "__main__":
    sys.exit(kit.finish(main()))
