"""GPU readings through the NVML seam. `inventory()` is what `onbox audit` shows; `gpu_readings()` is what
`onbox gpu` shows and what every heartbeat carries: per GPU utilisation beside SM clock and power (U21), memory,
temperature, decoded throttle reasons (U23), ECC counters, Xid events (U22) and a verdict.

nvidia-smi equivalent of inventory(): `nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used
--format=csv` plus the driver and CUDA versions of its header. Of the health readings: `nvidia-smi dmon -s pucvmet`
and `nvidia-smi -q -d PERFORMANCE,ECC`.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.clock import Clock, SystemClock
from onbox.gpu.nvml import (
    NA,
    NvmlSeam,
    clock_event_reasons,
    cuda_version_string,
    decode,
    running_processes,
)
from onbox.gpu.xid import (
    DEAD_XIDS,
    MAX_EVENTS_KEPT,
    KernelLog,
    NvmlXidWatcher,
    XidEvent,
    gpu_pci_map,
    parse_kernel_log,
    read_dmesg,
)


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


# -- health readings ------------------------------------------------------------------------------------------

# nvmlClocksEventReason* bits (the same bits as the deprecated nvmlClocksThrottleReason*), in bit order.
THROTTLE_BITS: Tuple[Tuple[int, str], ...] = (
    (0x1, "GpuIdle"),
    (0x2, "ApplicationsClocksSetting"),
    (0x4, "SwPowerCap"),
    (0x8, "HwSlowdown"),
    (0x10, "SyncBoost"),
    (0x20, "SwThermalSlowdown"),
    (0x40, "HwThermalSlowdown"),
    (0x80, "HwPowerBrakeSlowdown"),
    (0x100, "DisplayClockSetting"),
    (0x200, "BoardLimit"),
    (0x400, "Reliability"),
)
# U23: these steal throughput with no error; idle, app clocks, sync boost and display are benign.
SLOWDOWN_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
HOT_C = 83  # U23: an H100 throttles around 83 C
PINNED_MIN_BYTES = 1 << 30  # memory used above this with nothing running is "pinned"


def decode_throttle(mask: int) -> List[str]:
    """Bitmask -> names, unknown bits as hex. 0x44 -> ['SwPowerCap', 'HwThermalSlowdown']."""
    names = [name for bit, name in THROTTLE_BITS if mask & bit]
    rest = mask & ~sum(bit for bit, _ in THROTTLE_BITS)
    if rest:
        names.append("0x%x" % rest)
    return names


class Verdict:
    HEALTHY = "healthy"
    THROTTLED = "throttled"
    PINNED = "pinned"
    DEAD = "dead"


def _clean(v: Any) -> Any:
    return None if v is NA else v


def _holder_owner(h: Any) -> Optional[str]:
    return h.get("owner") if isinstance(h, Mapping) else getattr(h, "owner", None)


def judge(gpu: Dict[str, Any], holders: Optional[Sequence[Any]] = None,
          pinned_min_bytes: int = PINNED_MIN_BYTES) -> Tuple[str, str]:
    """(verdict, reason) for one GPU reading. `holders`: the holder scan's entries for this GPU (dicts or objects
    with an `owner`), when known. Order of severity: dead > pinned > throttled > healthy."""
    dead = [e for e in gpu["xid_events"] if e["xid"] in DEAD_XIDS]
    if dead:
        e = dead[-1]
        return Verdict.DEAD, "dead card: Xid %d (%s) - re-rent, don't debug (U22)" % (e["xid"], DEAD_XIDS[e["xid"]])
    used = gpu["memory_used_bytes"]
    idle = gpu["util_percent"] == 0  # unknown utilisation is not "idle"
    held = bool(used and used >= pinned_min_bytes and idle)
    stale = [h for h in holders or [] if _holder_owner(h) != "current"]
    if held and stale:
        return Verdict.PINNED, "memory pinned by %d holder%s (%.1f GiB used, 0%% util): see `onbox reap`" % (
            len(stale), "" if len(stale) == 1 else "s", used / 2**30)
    if held and gpu["processes"] == [] and not holders:
        # U11: nobody NVML lists (and, when scanned, nobody with the device open here) yet memory is held
        where = ("NVML cannot see" if holders is None
                 else "neither NVML nor this box's processes show (another container or the host)")
        return Verdict.PINNED, "memory pinned by holders %s (%.1f GiB used): see `onbox reap`" % (
            where, used / 2**30)
    slow = [n for bit, n in THROTTLE_BITS if bit & SLOWDOWN_BITS and n in gpu["throttle_reasons"]]
    if slow:
        return Verdict.THROTTLED, "throttled: %s (U23: re-rent if it persists)" % ", ".join(slow)
    temp = gpu["temperature_c"]
    if temp is not None and temp >= HOT_C:
        return Verdict.THROTTLED, "hot: %d C (U23: throttling starts around %d C)" % (temp, HOT_C)
    return Verdict.HEALTHY, "healthy"


class GpuMonitor:
    """Reads every GPU's health. Lives as long as its reader so NVML Xid events (only delivered after
    registration) accumulate; the kernel log is re-read at most every `kernel_log_interval_s`."""

    def __init__(self, seam: Optional[NvmlSeam] = None, kernel_log: Optional[KernelLog] = read_dmesg,
                 clock: Optional[Clock] = None, kernel_log_interval_s: float = 60.0) -> None:
        self.seam = seam or NvmlSeam()
        self.kernel_log = kernel_log
        self.clock = clock or SystemClock()
        self.kernel_log_interval_s = kernel_log_interval_s
        self.xid_watcher = NvmlXidWatcher(self.seam)
        self._nvml_events: Dict[int, List[XidEvent]] = {}
        self._dmesg_events: List[XidEvent] = []
        self._dmesg_readable: Optional[bool] = None
        self._dmesg_read_at: Optional[float] = None
        self._lock = threading.Lock()

    def _kernel_log_events(self, handles: List[Tuple[int, Any]]) -> None:
        now = self.clock.monotonic()
        if self.kernel_log is None:
            return
        if self._dmesg_read_at is not None and now - self._dmesg_read_at < self.kernel_log_interval_s:
            return
        self._dmesg_read_at = now
        text = self.kernel_log()
        self._dmesg_readable = text is not None
        self._dmesg_events = parse_kernel_log(text, gpu_pci_map(self.seam, handles)) if text else []

    def readings(self, holders: Optional[Mapping[int, Sequence[Any]]] = None) -> Dict[str, Any]:
        """The `gpu_readings()` document. `holders` (GPU index -> holder entries) sharpens the pinned verdict.
        An NVML failure beyond one lost GPU (e.g. driver/library version mismatch after an upgrade) reads as
        "not available" with NVML's message, never as "no GPUs" and never as an exception in a heartbeat."""
        with self._lock:
            if not self.seam.available():
                return {"available": False, "reason": self.seam.unavailable_reason, "gpus": []}
            try:
                return self._readings(holders)
            except self.seam.nvml.NVMLError as e:
                return {"available": False, "reason": "NVML failed: %s" % e, "gpus": []}

    def _readings(self, holders: Optional[Mapping[int, Sequence[Any]]]) -> Dict[str, Any]:
        seam = self.seam
        nv = seam.nvml
        count = seam.call("nvmlDeviceGetCount", optional=False)
        handles, lost = [], {}
        for i in range(count):
            try:
                handles.append((i, seam.call("nvmlDeviceGetHandleByIndex", i, optional=False)))
            except (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown) as e:
                lost[i] = str(e)
        self.xid_watcher.start(handles)
        for ev in self.xid_watcher.drain(self.clock.time()):
            kept = self._nvml_events.setdefault(ev.gpu_index if ev.gpu_index is not None else -1, [])
            kept.append(ev)
            del kept[:-MAX_EVENTS_KEPT]
        self._kernel_log_events(handles)
        gpus = []
        for i, h in handles:
            try:
                g = self._one(i, h)
            except (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown) as e:
                lost[i] = str(e)
                continue
            g["verdict"], g["verdict_reason"] = judge(g, None if holders is None else holders.get(i, []))
            gpus.append(g)
        for i, why in lost.items():
            gpus.append(self._lost(i, why))
        gpus.sort(key=lambda g: g["index"])
        return {
            "available": True,
            "reason": None,
            "driver_version": _clean(decode(seam.call("nvmlSystemGetDriverVersion"))),
            "cuda_driver_version": _clean(cuda_version_string(seam.call("nvmlSystemGetCudaDriverVersion"))),
            "xid_sources": {
                "nvml": self.xid_watcher.unavailable_reason or "watching GPUs %s" % self.xid_watcher.watched,
                "dmesg": {None: "not read", True: "readable", False: "not readable"}[self._dmesg_readable],
            },
            "gpus": gpus,
        }

    def _lost(self, i: int, why: str) -> Dict[str, Any]:
        """A GPU NVML can no longer talk to (NVML_ERROR_GPU_IS_LOST: what Xid 79 looks like from NVML)."""
        xids = self._nvml_events.get(i, []) + [e for e in self._dmesg_events if e.gpu_index == i]
        g: Dict[str, Any] = {k: None for k in (
            "name", "uuid", "util_percent", "memory_util_percent", "sm_clock_mhz", "sm_clock_max_mhz", "power_w",
            "power_limit_w", "memory_used_bytes", "memory_total_bytes", "temperature_c", "throttle_mask",
            "processes")}
        g.update(index=i, throttle_reasons=[], ecc={}, xid_events=[e.to_dict() for e in xids], verdict=Verdict.DEAD,
                 verdict_reason="dead card: NVML says %r (fell off the bus?) - re-rent, don't debug (U22)" % why)
        return g

    def _one(self, i: int, h: Any) -> Dict[str, Any]:
        seam, nv = self.seam, self.seam.nvml
        mem = seam.call("nvmlDeviceGetMemoryInfo", h)
        util = seam.call("nvmlDeviceGetUtilizationRates", h)
        power_mw = seam.call("nvmlDeviceGetPowerUsage", h)  # milliwatts
        limit_mw = seam.call("nvmlDeviceGetEnforcedPowerLimit", h)  # milliwatts
        mask = clock_event_reasons(seam, h)
        procs = running_processes(seam, h)
        ecc = {}
        for key, etype, ctype in (
            ("corrected_volatile", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("uncorrected_volatile", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ("corrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            ("uncorrected_aggregate", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
        ):
            ecc[key] = _clean(seam.call("nvmlDeviceGetTotalEccErrors", h, etype, ctype))
        xids = self._nvml_events.get(i, []) + [e for e in self._dmesg_events if e.gpu_index == i]
        return {
            "index": i,
            "name": _clean(decode(seam.call("nvmlDeviceGetName", h))),
            "uuid": _clean(decode(seam.call("nvmlDeviceGetUUID", h))),
            "util_percent": None if util is NA else util.gpu,  # U21: "a kernel ran", read with clock and power
            "memory_util_percent": None if util is NA else util.memory,
            "sm_clock_mhz": _clean(seam.call("nvmlDeviceGetClockInfo", h, nv.NVML_CLOCK_SM)),
            "sm_clock_max_mhz": _clean(seam.call("nvmlDeviceGetMaxClockInfo", h, nv.NVML_CLOCK_SM)),
            "power_w": None if power_mw is NA else power_mw / 1000.0,
            "power_limit_w": None if limit_mw is NA else limit_mw / 1000.0,
            "memory_used_bytes": None if mem is NA else mem.used,
            "memory_total_bytes": None if mem is NA else mem.total,
            "temperature_c": _clean(seam.call("nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU)),
            "throttle_mask": _clean(mask),
            "throttle_reasons": [] if mask is NA else decode_throttle(mask),
            "ecc": ecc,
            "processes": None if procs is NA else [
                {"pid": p.pid, "used_memory_bytes": p.usedGpuMemory} for p in procs],
            "xid_events": [e.to_dict() for e in xids],
        }


_DEFAULT_SEAM: Optional[NvmlSeam] = None
_monitors: "weakref.WeakKeyDictionary[NvmlSeam, GpuMonitor]" = weakref.WeakKeyDictionary()
_monitors_lock = threading.Lock()


def monitor_for(seam: Optional[NvmlSeam] = None) -> GpuMonitor:
    """The one GpuMonitor of a seam (the process-wide default seam when None), so Xid events accumulate."""
    global _DEFAULT_SEAM
    with _monitors_lock:
        if seam is None:
            if _DEFAULT_SEAM is None:
                _DEFAULT_SEAM = NvmlSeam()
            seam = _DEFAULT_SEAM
        mon = _monitors.get(seam)
        if mon is None:
            mon = _monitors[seam] = GpuMonitor(seam)
        return mon


def gpu_readings(seam: Optional[NvmlSeam] = None) -> Dict[str, Any]:
    """Every GPU's health, JSON-ready (NA -> None): {"available", "reason", "gpus": [{index, name, util_percent,
    sm_clock_mhz, power_w, memory_used_bytes, memory_total_bytes, temperature_c, throttle_reasons, xid_events,
    verdict, verdict_reason, ...}]}. On a box without a driver: available False and the reason; never raises for
    that. The heartbeat and `onbox gpu` both read this."""
    return monitor_for(seam).readings()
