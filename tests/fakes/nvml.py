"""A fake `pynvml` module that behaves like the documented NVML API, for tests (no GPU here).

It reuses the real nvidia-ml-py exception classes and constants, so code under test catches exactly what it would
catch on a real box: NVMLError_LibraryNotFound from nvmlInit() when `driver=False`, NVMLError_Uninitialized when a
call comes before nvmlInit(), NVMLError_InvalidArgument for a bad index, NVMLError_FunctionNotFound for a symbol
the "driver" lacks (`missing` names functions to remove, e.g. the v3 process call on an old driver), and
NVMLError_NotFound from nvmlDeviceGetProcessUtilization when no process ran in the window.

Health readings follow the documented units: power in milliwatts, clocks in MHz, temperature in degrees C,
utilisation rates as an object with .gpu/.memory percentages, throttle reasons as the clocks-event bitmask, ECC
counters per (error type, counter type). A GPU lists readings it does not support in `unsupported` (they raise
NVMLError_NotSupported, like a consumer card asked for ECC); a `lost` GPU raises NVMLError_GpuIsLost from its
handle lookup and every call, as after Xid 79. Events: nvmlEventSetCreate, nvmlDeviceRegisterEvents
(NotSupported for a type outside nvmlDeviceGetSupportedEventTypes), nvmlEventSetWait(set, timeout_ms) returning
c_nvmlEventData_t-like objects (eventType, eventData = the Xid number, device) or raising NVMLError_Timeout when
nothing is pending. Tests queue an Xid with `FakeNvml.raise_xid(index, xid)`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

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
    pci_bus_id: str = "00000000:3B:00.0"
    util_gpu: int = 0  # percent
    util_memory: int = 0  # percent
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    power_mw: int = 70_000  # milliwatts
    power_limit_mw: int = 700_000
    temperature_c: int = 35
    throttle_mask: int = 0  # nvmlClocksEventReason* bits
    ecc: Dict[Tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (errorType, counterType) -> n
    supported_events: int = (_real.nvmlEventTypeXidCriticalError | _real.nvmlEventTypeSingleBitEccError
                             | _real.nvmlEventTypeDoubleBitEccError)
    unsupported: Set[str] = dataclasses.field(default_factory=set)  # nvml function names -> NotSupported
    process_util: Dict[int, int] = dataclasses.field(default_factory=dict)  # pid -> SM % in the sample window
    lost: bool = False  # fell off the bus (Xid 79): every call on it raises NVMLError_GpuIsLost


class _Utilization:
    def __init__(self, gpu: int, memory: int) -> None:
        self.gpu, self.memory = gpu, memory


class _UtilSample:
    def __init__(self, pid: int, sm: int, ts: int) -> None:
        self.pid, self.smUtil, self.timeStamp = pid, sm, ts
        self.memUtil = self.encUtil = self.decUtil = 0


class _PciInfo:
    def __init__(self, bus_id: str) -> None:
        self.busId = bus_id
        self.busIdLegacy = bus_id[4:] if len(bus_id) > 12 else bus_id


class FakeEventData:
    """Like c_nvmlEventData_t."""

    def __init__(self, device: FakeGpu, event_type: int, data: int) -> None:
        self.device, self.eventType, self.eventData = device, event_type, data
        self.gpuInstanceId = self.computeInstanceId = 0xFFFFFFFF


class FakeEventSet:
    def __init__(self) -> None:
        self.registered: List[Tuple[FakeGpu, int]] = []
        self.freed = False


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
        self.event_sets: List[FakeEventSet] = []
        self._pending: List[FakeEventData] = []  # raised events not yet delivered

    def raise_xid(self, index: int, xid: int) -> None:
        """The hardware reports Xid `xid` on GPU `index`: delivered once, to a set registered for it."""
        self._pending.append(FakeEventData(self.gpus[index], _real.nvmlEventTypeXidCriticalError, xid))

    def __getattr__(self, name: str) -> Any:
        # Constants (nvmlEventType*, nvmlClocksEventReason*, NVML_*) and exception classes come from the real
        # module; an nvml* FUNCTION the fake does not define does not exist (the fake must model every call used).
        value = getattr(_real, name)
        if name.startswith("nvml") and callable(value):
            raise AttributeError(name)
        return value

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

    def _gpu(self, handle: Any, call: str = "") -> FakeGpu:
        self._check()
        if not isinstance(handle, FakeGpu):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        if handle.lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        if call and call in handle.unsupported:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
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
        if self.gpus[index].lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        return self.gpus[index]

    def nvmlDeviceGetIndex(self, h: Any) -> int:
        g = self._gpu(h)
        return next(i for i, x in enumerate(self.gpus) if x is g)

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
        # pynvml's plain name calls the v3 symbol: absent on old drivers -> FunctionNotFound
        return self.nvmlDeviceGetComputeRunningProcesses_v3(h)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: Any) -> List[FakeProcess]:
        return list(self._gpu(h).processes)

    def nvmlDeviceGetProcessUtilization(self, h: Any, last_seen_us: int) -> List[Any]:
        """Samples (like c_nvmlProcessUtilizationSample_t) of processes that ran since last_seen_us; NOT_FOUND
        when none did."""
        g = self._gpu(h, "nvmlDeviceGetProcessUtilization")
        if not g.process_util:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return [_UtilSample(pid, sm, last_seen_us + 1) for pid, sm in g.process_util.items()]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: Any) -> List[FakeProcess]:
        procs = list(self._gpu(h).processes)
        if self._driver_tuple() < (535, 104):
            # the documented trap: the v3 struct read from an older driver is misaligned garbage
            return [FakeProcess(pid=p.usedGpuMemory or 0, usedGpuMemory=p.pid) for p in procs]
        return procs

    def _driver_tuple(self) -> Tuple[int, ...]:
        return tuple(int(x) for x in self.driver_version.split("."))

    def nvmlDeviceGetPciInfo(self, h: Any) -> _PciInfo:
        return _PciInfo(self._gpu(h).pci_bus_id)

    # -- health readings
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> _Utilization:
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return _Utilization(g.util_gpu, g.util_memory)

    def nvmlDeviceGetClockInfo(self, h: Any, clock_type: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetClockInfo")
        if clock_type == _real.NVML_CLOCK_SM:
            return g.sm_clock_mhz
        if clock_type in (_real.NVML_CLOCK_GRAPHICS, _real.NVML_CLOCK_MEM, _real.NVML_CLOCK_VIDEO):
            return g.sm_clock_mhz
        raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetMaxClockInfo(self, h: Any, clock_type: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetMaxClockInfo")
        if clock_type not in (_real.NVML_CLOCK_SM, _real.NVML_CLOCK_GRAPHICS, _real.NVML_CLOCK_MEM,
                              _real.NVML_CLOCK_VIDEO):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.sm_clock_max_mhz

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw  # milliwatts

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetTemperature")
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.temperature_c

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").throttle_mask

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: Any) -> int:  # deprecated name, same bits
        return self._gpu(h, "nvmlDeviceGetCurrentClocksThrottleReasons").throttle_mask

    def nvmlDeviceGetTotalEccErrors(self, h: Any, error_type: int, counter_type: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        if error_type not in (0, 1) or counter_type not in (0, 1):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return g.ecc.get((error_type, counter_type), 0)

    # -- events
    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._check()
        es = FakeEventSet()
        self.event_sets.append(es)
        return es

    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int:
        return self._gpu(h, "nvmlDeviceGetSupportedEventTypes").supported_events

    def nvmlDeviceRegisterEvents(self, h: Any, event_types: int, event_set: Any) -> None:
        g = self._gpu(h, "nvmlDeviceRegisterEvents")
        if not isinstance(event_set, FakeEventSet) or event_set.freed:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        if event_types & ~g.supported_events:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        event_set.registered.append((g, event_types))

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> FakeEventData:
        self._check()
        if not isinstance(event_set, FakeEventSet) or event_set.freed:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        for ev in self._pending:
            if any(g is ev.device and mask & ev.eventType for g, mask in event_set.registered):
                self._pending.remove(ev)
                return ev
        raise _real.NVMLError(_real.NVML_ERROR_TIMEOUT)  # nothing within timeout_ms (the fake does not wait)

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._check()
        event_set.freed = True


class BrokenCount(FakeNvml):
    """A driver whose nvmlDeviceGetCount fails after init (a kernel module and library of different versions)."""

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        raise _real.NVMLError(_real.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
