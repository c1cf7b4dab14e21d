"""Zip-based checkpoints: torch zips (torch.save since 1.6), Keras 3 `.keras` (ModelCheckpoint's default), numpy
`.npz` (np.savez), stable-baselines3 `.zip` (model.save), and any other zip.

A zip's central directory is written last: without it (a save cut short, or still under way) the file is torn.
Structural check (cheap): the central directory parses, and every member's local header is where the directory
says and its data ends inside the file. Full check (verify): every member's CRC-32 too (torch.load skips them: a
flipped bit in a tensor loads silently), and for a torch zip that data.pkl names only storages that exist with the
bytes their tensors need. Self-checking: a whole zip is a finished save, committed without a quiet period.
"""
from __future__ import annotations

import os
import re
import struct
import zipfile
from typing import Optional

from onbox.checkpoints.formats import torchpickle
from onbox.checkpoints.formats.base import Format, FormatResult, StepReading

ZIP_MAGIC = b"PK\x03\x04"
ZIP_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... name length, extra length (30 bytes)
CHUNK = 8 * 1024 * 1024
ZIP_KINDS = {".keras": "keras", ".npz": "npz"}  # named kinds; a stable-baselines3 .zip, like any other, is "zip"
# Keras' ModelCheckpoint names: `{epoch:02d}` in the file name (`model.03.keras`, `weights.03-0.52.keras`): the
# first number standing alone is the epochs done
KERAS_EPOCH_RE = re.compile(r"(?:^|[._-])(\d+)(?=[._-])")


def check_zip(path: str, size: int, full: bool, torch_named: bool) -> FormatResult:
    """A zip file's checks; a torch layout inside makes it "torch-zip"; `torch_named` (.pt ...) requires one."""
    name_kind = next((k for s, k in ZIP_KINDS.items() if path.endswith(s)), "zip")
    kind = "torch-zip" if torch_named else name_kind
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        what = "torch zip" if torch_named else "zip"
        return FormatResult(kind, "%s truncated: its central directory (written last) is missing or damaged "
                                  "(%s bytes; the save was cut short or is still being written): %s" % (
                                      what, format(size, ","), e))
    with zf:
        layout = torchpickle.zip_layout(zf)
        if layout.problem is None:
            kind = "torch-zip"
        elif torch_named:
            return FormatResult("zip", "not a torch checkpoint: %s" % layout.problem)
        problem = check_members(path, size, zf)
        if problem or not full:
            return FormatResult(kind, problem)
        for info in zf.infolist():
            try:
                with zf.open(info) as member:
                    while member.read(CHUNK):
                        pass
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
                return FormatResult(kind, "zip member %s is damaged: %s" % (info.filename, e))  # "Bad CRC-32 ..."
        if kind != "torch-zip":
            return FormatResult(kind, None)
        return _check_storages(zf, layout)


def check_members(path: str, size: int, zf: zipfile.ZipFile) -> Optional[str]:
    """Every member's local header is where the central directory says, and its data ends before the directory."""
    end = min(size, getattr(zf, "start_dir", size))
    with open(path, "rb", buffering=0) as f:
        for info in zf.infolist():
            f.seek(info.header_offset)
            raw = f.read(ZIP_LOCAL_HEADER.size)
            if len(raw) < ZIP_LOCAL_HEADER.size:
                return "zip member %s starts past the end of the file (truncated)" % info.filename
            sig, name_len, extra_len = ZIP_LOCAL_HEADER.unpack(raw)
            if sig != ZIP_MAGIC:
                return "zip member %s: no local header at byte %d (overwritten or zero-filled)" % (
                    info.filename, info.header_offset)
            data_end = info.header_offset + ZIP_LOCAL_HEADER.size + name_len + extra_len + info.compress_size
            if data_end > end:
                return "zip member %s extends past the end of the file (truncated)" % info.filename
    return None


def _check_storages(zf: zipfile.ZipFile, layout: torchpickle.ZipLayout) -> FormatResult:
    """data.pkl parses (safely) and every storage it names is a member with the bytes its tensor needs."""
    try:
        _obj, storages = torchpickle.read_zip_object(zf, layout)
    except torchpickle.TooLarge as e:
        return FormatResult("torch-zip", None, "data.pkl not parsed, its storages not matched (%s, over the "
                                               "limit of %s bytes)" % (e, format(torchpickle.PICKLE_LIMIT, ",")))
    except torchpickle.Unreadable as e:
        return FormatResult("torch-zip", "%s does not parse: %s" % (layout.data_pkl.filename, e))
    members = {i.filename: i for i in zf.infolist()}
    for ref in storages:
        name = "%s/data/%s" % (layout.archive, ref.key)
        info = members.get(name)
        if info is None:
            return FormatResult("torch-zip", "tensor storage %s is missing (data.pkl refers to it)" % name)
        if ref.element_bytes is not None and info.file_size != ref.numel * ref.element_bytes:
            return FormatResult("torch-zip", "tensor storage %s holds %d bytes; its tensor needs %d (%d x %s)" % (
                name, info.file_size, ref.numel * ref.element_bytes, ref.numel, ref.type_name))
    return FormatResult("torch-zip", None)


class ZipFormat(Format):
    """Any zip that is not named like a torch checkpoint (torch.py has those)."""

    name = "zip"
    self_checking = True

    def claims_file(self, name: str, head: bytes) -> bool:
        return head[:4] == ZIP_MAGIC

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        return check_zip(path, size, full, torch_named=False)

    def step_of_file(self, path: str) -> Optional[StepReading]:
        return torchpickle.step_of_torch_file(path, os.path.basename(path))

    def step_of_name(self, name: str) -> Optional[int]:
        m = KERAS_EPOCH_RE.search(name) if name.endswith(".keras") else None
        return int(m.group(1)) if m else None


FORMAT = ZipFormat()
