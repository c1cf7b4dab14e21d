"""numpy `.npy` files (np.save): the magic `\\x93NUMPY`, a version, a header length, a header dict (dtype, order,
shape), then the array's bytes. Structural check: the header parses and the file holds exactly the bytes its shape
and dtype need (a save cut short is shorter). Self-checking for plain dtypes; an object array (pickled) or a
structured dtype is checked for its header only, and completed by the trainer's rename, its close, or quiet.
(`.npz`, np.savez's zip of .npy files, is a zip: zips.py.)
"""
from __future__ import annotations

import ast
import math
import re
import struct
from typing import Any, Dict, Optional, Tuple

from onbox.checkpoints.formats.base import EMPTY, Format, FormatResult

MAGIC = b"\x93NUMPY"
HEADER_MAX = 1024 * 1024
DESCR_RE = re.compile(r"^[<>|=]?([biufcmMSUV])(\d+)$")  # '<f4', '|b1', '<U10' (10 characters of 4 bytes)


def _header(path: str) -> Tuple[Optional[Dict[str, Any]], int, Optional[str]]:
    """(the header dict, the offset of the data, a problem)."""
    with open(path, "rb") as f:
        pre = f.read(12)
        if len(pre) < 10 or pre[:6] != MAGIC:
            return None, 0, "not a .npy file (no \\x93NUMPY magic)"
        major = pre[6]
        if major == 1:
            n, start = struct.unpack("<H", pre[8:10])[0], 10
        elif major in (2, 3) and len(pre) >= 12:
            n, start = struct.unpack("<I", pre[8:12])[0], 12
        else:
            return None, 0, "npy version %d.%d is not one numpy writes" % (major, pre[7])
        if n > HEADER_MAX:
            return None, 0, "npy header of %d bytes is implausible" % n
        f.seek(start)
        raw = f.read(n)
    if len(raw) < n:
        return None, 0, "npy header cut short (truncated)"
    try:
        doc = ast.literal_eval(raw.decode("latin1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        return None, 0, "npy header does not parse: %s" % e
    if not isinstance(doc, dict) or not isinstance(doc.get("shape"), tuple):
        return None, 0, "npy header is not a dict with a shape"
    return doc, start + n, None


class NpyFormat(Format):
    name = "npy"
    self_checking = True

    def claims_file(self, name: str, head: bytes) -> bool:
        return head[:6] == MAGIC

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        if size == 0:
            return FormatResult("npy", EMPTY)
        doc, data_at, problem = _header(path)
        if doc is None:
            return FormatResult("npy", problem)
        descr = doc.get("descr")
        m = DESCR_RE.match(descr) if isinstance(descr, str) else None
        if m is None or m.group(1) == "O":
            return FormatResult("npy", None, "dtype %r: the data's size is not checked" % (doc.get("descr"),))
        width = int(m.group(2)) * (4 if m.group(1) == "U" else 1)
        try:
            count = math.prod(int(d) for d in doc["shape"])
        except (TypeError, ValueError):
            return FormatResult("npy", "npy shape %r is not a shape" % (doc["shape"],))
        need = data_at + count * width
        if size < need:
            return FormatResult("npy", "npy data truncated: shape %s of %s needs %s bytes, the file holds %s" % (
                doc["shape"], doc.get("descr"), format(need, ","), format(size, ",")))
        if size > need:
            return FormatResult("npy", "npy file holds %s bytes past its array (%s needed): not what np.save "
                                       "writes" % (format(size - need, ","), format(need, ",")))
        return FormatResult("npy", None)

    def finished(self, res: FormatResult) -> bool:
        return res.ok and not res.note


FORMAT = NpyFormat()
