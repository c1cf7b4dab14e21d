"""torch.save's files: `.pt .pth .ckpt .bin` (PyTorch, Lightning, nanoGPT, HF's pytorch_model.bin), and legacy torch
pickles under any name.

A file named like a torch checkpoint must be one of the two layouts torch.save writes (torchpickle.py): a torch
zip (zips.py checks it) or a legacy torch pickle. Anything else — zero-filled, text, random, cut short — is a
problem with a reason, because handing it to a trainer as the checkpoint to resume from crash-loops the run.

  legacy pickle (structural): the magic number, protocol version and sys_info pickles parse, the object pickle and
    the storage key list parse (a growing prefix read, up to torchpickle.PICKLE_LIMIT), and every storage record
    lies inside the file with the element count its tensor says. No checksums: the manifest hash covers its bytes.
    Not self-checking: a legacy save is complete when quiet.
  step: the top-level dict's first int among global_step, global_steps, iter_num, step, iteration, iter.
"""
from __future__ import annotations

import os
from typing import Optional

from onbox.checkpoints.formats import torchpickle, zips
from onbox.checkpoints.formats.base import EMPTY, Format, FormatResult, StepReading, as_text
from onbox.checkpoints.formats.safetensors import looks_safetensors

TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")  # what torch.save writes (zip since torch 1.6, pickle before)
DESCRIBE_WHOLE = 1024 * 1024  # a non-torch file up to this size is read whole to say what it is


class TorchFormat(Format):
    name = "torch-zip"
    self_checking = True  # a torch zip; a legacy pickle is judged by quiet (TorchLegacyFormat below)

    def claims_file(self, name: str, head: bytes) -> bool:
        return name.endswith(TORCH_SUFFIXES)

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        if size == 0:
            # torch.save buffers its first write: a save killed early (OOM, SIGKILL) leaves 0 bytes, which would
            # otherwise pass as a quiet file and be committed, then handed to the trainer
            return FormatResult("other", EMPTY)
        with open(path, "rb", buffering=0) as f:
            head = f.read(64)
        if head[:4] == zips.ZIP_MAGIC:
            return zips.check_zip(path, size, full, torch_named=True)
        if torchpickle.looks_legacy(head):
            return check_legacy(path)
        if looks_safetensors(head):
            return FormatResult("safetensors", "not a torch checkpoint: a safetensors file (torch.load cannot "
                                               "read it)")
        return FormatResult("other", "not a torch checkpoint: %s" % describe(path, size))

    def finished(self, res: FormatResult) -> bool:
        return res.ok and res.kind == "torch-zip"  # a legacy pickle has no last-written part: quiet decides

    def step_of_file(self, path: str) -> Optional[StepReading]:
        return torchpickle.step_of_torch_file(path, os.path.basename(path))


class TorchLegacyFormat(Format):
    """A legacy torch pickle under a name torch.save does not use by default."""

    name = "torch-legacy"

    def claims_file(self, name: str, head: bytes) -> bool:
        return torchpickle.looks_legacy(head)

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        return check_legacy(path)

    def step_of_file(self, path: str) -> Optional[StepReading]:
        return torchpickle.step_of_torch_file(path, os.path.basename(path))


def check_legacy(path: str) -> FormatResult:
    try:
        lf = torchpickle.read_legacy(path)
    except torchpickle.TooLarge as e:
        return FormatResult("torch-legacy", None, "storages not walked: %s (over the limit of %s bytes)" % (
            e, format(torchpickle.PICKLE_LIMIT, ",")))
    except torchpickle.Truncated as e:
        return FormatResult("torch-legacy", "torch pickle truncated: %s" % e)
    except torchpickle.Unreadable as e:
        return FormatResult("torch-legacy", "torch pickle damaged: %s" % e)
    problem = torchpickle.walk_legacy_storages(path, lf)
    return FormatResult("torch-legacy", "torch pickle %s" % problem if problem else None)


def describe(path: str, size: int) -> str:
    """What a file that is not a torch checkpoint holds, in words a user recognises."""
    with open(path, "rb") as f:
        if size <= DESCRIBE_WHOLE:
            whole = f.read()
            if not whole.strip(b"\x00"):
                return "the file is %s zero bytes (its data never reached the disk)" % format(size, ",")
            head = whole[:4096]
        else:
            head = f.read(4096)
            f.seek(size - 4096)
            tail = f.read(4096)
            if not head.strip(b"\x00") and not tail.strip(b"\x00"):
                return "the file's first and last 4,096 bytes are zeros (%s bytes; its data never reached the " \
                       "disk)" % format(size, ",")
    if not head[:64].strip(b"\x00"):
        return "it starts with zero bytes where a torch zip or pickle header belongs (%s bytes; torn)" % format(
            size, ",")
    text = as_text(head)
    if text is not None:
        first = " ".join(text.split())[:60]
        return 'text ("%s%s")' % (first, "..." if len(text) > 60 else "")
    return "unrecognised content (%s bytes, starting %s): neither a torch zip nor a torch pickle" % (
        format(size, ","), head[:8].hex(" "))


FORMATS = (TorchFormat(), TorchLegacyFormat())
