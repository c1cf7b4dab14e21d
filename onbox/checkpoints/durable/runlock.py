"""The run's commit lock: one writer of a run's durable checkpoints and index at a time on this box.

`<run_dir>/checkpoints.lock`, an flock. The agent's commit thread, `onbox sync`, a restore, and `onbox verify`
recording a re-check in `checkpoints_index.json` all take it, so a read-modify-write of the index never races a
commit (whose start() would also clean another writer's staging dir as a leftover).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Iterator, Optional

from onbox import paths

POLL_S = 0.05


@contextlib.contextmanager
def commit_lock(run_dir: str, timeout: Optional[float] = None) -> Iterator[None]:
    """Hold the run's commit lock. `timeout` None: wait as long as it takes; else TimeoutError after that many
    seconds (a commit of a large checkpoint can hold it for minutes)."""
    fd = os.open(os.path.join(run_dir, paths.COMMIT_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError("%s is held by another commit" % os.path.join(run_dir, paths.COMMIT_LOCK_FILE))
                    time.sleep(POLL_S)
        yield
    finally:
        os.close(fd)  # releases the flock
