"""`onbox init KIND DIR`: write a ready training script, its config and its `onbox run` launcher."""
from __future__ import annotations

from typing import Optional

import click

from onbox.clikit import LaidOut, PathValue, echo_json
from onbox.templates import KINDS, TEMPLATES


@click.command("init", cls=LaidOut, examples=["onbox init plain ./train", "onbox init nanogpt ./gpt --name gpt",
                                             "onbox init hf ./finetune --force   # rewrite the template's files"])
@click.argument("kind", type=click.Choice(KINDS))
@click.argument("directory", type=PathValue(click.Path(file_okay=False)))
@click.option("--force", is_flag=True, help="Overwrite the template's files where DIR already has them (other "
                                            "files stay).")
@click.option("--name", default=None, help="The run name train.sh uses (default: KIND-<DIR's name>).")
@click.option("--json", "as_json", is_flag=True, help="Print the files written as JSON.")
def init(kind: str, directory: str, force: bool, name: Optional[str], as_json: bool) -> None:
    """Write a training template into DIRECTORY: train.py, onbox_trainkit.py, training_config.yaml, train.sh.

    \b
    plain    a minimal PyTorch loop
    nanogpt  a nanoGPT-style single-file GPT
    hf       a transformers.Trainer script (needs transformers on the box)
    litgpt   LitGPT's config names and checkpoint layout, with plain torch

    Every template: cosine LR with warm-up, gradient clipping, bf16/fp16/fp32 by hardware, seeds, JSON log lines
    that `onbox status` and heartbeats read, full-state atomic checkpoints in $ONBOX_CKPT_DIR, resume from
    $ONBOX_RESUME_FROM, and SIGTERM/SIGUSR1 -> checkpoint at the next step -> exit 75. Edit train.sh's DURABLE
    (and CKPT_DIR), then ./train.sh. Existing files are never overwritten without --force (exit 2).
    """
    from onbox import paths
    from onbox.errors import UsageError
    from onbox.templates import write

    if name is not None and not paths.valid_run_name(name):
        raise UsageError("invalid run name %r" % name, hint="letters, digits, '.', '_', '-'")
    written = write(kind, directory, force=force, name=name or "")
    if as_json:
        echo_json({"kind": kind, "directory": directory, "files": written})
        return
    click.echo("wrote %s (%s):" % (directory, TEMPLATES[kind].summary))
    for path in written:
        click.echo("  %s" % path)
    click.echo("next: set DURABLE in %s/train.sh, then run it (python train.py runs it here, unsupervised)"
               % directory.rstrip("/"))
