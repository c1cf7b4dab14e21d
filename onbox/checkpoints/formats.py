"""Format checks for checkpoint files, without torch.

Two depths:
  structural (cheap, reads the ends of a file): a torch zip has its end-of-central-directory record and every
  member lies inside the file; a safetensors header parses and its offsets cover exactly the buffer. A torn
  file (torch.save is not atomic; nanoGPT rewrites ckpt.pt in place) fails these, so detection uses them.
  full (reads every byte): the structural checks plus the CRC-32 of every zip member (torch.load skips the CRCs),, used by `onbox verify`.
Files of other formats (pickles, JSON, optimizer shards) have no self-check: the manifest hash covers them.
"""
from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import NamedTuple, Optional

ZIP_MAGIC = b"PK\x03\x04"
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
CHUNK = 8 * 1024 * 1024
TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")  # what torch.save writes (zip since torch 1.6, pickle before)


class FormatResult(NamedTuple):
    kind: str  # "torch-zip" | "zip" | "safetensors" | "other"
    problem: Optional[str]  # None when the checks passed (or the format has none)

    @property
    def ok(self) -> bool:
        return self.problem is None


def sniff(path: str) -> str:
    """The format of a file by its first bytes (and the .safetensors suffix)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] == ZIP_MAGIC:
        return "zip"
    if path.endswith(".safetensors"):
        return "safetensors"
    if len(head) == 8:
        n = struct.unpack("<Q", head)[0]
        if 2 <= n <= SAFETENSORS_MAX_HEADER:
            with open(path, "rb") as f:
                f.seek(8)
                if f.read(1) == b"{":
                    return "safetensors"
    return "other"


def check_file(path: str, full: bool = False) -> FormatResult:
    """Check one file; `full` also reads every zip member and checks its CRC-32."""
    try:
        kind = sniff(path)
        if kind == "zip":
            return _check_zip(path, full)
        if kind == "safetensors":
            return FormatResult("safetensors", _check_safetensors(path))
        if path.endswith(TORCH_SUFFIXES) and os.path.getsize(path) == 0:
            # torch.save buffers its first write: a save killed early (OOM, SIGKILL) leaves 0 bytes, which would
            # otherwise pass as a quiet "other" file and be committed, then handed to the trainer
            return FormatResult("other", "empty file (torn: its save was killed before any byte reached the disk)")
        return FormatResult("other", None)
    except OSError as e:
        return FormatResult("other", "cannot read: %s" % (e.strerror or e))


def _check_zip(path: str, full: bool) -> FormatResult:
    size = os.path.getsize(path)
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        return FormatResult("zip", "zip central directory missing or damaged (truncated or still being written?): %s" % e)
    with zf:
        infos = zf.infolist()
        is_torch = any(i.filename == "data.pkl" or i.filename.endswith("/data.pkl") for i in infos)
        kind = "torch-zip" if is_torch else "zip"
        for info in infos:
            # the local header (30 bytes + name) and the data must lie inside the file
            if info.header_offset + 30 + len(info.filename) + info.compress_size > size:
                return FormatResult(kind, "zip member %s extends past the end of the file (truncated)" % info.filename)
        if not full:
            return FormatResult(kind, None)
        for info in infos:
            try:
                with zf.open(info) as member:
                    while member.read(CHUNK):
                        pass
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:  # "Bad CRC-32 for file ..."
                return FormatResult(kind, "zip member %s is damaged: %s" % (info.filename, e))
    return FormatResult(kind, None)


def _check_safetensors(path: str) -> Optional[str]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "safetensors file shorter than its 8-byte header length (truncated)"
        n = struct.unpack("<Q", head)[0]
        if n > SAFETENSORS_MAX_HEADER or 8 + n > size:
            return "safetensors header length %d does not fit in the file of %d bytes (truncated?)" % (n, size)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return "safetensors header is not valid JSON: %s" % e
    if not isinstance(header, dict):
        return "safetensors header is not a JSON object"
    buffer_len = size - 8 - n
    end_max = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            width = SAFETENSORS_DTYPE_BYTES.get(meta["dtype"])
            count = 1
            for dim in meta["shape"]:
                count *= int(dim)
        except (KeyError, TypeError, ValueError):
            return "safetensors tensor %s has a malformed entry" % name
        if not (0 <= begin <= end <= buffer_len):
            return "safetensors tensor %s data [%d, %d) lies outside the %d-byte buffer (truncated?)" % (
                name, begin, end, buffer_len)
        if width is not None and end - begin != count * width:
            return "safetensors tensor %s: %d bytes for shape %s of %s" % (name, end - begin, meta["shape"], meta["dtype"])
        end_max = max(end_max, end)
    if end_max != buffer_len:
        return "safetensors buffer is %d bytes but the tensors cover %d" % (buffer_len, end_max)
    return None
