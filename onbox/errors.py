"""Exit codes shared by `onbox` and `onboxctl`, and the domain errors that map onto them.

Every error a user can cause or meet carries a message (what failed, where) and a hint (what to do). The CLI
prints `onbox: <message>` and `hint: <hint>` and exits with the error's code; it never shows a traceback for them.
"""
from __future__ import annotations

import enum
from typing import Optional


class ExitCode(enum.IntEnum):
    """Both CLIs: 0 done · 1 the job failed · 2 bad usage/input · 3 environment unfit · 75 preempted."""

    OK = 0
    JOB_FAILED = 1
    USAGE = 2
    UNFIT = 3
    PREEMPTED = 75  # EX_TEMPFAIL: a requeue/restart is expected


class OnboxError(Exception):
    """Base of every error meant for the user. Subclasses fix the exit code."""

    exit_code: ExitCode = ExitCode.JOB_FAILED

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(OnboxError):
    """Bad usage or bad input: a malformed file, an unknown name, an impossible option."""

    exit_code = ExitCode.USAGE


class UnfitError(OnboxError):
    """The environment cannot host the run (pre-flight): full disk, unwritable directory, missing tool."""

    exit_code = ExitCode.UNFIT


class JobFailed(OnboxError):
    """The supervised job (or an operation it asked for, like a sync) failed."""

    exit_code = ExitCode.JOB_FAILED


class Preempted(OnboxError):
    """The run was preempted; a requeue or restart is expected."""

    exit_code = ExitCode.PREEMPTED
