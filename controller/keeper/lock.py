"""One keeper per config dir: a flock on its runs/ directory, held while it runs (a second keeper is refused)."""
from __future__ import annotations

import fcntl
import os
from typing import Optional

from onbox.errors import UsageError


class KeeperLock:
    """One keeper per config dir: an exclusive flock on its `runs/` directory (held open for the keeper's life; no
    lock file is written, and a killed keeper's lock goes with its process)."""

    def __init__(self, runs_dir: str) -> None:
        self.path = runs_dir
        self.fd: Optional[int] = None

    def acquire(self, create: bool = True) -> "KeeperLock":
        if create:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        elif not os.path.isdir(self.path):
            return self  # no runs recorded: nothing to keep, nothing to exclude
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UsageError("another `onboxctl keep` is watching the runs in %s" % self.path,
                             hint="one keeper per config dir: stop the other one (systemctl stop onbox-keep), or give "
                                  "this one its own ONBOX_CONFIG_DIR")
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
