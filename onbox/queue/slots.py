"""Where queue entries run: N slots side by side, or one slot per GPU that NVML sees, and the environment each
entry's agent gets."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Dict, List, Mapping, Optional

from onbox.config import RunConfig
from onbox.errors import UnfitError
from onbox.gpu.readings import inventory

# ONBOX_<FIELD> for every RunConfig field: how `onbox run` reads its settings from the environment
CONFIG_VARS = frozenset("ONBOX_" + f.name.upper() for f in dataclasses.fields(RunConfig))


@dataclasses.dataclass
class Slot:
    index: int
    gpu: Optional[int] = None  # the GPU (NVML index) this slot's entry gets; None: no GPU assignment


def parallel_slots(n: int) -> List[Slot]:
    return [Slot(i) for i in range(n)]


def gpu_slots(seam: Any = None) -> List[Slot]:
    """One slot per GPU of the NVML inventory; UnfitError (exit 3) on a box where NVML sees none."""
    inv = inventory(seam)
    if not inv.available or not inv.gpus:
        raise UnfitError("--per-gpu: no GPU here (%s)" % (inv.reason or "NVML lists no device"),
                         hint="run the queue with --parallel N (or one at a time) on a box without GPUs")
    return [Slot(i, g.index) for i, g in enumerate(inv.gpus)]


def agent_env(environ: Mapping[str, str], gpu: Optional[int]) -> Dict[str, str]:
    """The environment of an entry's agent. U32: a blanket setting must not override an entry's own; each entry
    already holds every setting it was queued with (its config.json), so the runner's ONBOX_<FIELD> variables are
    left out (they would sit above that record). With a GPU slot, CUDA_VISIBLE_DEVICES names the slot's GPU in
    NVML's order, which is PCI bus order: CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA count the same way (its default
    order, fastest first, may differ on a mixed box). An entry's own --env CUDA_VISIBLE_DEVICES still wins in its
    child's environment."""
    env = {k: v for k, v in environ.items() if k not in CONFIG_VARS}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def agent_argv(argv0: Optional[str] = None) -> List[str]:
    """How the runner starts an entry's agent: this pyz with this python, else `<this python> -m onbox`."""
    path = os.path.abspath(argv0 if argv0 is not None else sys.argv[0])
    if path.endswith(".pyz") and os.path.isfile(path):
        return [sys.executable, path]
    return [sys.executable, "-m", "onbox"]
