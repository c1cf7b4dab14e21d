"""Which runs on this box a launch of a command would continue: the part of `onbox match` that reads run records
(onboxctl run asks it before it names a run; the command is onbox/commands/match.py).

A run is the one a launch belongs to when its config.json records the same command (word for word), working
directory, durable target and checkpoint dir as the configuration the launch resolves to (plan.resolve: the same
layers, paths made absolute the same way). The checkpoint dir counts because `onbox run` refuses to continue a
run under another one (checks.check_same_run); the working directory because the same command in another
directory is another program. Runs of the same command that differ in the others are reported too, with what
differs, so that a new run can say why it is new.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Tuple

from onbox import paths
from onbox.config import RunConfig
from onbox.supervisor.rundir import RunDir

MATCH_KEYS = ("command", "workdir", "durable", "ckpt_dir")  # what makes a run the one a launch continues


def differences(saved: Mapping[str, Any], cfg: RunConfig) -> List[str]:
    """The MATCH_KEYS in which a run's record `saved` (its config.json) and the launch's `cfg` differ; unset and
    empty are the same (`durable` none on both sides: the run's checkpoints are on this box, in its run dir)."""
    return [k for k in MATCH_KEYS if (saved.get(k) or None) != (getattr(cfg, k) or None)]


def same_command_runs(cfg: RunConfig) -> List[Tuple[RunDir, Dict[str, Any], List[str]]]:
    """Every run on this box whose record holds `cfg.command`, with its record and what else differs ([]: the run
    this launch continues). A run whose config.json cannot be read is no candidate (`onbox status` names it)."""
    root = paths.runs_dir()
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []  # nothing has run here (or the runs dir cannot be listed: `onbox status` says why)
    out = []
    for name in names:
        if not paths.valid_run_name(name):
            continue
        rd = RunDir(os.path.join(root, name))
        try:
            saved = rd.load_config()
        except (OSError, ValueError, TypeError):
            continue
        if saved.get("command") != cfg.command:
            continue
        out.append((rd, saved, differences(saved, cfg)))
    return out
