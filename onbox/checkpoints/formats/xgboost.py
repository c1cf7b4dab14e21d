"""XGBoost models: `.ubj` (Universal Binary JSON, the default of save_model since 2.1) and `.json`
(jsonfile.py), as TrainingCheckPoint writes them every `interval` rounds: `<dir>/<name>_<iteration>.ubj`, each a new
file written in place. Structural check: the UBJSON document walks whole, from its opening `{` to the matching
`}` at the last byte (files over WALK_LIMIT: the two ends only, with a note). Self-checking. Step: the name's
iteration + 1, the boosting rounds the model holds.
"""
from __future__ import annotations

import re
import struct
from typing import Optional

from onbox.checkpoints.formats.base import EMPTY, Format, FormatResult

WALK_LIMIT = 256 * 1024 * 1024
NAME_RE = re.compile(r"_(\d+)\.(ubj|json)$")
SIZES = {b"i": 1, b"U": 1, b"I": 2, b"l": 4, b"L": 8, b"d": 4, b"D": 8, b"C": 1}
INTS = {b"i": ">b", b"U": ">B", b"I": ">h", b"l": ">i", b"L": ">q"}


class Torn(Exception):
    pass


class _Walker:
    """Walks a UBJSON document without building it (strings and number arrays are skipped by their lengths)."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.buf):
            raise Torn("ends inside a value at byte %d" % self.at)
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def marker(self) -> bytes:
        m = self.take(1)
        while m == b"N":  # no-op
            m = self.take(1)
        return m

    def count(self, m: Optional[bytes] = None) -> int:
        m = m or self.marker()
        if m not in INTS:
            raise Torn("a length of type %r at byte %d" % (m, self.at - 1))
        n = int(struct.unpack(INTS[m], self.take(SIZES[m]))[0])
        if n < 0:
            raise Torn("a negative length at byte %d" % self.at)
        return n

    def value(self, m: bytes, depth: int = 0) -> None:
        if depth > 256:
            raise Torn("nested deeper than 256 levels")
        if m in (b"Z", b"T", b"F"):
            return
        if m in SIZES:
            self.take(SIZES[m])
        elif m in (b"S", b"H"):
            self.take(self.count())
        elif m in (b"[", b"{"):
            self.container(m, depth + 1)
        else:
            raise Torn("an unknown marker %r at byte %d" % (m, self.at - 1))

    def container(self, opener: bytes, depth: int) -> None:
        kind: Optional[bytes] = None
        n: Optional[int] = None
        m = self.marker()
        if m == b"$":
            kind = self.take(1)
            m = self.marker()
            if m != b"#":
                raise Torn("a typed container without a count at byte %d" % self.at)
        if m == b"#":
            n = self.count()
        closer = b"]" if opener == b"[" else b"}"
        if n is not None:
            for _ in range(n):
                if opener == b"{":
                    self.take(self.count())  # the key
                if kind is not None and kind in SIZES and opener == b"[":
                    self.take(SIZES[kind] * (n - _))  # a typed array of numbers: its bytes at once
                    break
                self.value(kind if kind is not None else self.marker(), depth)
            return
        while True:
            if m == closer:
                return
            if opener == b"{":
                self.take(self.count(m))  # the key's length marker is m
                m = self.marker()
            self.value(m, depth)
            m = self.marker()


class UbjFormat(Format):
    name = "xgboost-ubj"
    self_checking = True

    def claims_file(self, name: str, head: bytes) -> bool:
        return name.endswith(".ubj")

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        if size == 0:
            return FormatResult(self.name, EMPTY)
        if size > WALK_LIMIT and not full:
            with open(path, "rb", buffering=0) as f:
                first = f.read(1)
                f.seek(size - 1)
                last = f.read(1)
            if first == b"{" and last == b"}":
                return FormatResult(self.name, None, "large UBJSON: only its ends checked")
            return FormatResult(self.name, "UBJSON model torn: it does not run from { to } (%s bytes)" % format(
                size, ","))
        with open(path, "rb") as f:
            buf = f.read()
        w = _Walker(buf)
        try:
            if w.marker() != b"{":
                return FormatResult(self.name, "not a UBJSON model: it does not start with {")
            w.container(b"{", 1)
        except Torn as e:
            return FormatResult(self.name, "UBJSON model torn or still being written: it %s (%s bytes)" % (
                e, format(size, ",")))
        if w.at != len(buf):
            return FormatResult(self.name, "UBJSON model holds %s bytes past its document" % format(
                len(buf) - w.at, ","))
        return FormatResult(self.name, None)

    def finished(self, res: FormatResult) -> bool:
        return res.ok and not res.note

    def step_of_name(self, name: str) -> Optional[int]:
        m = NAME_RE.search(name)
        return int(m.group(1)) + 1 if m else None


FORMAT = UbjFormat()
