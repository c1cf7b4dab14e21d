"""HDF5 files (`.h5`, `.hdf5`, `.weights.h5`: Keras' save_weights and BackupAndRestore, h5py): a superblock at byte
0 (or 512, 1024, ... for a user block) whose end-of-file address says how long the file is. HDF5 writes that
address when it flushes the file at its close: a file still being written, or a save cut short, is longer or
shorter than it says. Structural check: the signature, a superblock version HDF5 writes (0 to 3), and the
end-of-file address (from the base address) equal to the file's size. Self-checking.
"""
from __future__ import annotations

import struct
from typing import Optional, Tuple

from onbox.checkpoints.formats.base import EMPTY, Format, FormatResult

SIGNATURE = b"\x89HDF\r\n\x1a\n"
SUFFIXES = (".h5", ".hdf5", ".hdf")
SEARCH = (0, 512, 1024, 2048, 4096, 8192, 16384)  # where a superblock may start (after a user block)
UNDEFINED = 0xFFFFFFFFFFFFFFFF


def _superblock(path: str) -> Tuple[Optional[int], Optional[int], Optional[str]]:
    """(its offset, the end-of-file address counted from the base address, a problem)."""
    with open(path, "rb") as f:
        for at in SEARCH:
            f.seek(at)
            raw = f.read(96)
            if raw[:8] != SIGNATURE:
                continue
            version = raw[8] if len(raw) > 8 else -1
            if version in (0, 1):
                size_off = raw[13] if len(raw) > 13 else 0
                fields = 24 if version == 0 else 28  # the fixed fields before the addresses
            elif version in (2, 3):
                size_off = raw[9] if len(raw) > 9 else 0
                fields = 12
            else:
                return at, None, "HDF5 superblock version %d is not one HDF5 writes" % version
            if size_off not in (2, 4, 8):
                return at, None, "HDF5 superblock's size of offsets %d is not 2, 4 or 8" % size_off
            fmt = {2: "<H", 4: "<I", 8: "<Q"}[size_off]
            # v0/1: base, free-space, end-of-file, driver; v2/3: base, superblock extension, end-of-file, root
            need = fields + 4 * size_off
            if len(raw) < need:
                return at, None, "HDF5 superblock cut short (truncated)"
            base = struct.unpack_from(fmt, raw, fields)[0]
            eof = struct.unpack_from(fmt, raw, fields + 2 * size_off)[0]
            if eof == UNDEFINED or eof == (1 << (8 * size_off)) - 1:
                return at, None, "HDF5 end-of-file address undefined (the file was never closed)"
            return at, base + eof, None
    return None, None, "not an HDF5 file (no superblock signature)"


class Hdf5Format(Format):
    name = "hdf5"
    self_checking = True

    def claims_file(self, name: str, head: bytes) -> bool:
        return head[:8] == SIGNATURE or name.endswith(SUFFIXES)

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        if size == 0:
            return FormatResult("hdf5", EMPTY)
        _at, end, problem = _superblock(path)
        if problem is not None or end is None:
            return FormatResult("hdf5", problem)
        if end > size:
            return FormatResult("hdf5", "HDF5 file truncated: its superblock says %s bytes, the file holds %s" % (
                format(end, ","), format(size, ",")))
        if end < size:
            return FormatResult("hdf5", "HDF5 file still being written, or torn: it holds %s bytes past the end "
                                        "its superblock says (%s)" % (format(size - end, ","), format(end, ",")))
        return FormatResult("hdf5", None)


FORMAT = Hdf5Format()
