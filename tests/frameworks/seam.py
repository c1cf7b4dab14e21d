"""Test-only seams of the framework trainers here (run with the frameworks venv's Python; imports no onbox).

ONBOX_TEST_DIE_AT=<point>@N  SIGKILL this process the Nth time <point> is reached, inside the framework's own
                             save (wrapping its real writer, never re-implementing it):
    zip-close       zipfile.ZipFile.close of a file being written (np.savez, Keras' .keras): the central
                    directory, written last, never reaches the disk
    h5-close        h5py.File.close of a file being written (Keras' save_weights): the superblock's end of file
                    is never updated
    own-save        halfway through the trainer's own write (json_rename.py, xgb_train.py: the bytes the
                    framework produced, cut where a kill would cut them)
ONBOX_TEST_DIE_ONCE=<file>   die only while <file> does not exist (it is created just before dying): under a
                             supervisor that restarts the command, only the first attempt dies.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, Dict

POINTS = ("zip-close", "h5-close", "own-save")
_counts: Dict[str, int] = {}


def _target():
    spec = os.environ.get("ONBOX_TEST_DIE_AT")
    if not spec:
        return None, 0
    point, _, n = spec.partition("@")
    if point not in POINTS:
        print("unknown ONBOX_TEST_DIE_AT point %r (one of %s)" % (point, ", ".join(POINTS)), file=sys.stderr)
        sys.exit(2)
    return point, int(n or 1)


def reached(point: str) -> bool:
    """True when this is the Nth time `point` is reached and the process must die now."""
    want, n = _target()
    if want != point:
        return False
    once = os.environ.get("ONBOX_TEST_DIE_ONCE")
    if once and os.path.exists(once):
        return False
    _counts[point] = _counts.get(point, 0) + 1
    return _counts[point] == n


def die(point: str) -> None:
    once = os.environ.get("ONBOX_TEST_DIE_ONCE")
    if once:
        with open(once, "w") as f:
            f.write(point)
    print("onbox-test: SIGKILL at %s" % point, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    """Wrap the real writers named by ONBOX_TEST_DIE_AT (nothing when it is unset)."""
    point, _ = _target()
    if point == "zip-close":
        import zipfile

        real = zipfile.ZipFile.close

        def close(self: Any) -> None:
            if self.mode in ("w", "x", "a") and self.fp is not None and reached("zip-close"):
                self.fp.flush()  # what was written so far is on disk; the central directory never is
                die("zip-close")
            real(self)
        zipfile.ZipFile.close = close  # type: ignore[method-assign]
    elif point == "h5-close":
        import h5py

        real_h5 = h5py.File.close

        def h5close(self: Any) -> None:
            if self.mode == "r+" and reached("h5-close"):
                self.flush()
                die("h5-close")
            real_h5(self)
        h5py.File.close = h5close  # type: ignore[method-assign]


def progress(step: int, loss: float, **more: Any) -> None:
    """One progress line onbox's parser reads (a JSON line)."""
    print(json.dumps(dict(step=step, loss=round(float(loss), 6), **more)), flush=True)


def resumed(step: int, source: str) -> None:
    print("onbox-test: resumed at step %d from %s" % (step, source), flush=True)
