"""A disk that fills: a real size-limited tmpfs mounted for one test (needs root; skipped, saying why, without)."""
from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Any, Iterator

import pytest


@contextlib.contextmanager
def tmpfs(path: Any, **opts: Any) -> Iterator[str]:
    """Mount a tmpfs at `path` with mount options `opts` (size="8m", nr_inodes="64"); unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    os.makedirs(path, exist_ok=True)
    spec = ",".join("%s=%s" % kv for kv in opts.items())
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", spec, "tmpfs", str(path)], capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        pytest.skip("cannot mount tmpfs here: %s" % proc.stderr.strip())
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30, check=False)
