"""GPU readings through the NVML seam. `inventory()` is what `onbox audit` shows; issue 7 adds health readings.

nvidia-smi equivalent of inventory(): `nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used
--format=csv` plus the driver and CUDA versions of its header.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from onbox.telemetry.nvml import NA, NvmlSeam, cuda_version_string, decode


@dataclasses.dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total_bytes: Any  # bytes, or NA
    memory_used_bytes: Any  # bytes, or NA


@dataclasses.dataclass
class GpuInventory:
    available: bool
    reason: Optional[str]  # why not available ("no NVIDIA driver ..."); None when available
    driver_version: Any = NA
    cuda_driver_version: Any = NA  # the newest CUDA the driver supports, e.g. "12.4"
    gpus: List[GpuInfo] = dataclasses.field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        def clean(v: Any) -> Any:
            return None if v is NA else v

        return {
            "available": self.available,
            "reason": self.reason,
            "driver_version": clean(self.driver_version),
            "cuda_driver_version": clean(self.cuda_driver_version),
            "gpus": [{k: clean(v) for k, v in dataclasses.asdict(g).items()} for g in self.gpus],
        }


def inventory(seam: Optional[NvmlSeam] = None) -> GpuInventory:
    """Driver, CUDA version and each GPU's name and memory; `available=False` with a reason on a GPU-less box."""
    seam = seam or NvmlSeam()
    if not seam.available():
        return GpuInventory(available=False, reason=seam.unavailable_reason)
    inv = GpuInventory(
        available=True,
        reason=None,
        driver_version=decode(seam.call("nvmlSystemGetDriverVersion")),
        cuda_driver_version=cuda_version_string(seam.call("nvmlSystemGetCudaDriverVersion")),
    )
    count = seam.call("nvmlDeviceGetCount", optional=False)
    for i in range(count):
        h = seam.call("nvmlDeviceGetHandleByIndex", i, optional=False)
        mem = seam.call("nvmlDeviceGetMemoryInfo", h)
        inv.gpus.append(GpuInfo(
            index=i,
            name=decode(seam.call("nvmlDeviceGetName", h)),
            uuid=decode(seam.call("nvmlDeviceGetUUID", h)),
            memory_total_bytes=mem.total if mem else NA,
            memory_used_bytes=mem.used if mem else NA,
        ))
    return inv
