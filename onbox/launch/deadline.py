"""The run's deadline, resolved at the launch (onbox/supervisor/deadline.py acts on it).

Where it comes from, first that says:
  --deadline WHEN   an absolute time (UTC `Z` or an offset) or a duration from this launch (config.parse_deadline);
                    `none`: no deadline, none looked for; `slurm`: the Slurm job's EndTime, refused (exit 3) when
                    it cannot be read
  Slurm             inside a job ($SLURM_JOB_ID): its EndTime from `scontrol show job` (its time limit); when it
                    cannot be read the run starts without a deadline and says so (a warning): Slurm's own signal
                    still ends it
  the profile       its [session] hours (kaggle: 12 h, 9 h on a TPU), counted from the session's start: PID 1's
                    start (the kernel's container, or the machine), never later than this launch

Then checked: a --deadline in the past, or one that leaves less than grace + the final commit + deadline_margin,
is refused (exit 2, nothing started); a platform's that cannot be kept (a one-minute Slurm job, a session nearly
over) is a warning, and the run goes on without a deadline of its own: the job already runs, and the platform's own
signal still stops it. The result goes to config.json as deadline_at and deadline_source: an adopting agent keeps it; a relaunch
resolves its own here (a duration counts from the relaunch).
"""
from __future__ import annotations

import os
import time
from typing import Any, List, Mapping, Optional, Tuple

from onbox.config import DEADLINE_OFF, DEADLINE_SLURM, RunConfig, parse_deadline
from onbox.errors import UnfitError, UsageError
from onbox.supervisor.stop import grace_for

FLAG = "flag"


def resolve(cfg: RunConfig, environ: Mapping[str, str], run_dir: str, now: Optional[float] = None,
            runner: Optional[Any] = None) -> List[str]:
    """Set cfg.deadline_at and cfg.deadline_source (None: no deadline) for this launch; return the warnings to
    say. Raises UsageError / UnfitError as the module docstring says. `runner`: scontrol's (tests)."""
    now = time.time() if now is None else now
    cfg.deadline_at = cfg.deadline_source = None
    spec = (cfg.deadline or "").strip()
    if spec.lower() == DEADLINE_OFF:
        return []
    warnings: List[str] = []
    if spec and spec.lower() != DEADLINE_SLURM:
        at: Optional[float] = parse_deadline(spec, now)
        source = FLAG
    else:
        at, source, warnings = _found(cfg, environ, now, spec.lower() == DEADLINE_SLURM, runner)
    if at is None:
        return warnings
    problem = time_left_problem(cfg, at, source, now, run_dir)
    if problem is not None and source == FLAG:
        raise UsageError(problem, hint="give a later time or a duration (e.g. --deadline 11h40m), a shorter --grace "
                                       "or deadline_margin (ONBOX_DEADLINE_MARGIN), or --deadline none")
    if problem is not None:
        # the platform's own end (a Slurm time limit, a session) is no input of the user's: the job already runs,
        # and refusing would end it with nothing trained; it runs, stopped by the platform's own signal
        return [*warnings, "%s: the run has no deadline of its own (the platform's signal still stops it; give "
                           "--deadline WHEN, or --deadline none to silence this)" % problem]
    cfg.deadline_at, cfg.deadline_source = at, source
    return warnings


def _found(cfg: RunConfig, environ: Mapping[str, str], now: float, want_slurm: bool,
           runner: Optional[Any]) -> Tuple[Optional[float], str, List[str]]:
    """The platform's deadline: the Slurm job's end, else the profile's session hours."""
    from onbox.slurm.job import SlurmError, SlurmJob, end_time

    job = SlurmJob.from_env(environ)
    if want_slurm and job is None:
        raise UsageError("--deadline slurm: not inside a Slurm job (no SLURM_JOB_ID)",
                         hint="give --deadline WHEN (a time or a duration), or run it in a job")
    if job is not None:
        try:
            return end_time(job.job_id, runner=runner), "slurm", []
        except SlurmError as e:
            if want_slurm:
                raise UnfitError("--deadline slurm: the end time of Slurm job %s cannot be read: %s"
                                 % (job.job_id, e.message), hint=e.hint or "give --deadline WHEN instead")
            return None, "slurm", ["the end time of Slurm job %s cannot be read (%s): the run has no deadline; "
                                   "Slurm's signal still stops it (give --deadline WHEN, or --deadline none to "
                                   "silence this)" % (job.job_id, e.message)]
    return _session(cfg, environ, now)


def _session(cfg: RunConfig, environ: Mapping[str, str], now: float) -> Tuple[Optional[float], str, List[str]]:
    """The profile's [session] hours (tpu_hours when one of its tpu_env variables is set), from the session's
    start."""
    from onbox.platform import profiles

    if not cfg.profile:
        return None, "", []
    try:
        session = profiles.load(cfg.profile).table("session")
    except UsageError:
        return None, "", []
    hours = session.get("hours")
    if any(environ.get(v) for v in session.get("tpu_env") or []) and session.get("tpu_hours") is not None:
        hours = session["tpu_hours"]
    if hours is None:
        return None, "", []
    return session_start(now) + float(hours) * 3600.0, cfg.profile, []


def session_start(now: float, proc: str = "/proc") -> float:
    """When the session began: PID 1's start (the container of a notebook kernel, or the machine), never later
    than `now`; `now` when /proc does not say."""
    from onbox.proc import start_time

    try:
        ticks = start_time(1, proc)
        with open(os.path.join(proc, "stat")) as f:
            btime = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        hz = float(os.sysconf("SC_CLK_TCK"))
    except (OSError, StopIteration, ValueError, IndexError):
        return now
    if ticks is None or hz <= 0:
        return now
    return min(now, btime + ticks / hz)


def time_left_problem(cfg: RunConfig, at: float, source: str, now: float, run_dir: str) -> Optional[str]:
    """Why deadline `at` cannot be kept (in the past, or too near for the stop: grace + the final commit + the
    margin), or None."""
    from onbox.subsystems import launch_commit_estimate

    shown = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    where = "--deadline %s" % cfg.deadline if source == FLAG else "the %s session's end" % source
    if at <= now:
        return "%s (%s) is in the past (%.0f s ago)" % (where, shown, now - at)
    grace = grace_for(cfg.grace, None)
    commit = launch_commit_estimate(cfg, run_dir)
    need = grace + commit + cfg.deadline_margin
    if at - now < need:
        return ("%s (%s) leaves %.0f s, shorter than the stop needs: grace %.0f s + final commit ~%.1f s + "
                "deadline_margin %.0f s = %.0f s" % (where, shown, at - now, grace, commit, cfg.deadline_margin, need))
    return None
