"""The child's environment and argv: ONBOX_RUN, ONBOX_CKPT_DIR, ONBOX_RESUME_FROM, ... (README, `onbox run`)."""
from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, Optional

from onbox.config import AGENT_ONLY_VARS

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cpu_quota_cores(root: str = "/") -> Optional[float]:
    """CPUs the cgroup allows (quota / period), or None when unlimited or unknown. v2 cpu.max, v1 cfs files."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            rows = [line.strip().split(":", 2) for line in f if line.strip()]
    except OSError:
        return None
    for hier, controllers, path in rows:
        rel = path.lstrip("/")
        if hier == "0" and controllers == "":
            try:
                with open(os.path.join(root, "sys/fs/cgroup", rel, "cpu.max")) as f:
                    quota, period = f.read().split()
                if quota != "max":
                    return int(quota) / int(period)
            except (OSError, ValueError):
                pass
        elif "cpu" in controllers.split(","):
            base = os.path.join(root, "sys/fs/cgroup", "cpu,cpuacct" if "cpuacct" in controllers else "cpu", rel)
            if not os.path.isdir(base):
                base = os.path.join(root, "sys/fs/cgroup/cpu", rel)
            try:
                with open(os.path.join(base, "cpu.cfs_quota_us")) as f:
                    quota_us = int(f.read())
                with open(os.path.join(base, "cpu.cfs_period_us")) as f:
                    period_us = int(f.read())
                if quota_us > 0 and period_us > 0:
                    return quota_us / period_us
            except (OSError, ValueError):
                pass
    return None


def child_env(base: Mapping[str, str], run: str, ckpt_dir: str, resume_from: Optional[str], restart_count: int,
              metrics_file: str, preempt_file: str, extra: Mapping[str, str],
              quota_cores: Optional[float] = None) -> Dict[str, str]:
    """The user's environment minus the agent's secrets (U34), plus the ONBOX_* contract, PYTHONUNBUFFERED=1
    (U43) and thread caps (U40). `extra` (the run's --env) is applied last, as given."""
    env = {k: v for k, v in base.items() if k not in AGENT_ONLY_VARS}
    env.update({
        "ONBOX_RUN": run,
        "ONBOX_CKPT_DIR": ckpt_dir,
        "ONBOX_RESUME_FROM": resume_from or "",
        "ONBOX_RESTART_COUNT": str(restart_count),
        "ONBOX_METRICS_FILE": metrics_file,
        "ONBOX_PREEMPT_FILE": preempt_file,
        # U43: block-buffered stdout into a file makes a healthy job look frozen
        "PYTHONUNBUFFERED": "1",
    })
    # U40: torch/numpy size their thread pools by the host's CPU count, not the cgroup quota: on a 4-CPU
    # container of a 128-core host that oversubscribes and starves the GPU. Cap them unless the user chose.
    if quota_cores is not None:
        cap = str(max(1, math.floor(quota_cores)))
        for var in THREAD_VARS:
            if not env.get(var):
                env[var] = cap
    env.update(extra)
    return env


def child_argv(command: List[str], resume_args: List[str], resume_from: Optional[str]) -> List[str]:
    """The command, plus the resume arguments (with {ckpt} expanded) only when a checkpoint exists."""
    if not resume_from:
        return list(command)
    return list(command) + [a.replace("{ckpt}", resume_from) for a in resume_args]
