"""JSON checkpoints: a trainer's own state saved with json.dump (the plain-Python loop of the README's journey),
XGBoost's `.json` models, and the JSON files other formats hold (HF's trainer_state.json, config.json).

Structural check: a file up to JSON_PARSE_ALWAYS parses (JSON Lines under a .json name pass, with a note: some
loggers write them, and a checkpoint dir must not be held back by a file no loader of it reads whole); a larger one
starts with { or [ and ends with the matching bracket (full=True parses it whatever its size). A prefix of an
object or an array never parses, so a small JSON document that parses is a finished save (self-checking); JSON
Lines and a large file checked by its ends alone are not: they are complete by the trainer's rename, by their
close, or by quiet. Step: the top-level object's first int among global_step, ..., step.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from onbox.checkpoints.formats.base import EMPTY, Format, FormatResult, StepReading, step_in

JSON_PARSE_ALWAYS = 1024 * 1024  # a JSON file up to this size is parsed even by the structural check
STEP_READ_LIMIT = 16 * 1024 * 1024  # a JSON checkpoint's step is read from files up to this size


class JsonFormat(Format):
    name = "json"
    self_checking = True

    def claims_file(self, name: str, head: bytes) -> bool:
        return name.endswith(".json")

    def check(self, path: str, size: int, full: bool) -> FormatResult:
        return _check_json(path, size, full)

    def finished(self, res: FormatResult) -> bool:
        return res.ok and not res.note  # one document, parsed whole

    def step_of_file(self, path: str) -> Optional[StepReading]:
        try:
            if os.path.getsize(path) > STEP_READ_LIMIT:
                return None
            with open(path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError):
            return None
        found = step_in(doc)
        return StepReading(found.step, "%s:%s" % (os.path.basename(path), found.source)) if found else None


def check_json(path: str) -> FormatResult:
    """Parse a JSON file a known format requires (Hugging Face's trainer_state.json, written last)."""
    try:
        return _check_json(path, os.path.getsize(path), full=True, strict=True)
    except OSError as e:
        return FormatResult("json", "cannot read: %s" % (e.strerror or e))


def _check_json(path: str, size: int, full: bool, strict: bool = False) -> FormatResult:
    """`strict`: one JSON document (a file a format requires). Else JSON Lines under a .json name pass too (some
    loggers write them): a checkpoint dir must not be held back forever by a file no loader of it reads whole."""
    if size == 0:
        return FormatResult("json", EMPTY)
    if full or strict or size <= JSON_PARSE_ALWAYS:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            json.loads(raw.decode("utf-8"))
            return FormatResult("json", None)
        except (UnicodeDecodeError, ValueError) as e:
            error = e
        if not strict and _json_lines(raw):
            return FormatResult("json", None, "JSON Lines, not one JSON document")
        return FormatResult("json", "not valid JSON (torn or still being written?): %s" % error)
    with open(path, "rb", buffering=0) as f:
        head = f.read(4096).lstrip()
        f.seek(max(0, size - 4096))
        tail = f.read().rstrip()
    closer = {b"{": b"}", b"[": b"]"}.get(head[:1])
    if closer is None or not tail.endswith(closer):
        return FormatResult("json", "not a whole JSON document: it %s (torn or still being written?)" % (
            "ends with %r" % tail[-16:].decode("utf-8", "replace") if closer else "does not start with { or ["))
    return FormatResult("json", None, "large JSON: only its ends checked (full=False)")


def _json_lines(raw: bytes) -> bool:
    lines = [line for line in raw.splitlines() if line.strip()]
    try:
        return len(lines) > 1 and all(isinstance(json.loads(line.decode("utf-8")), (dict, list)) for line in lines)
    except (UnicodeDecodeError, ValueError):
        return False


FORMAT = JsonFormat()
