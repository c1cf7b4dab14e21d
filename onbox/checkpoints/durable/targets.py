"""Choosing the durable target for a run: a mounted path (localpath.LocalPathTarget) or an rclone remote
(rclone.RcloneTarget), and what `onbox run` checks about it before it detaches."""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Optional

from onbox import fsutil
from onbox.checkpoints.durable import DurableTarget


def make_target(durable: str, run: str, runner: Optional[Callable[..., Any]] = None) -> DurableTarget:
    """A mounted path (absolute or relative) or an rclone remote (`remote:path`, `:sftp,host=...:path`)."""
    if os.path.isabs(durable) or ":" not in durable.split("/", 1)[0]:
        from onbox.checkpoints.durable.localpath import LocalPathTarget

        return LocalPathTarget(durable, run)
    from onbox.checkpoints.durable.rclone import RcloneTarget

    return RcloneTarget(durable, run, runner=runner)


def preflight(durable: str, which: Callable[[str], Optional[str]] = shutil.which) -> None:
    """What would make every commit to `durable` fail, checked in `onbox run` BEFORE it detaches (UnfitError,
    exit 3): a mounted path must be (or be creatable in) a writable directory; a remote needs rclone. Creates
    nothing. The remote itself is not contacted here: a flaky network at launch must not refuse the run."""
    from onbox.errors import UnfitError

    if os.path.isabs(durable) or ":" not in durable.split("/", 1)[0]:
        problem = fsutil.dir_problem(os.path.expanduser(durable))
        if problem:
            raise UnfitError("the durable target %s is unusable: %s" % (durable, problem),
                             hint="mount the volume (or fix its permissions), or give --durable another path")
    elif which("rclone") is None:
        raise UnfitError("the durable target %s is an rclone remote, but rclone is not installed" % durable,
                         hint="install rclone (https://rclone.org/install/), or give --durable a mounted path")


def overlap_problem(durable: str, run: str, ckpt_dir: str) -> Optional[str]:
    """Why a mounted durable target cannot serve a run whose trainer writes into `ckpt_dir` (None when it can).
    When <durable>/<run> and the checkpoint dir are the same directory or one holds the other, a commit would
    replace the trainer's own checkpoint by its staged copy (and start() would clean the trainer's directories
    as manifest-less leftovers): data loss, so it is refused before anything runs."""
    if not (os.path.isabs(durable) or ":" not in durable.split("/", 1)[0]):
        return None  # an rclone remote is never the local checkpoint dir
    run_root = os.path.realpath(os.path.join(os.path.expanduser(durable), run))
    ckpt = os.path.realpath(os.path.expanduser(ckpt_dir))

    def inside(a: str, b: str) -> bool:
        return a == b or a.startswith(b.rstrip(os.sep) + os.sep)

    if inside(ckpt, run_root) or inside(run_root, ckpt):
        return ("the checkpoint dir %s and the run's durable dir %s overlap: a commit would overwrite the "
                "trainer's checkpoints with their copies" % (ckpt, run_root))
    return None
