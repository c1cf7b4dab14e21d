"""The ONE seam over NVML (nvidia-ml-py, module `pynvml`). Modelled on nvitop's libnvml wrapper.

- Initialises lazily, on the first call, once.
- Optional readings that a GPU/driver does not support return NA (a falsy sentinel), never raise.
- A box without the NVIDIA driver is normal: `available()` is False and `unavailable_reason` says why.
  Code that *expects* GPUs calls `require()`, which raises GpuDriverError with a hint.
- The module is injected (tests pass tests/fakes/nvml.py, which follows the documented pynvml API).

Facts of NVML handled here: `import pynvml` works without a GPU and nvmlInit() raises NVMLError_LibraryNotFound;
nvmlDeviceGetComputeRunningProcesses (v3) gives wrong data on drivers < 535.104 — fall back to _v2 when the v3
symbol is missing (NVMLError_FunctionNotFound); process utilisation raises NOT_FOUND when no process ran.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Tuple

from onbox.errors import UnfitError


class _NotAvailable:
    """Sentinel for a reading this GPU/driver does not provide. Falsy; prints as 'N/A'."""

    _instance: Optional["_NotAvailable"] = None

    def __new__(cls) -> "_NotAvailable":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "N/A"

    __str__ = __repr__


NA: Any = _NotAvailable()


class GpuDriverError(UnfitError):
    """GPUs were expected but NVML cannot be used."""


def _load_pynvml() -> Any:
    import pynvml  # nvidia-ml-py; imports fine on a GPU-less box

    return pynvml


class NvmlSeam:
    """Every NVML call goes through `call()`. Thread-safe lazy init."""

    def __init__(self, module: Any = None, loader: Callable[[], Any] = _load_pynvml) -> None:
        self._module = module
        self._loader = loader
        self._lock = threading.Lock()
        self._initialised = False
        self.unavailable_reason: Optional[str] = None

    @property
    def nvml(self) -> Any:
        if self._module is None:
            self._module = self._loader()
        return self._module

    def _init(self) -> bool:
        with self._lock:
            if self._initialised:
                return True
            if self.unavailable_reason is not None:
                return False
            try:
                nv = self.nvml
            except ImportError as e:
                self.unavailable_reason = "nvidia-ml-py is not importable (%s)" % e
                return False
            try:
                nv.nvmlInit()
            except nv.NVMLError_LibraryNotFound:
                self.unavailable_reason = "no NVIDIA driver (libnvidia-ml.so.1 not found)"
                return False
            except nv.NVMLError_DriverNotLoaded:
                self.unavailable_reason = "the NVIDIA kernel driver is not loaded"
                return False
            except nv.NVMLError_NoPermission:
                self.unavailable_reason = "no permission to open the NVIDIA devices"
                return False
            except nv.NVMLError as e:
                self.unavailable_reason = "NVML failed to initialise: %s" % e
                return False
            self._initialised = True
            return True

    def available(self) -> bool:
        """True when NVML initialised (a driver is present). False is normal on a GPU-less box."""
        return self._init()

    def require(self) -> None:
        """Raise GpuDriverError with a hint when GPUs are expected but NVML is unusable."""
        if not self._init():
            raise GpuDriverError(
                "GPUs expected but NVML is unusable: %s" % self.unavailable_reason,
                hint="check `nvidia-smi`; inside a container the GPU must be passed through (U31: --gpus all)",
            )

    def call(self, name: str, *args: Any, optional: bool = True) -> Any:
        """Call pynvml.<name>(*args). Unsupported/absent optional readings return NA; other errors raise."""
        if not self._init():
            return NA
        nv = self.nvml
        fn = getattr(nv, name, None)
        if fn is None:
            if optional:
                return NA
            raise nv.NVMLError(nv.NVML_ERROR_FUNCTION_NOT_FOUND)
        try:
            return fn(*args)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            if optional:
                return NA
            raise
        except nv.NVMLError_NotFound:
            # e.g. nvmlDeviceGetProcessUtilization when no process ran in the window
            if optional:
                return NA
            raise

    def shutdown(self) -> None:
        with self._lock:
            if self._initialised:
                try:
                    self.nvml.nvmlShutdown()
                finally:
                    self._initialised = False


V3_PROCESS_STRUCT_SINCE = (535, 104)  # older drivers give wrong process info through the v3 struct


def driver_version_tuple(seam: NvmlSeam) -> Optional[Tuple[int, ...]]:
    """'535.104.05' -> (535, 104, 5); None when unknown."""
    v = decode(seam.call("nvmlSystemGetDriverVersion"))
    try:
        return tuple(int(x) for x in str(v).split(".")) if v is not NA else None
    except ValueError:
        return None


def running_processes(seam: NvmlSeam, handle: Any) -> Any:
    """The compute processes NVML sees on one GPU (objects with .pid and .usedGpuMemory), or NA.

    nvidia-smi equivalent: `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`. pynvml's plain call is
    the v3 struct, which drivers older than 535.104 answer wrongly: those get _v2 directly, and a
    driver without the v3 symbol (FunctionNotFound) falls back to _v2 too. The PIDs may be HOST PIDs inside a
    container: never act on them alone.
    """
    if not seam.available():
        return NA
    nv = seam.nvml
    version = driver_version_tuple(seam)
    if version is not None and version[:2] < V3_PROCESS_STRUCT_SINCE:
        return seam.call("nvmlDeviceGetComputeRunningProcesses_v2", handle)
    try:
        return seam.call("nvmlDeviceGetComputeRunningProcesses", handle, optional=False)
    except nv.NVMLError_FunctionNotFound:
        return seam.call("nvmlDeviceGetComputeRunningProcesses_v2", handle)
    except nv.NVMLError_NotSupported:
        return NA


def clock_event_reasons(seam: NvmlSeam, handle: Any) -> Any:
    """The current clocks-event (throttle) bitmask, or NA. nvidia-smi: `-q -d PERFORMANCE`.

    nvmlDeviceGetCurrentClocksThrottleReasons is deprecated (renamed ...ClocksEventReasons); older drivers only
    have the old symbol, so fall back to it.
    """
    mask = seam.call("nvmlDeviceGetCurrentClocksEventReasons", handle)
    if mask is NA:
        mask = seam.call("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
    return mask


def decode(value: Any) -> Any:
    """Older pynvml returned bytes for strings."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def cuda_version_string(v: Any) -> Any:
    """nvmlSystemGetCudaDriverVersion's int (12040) -> '12.4'; NA passes through."""
    if not isinstance(v, int):
        return NA
    return "%d.%d" % (v // 1000, (v % 1000) // 10)
