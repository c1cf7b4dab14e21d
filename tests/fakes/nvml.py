"""A fake `pynvml` module that behaves like the documented NVML API, for tests (no GPU here).

It reuses the real nvidia-ml-py exception classes and constants, so code under test catches exactly what it would
catch on a real box: NVMLError_LibraryNotFound from nvmlInit() when `driver=False`, NVMLError_Uninitialized when a
call comes before nvmlInit(), NVMLError_InvalidArgument for a bad index, NVMLError_FunctionNotFound for a symbol
the "driver" lacks (`missing` names functions to remove, e.g. the v3 process call on an old driver), and
NVMLError_NotFound from nvmlDeviceGetProcessUtilization when no process ran in the window.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Set

import pynvml as _real


@dataclasses.dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: Optional[int]  # bytes; None under WDDM
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclasses.dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total: int = 80 * 1024**3
    memory_used: int = 0
    minor: int = 0
    processes: List[FakeProcess] = dataclasses.field(default_factory=list)


class _Mem:
    def __init__(self, total: int, used: int) -> None:
        self.total, self.used, self.free = total, used, total - used


class FakeNvml:
    """Drop-in for the `pynvml` module. Attribute access falls back to the real module's constants/classes."""

    def __init__(self, gpus: Optional[List[FakeGpu]] = None, driver: bool = True,
                 driver_version: str = "550.54.15", cuda_version: int = 12040,
                 missing: Optional[Set[str]] = None) -> None:
        self.gpus = list(gpus or [])
        self.driver = driver
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.missing = set(missing or ())
        self.initialised = 0
        self.calls: List[str] = []

    def __getattr__(self, name: str) -> Any:
        # Constants and exception classes come from the real module.
        if name.startswith("nvml"):
            raise AttributeError(name)
        return getattr(_real, name)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "missing"):
            # pynvml raises FunctionNotFound when the driver library lacks the symbol
            def absent(*a: Any, **k: Any) -> Any:
                raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
            return absent
        return object.__getattribute__(self, name)

    # -- lifecycle
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if not self.driver:
            raise _real.NVMLError(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.initialised -= 1

    def _check(self) -> None:
        if self.initialised <= 0:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any) -> FakeGpu:
        self._check()
        if not isinstance(handle, FakeGpu):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return handle

    # -- system
    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check()
        return self.cuda_version

    # -- devices
    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetName(self, h: Any) -> str:
        return self._gpu(h).name

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self._gpu(h).uuid

    def nvmlDeviceGetMinorNumber(self, h: Any) -> int:
        return self._gpu(h).minor

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> _Mem:
        g = self._gpu(h)
        return _Mem(g.memory_total, g.memory_used)

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> List[FakeProcess]:
        return list(self._gpu(h).processes)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: Any) -> List[FakeProcess]:
        return list(self._gpu(h).processes)

    def nvmlDeviceGetProcessUtilization(self, h: Any, last_seen_us: int) -> List[Any]:
        self._gpu(h)
        raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)


