"""safetensors files (Hugging Face save_pretrained, safetensors.torch.save_file): an 8-byte header length, a JSON
header naming each tensor's dtype, shape and byte range, then the buffer. Structural check: the header parses and
its tensors cover exactly the buffer, each with the bytes its shape and dtype need. Self-checking: a save cut
short leaves a buffer shorter than its header says.
"""
from __future__ import annotations

import json
import struct
from typing import Optional

from onbox.checkpoints.formats.base import EMPTY, Format, FormatResult

SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


def looks_safetensors(head: bytes) -> bool:
    """A plausible header length followed by the header's opening brace."""
    if len(head) < 9:
        return False
    n = struct.unpack("<Q", head[:8])[0]
    return 2 <= n <= SAFETENSORS_MAX_HEADER and head[8:9] == b"{"


class SafetensorsFormat(Format):
    name = "safetensors"
    self_checking = True

    def claims_file(self, name: str, head: bytes) -> bool:
        return name.endswith(".safetensors") or looks_safetensors(head)

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        if size == 0:
            return FormatResult("other", EMPTY)
        return FormatResult("safetensors", _check_safetensors(path, size))


def _check_safetensors(path: str, size: int) -> Optional[str]:
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


FORMAT = SafetensorsFormat()
