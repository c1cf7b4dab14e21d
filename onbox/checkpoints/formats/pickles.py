"""Python pickles and joblib dumps (`.pkl`, `.pickle`, `.joblib`: scikit-learn models, XGBoost's as_pickle, a
trainer's own state): pickle protocol 2 and later start with PROTO (0x80 and the version) and end with STOP
(`.`); joblib writes numpy arrays inside that same stream. Structural check: both ends (a save cut short has no
STOP). Self-checking: STOP is the last byte pickle writes. Nothing of the file is unpickled.
"""
from __future__ import annotations

from onbox.checkpoints.formats.base import EMPTY, Format, FormatResult

SUFFIXES = (".pkl", ".pickle", ".joblib")
PROTO, STOP = 0x80, b"."


class PickleFormat(Format):
    name = "pickle"
    self_checking = True

    def claims_file(self, name: str, head: bytes) -> bool:
        return name.endswith(SUFFIXES)

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        if size == 0:
            return FormatResult("pickle", EMPTY)
        with open(path, "rb", buffering=0) as f:
            head = f.read(2)
            f.seek(size - 1)
            last = f.read(1)
        if len(head) < 2 or head[0] != PROTO or not 2 <= head[1] <= 5:
            # protocol 0/1 (text-era pickles) or a compressed joblib dump: no cheap end to check
            return FormatResult("pickle", None, "not a pickle of protocol 2 or later: only its hash is checked")
        if last != STOP:
            return FormatResult("pickle", "pickle truncated: it does not end with STOP (%s bytes; the save was cut "
                                          "short or is still being written)" % format(size, ","))
        return FormatResult("pickle", None)

    def finished(self, res: FormatResult) -> bool:
        return res.ok and not res.note


FORMAT = PickleFormat()
