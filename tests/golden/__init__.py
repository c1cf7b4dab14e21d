"""Golden files for generated text. UPDATE_GOLDEN=1 rewrites them; a mismatch fails with a diff."""
from __future__ import annotations

import difflib
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def check_golden(name: str, text: str) -> None:
    path = os.path.join(HERE, name)
    if os.environ.get("UPDATE_GOLDEN") == "1" or not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if os.environ.get("UPDATE_GOLDEN") != "1":
            raise AssertionError("golden file %s was missing and has been written: review it and rerun" % path)
        return
    with open(path, encoding="utf-8") as f:
        want = f.read()
    if want != text:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), "golden/" + name, "actual"))
        raise AssertionError("output differs from golden file %s (UPDATE_GOLDEN=1 to accept):\n%s" % (path, diff))
