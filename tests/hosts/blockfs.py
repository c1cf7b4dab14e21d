"""A filesystem on a block device of its own: an ext4 image loop-mounted for one test (needs root, mkfs.ext4 from
e2fsprogs and a loop device; skipped, saying which is missing). What a durable volume on a disk is to a commit:
another filesystem than the source's (copy_file_range answers EXDEV), and one that fills."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Any, Iterator

import pytest


@contextlib.contextmanager
def ext4_volume(path: Any, size_mb: int) -> Iterator[str]:
    """Make a `size_mb` MiB ext4 image next to `path` (no blocks reserved for root) and mount it at `path`;
    unmounted (which frees the loop device) and deleted at the end."""
    if os.geteuid() != 0:
        pytest.skip("loop-mounting an ext4 image needs root")
    mkfs = shutil.which("mkfs.ext4") or ("/usr/sbin/mkfs.ext4" if os.path.exists("/usr/sbin/mkfs.ext4") else None)
    if mkfs is None:
        pytest.skip("no mkfs.ext4 (e2fsprogs; build/sysdeps.sh installs it)")
    path = str(path)
    image = path + ".img"
    os.makedirs(path, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size_mb * 1024 * 1024)
    try:
        made = subprocess.run([mkfs, "-q", "-F", "-m", "0", image], capture_output=True, text=True, timeout=60)
        if made.returncode != 0:
            pytest.skip("mkfs.ext4 failed here: %s" % made.stderr.strip())
        mounted = subprocess.run(["mount", "-o", "loop", image, path], capture_output=True, text=True, timeout=60)
        if mounted.returncode != 0:
            pytest.skip("cannot loop-mount an image here: %s" % mounted.stderr.strip())
        try:
            yield path
        finally:
            if subprocess.run(["umount", path], capture_output=True, timeout=60).returncode != 0:
                subprocess.run(["umount", "-l", path], capture_output=True, timeout=60)
    finally:
        os.unlink(image)
