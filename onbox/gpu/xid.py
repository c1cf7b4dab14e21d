"""Xid errors: NVIDIA's hardware-fault signal, from NVML events and, when readable, the kernel log.

nvidia-smi has no Xid view; the shell equivalent is `dmesg | grep -i xid`. Xid 48 (double-bit ECC) and 79 (the GPU
fell off the bus) mean the card is dead: on a rental, re-rent, don't debug (U22).

NVML only reports events that happen AFTER a set is registered, so a watcher lives as long as the process that
reads (the agent), and the kernel log covers what came before it started.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.errors import OnboxError
from onbox.gpu.nvml import NA, NvmlSeam, decode
from onbox.toolrun import Tool

# U22: the Xids that mean "this card is gone" — no code fix exists.
DEAD_XIDS = {48: "double-bit ECC error", 79: "GPU has fallen off the bus"}
XID_MEANING = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
MAX_EVENTS_KEPT = 32  # per GPU; the newest are kept


@dataclasses.dataclass
class XidEvent:
    xid: int
    gpu_index: Optional[int]  # None when the kernel log names a PCI address no GPU has
    source: str  # "nvml" or "dmesg"
    message: str
    at: Optional[float] = None  # wall time when the agent saw it (nvml); None for dmesg lines

    @property
    def dead(self) -> bool:
        return self.xid in DEAD_XIDS

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def xid_message(xid: int) -> str:
    return XID_MEANING.get(xid, "see NVIDIA's Xid catalog")


class NvmlXidWatcher:
    """One NVML event set registered for Xid critical errors on every GPU that supports them."""

    def __init__(self, seam: NvmlSeam) -> None:
        self.seam = seam
        self._set: Any = None
        self.unavailable_reason: Optional[str] = None
        self.watched: List[int] = []  # GPU indices registered

    def start(self, handles: List[Tuple[int, Any]]) -> None:
        if self._set is not None or self.unavailable_reason is not None:
            return
        nv = self.seam.nvml
        xid_type = nv.nvmlEventTypeXidCriticalError
        try:
            self._set = self.seam.call("nvmlEventSetCreate", optional=False)
            for index, h in handles:
                supported = self.seam.call("nvmlDeviceGetSupportedEventTypes", h)
                if supported is NA or not supported & xid_type:
                    continue  # the mask is limited by what the device supports
                if self.seam.call("nvmlDeviceRegisterEvents", h, xid_type, self._set) is not NA:
                    self.watched.append(index)
        except nv.NVMLError as e:  # e.g. NoPermission: Xid then comes from the kernel log only
            self.unavailable_reason = "NVML events unavailable: %s" % e
            self._set = None
        if self._set is not None and not self.watched:
            self.unavailable_reason = "no GPU supports NVML Xid events"

    def drain(self, now: float, max_events: int = 256) -> List[XidEvent]:
        """Every event pending now (timeout 0: never blocks)."""
        if self._set is None:
            return []
        nv = self.seam.nvml
        out: List[XidEvent] = []
        for _ in range(max_events):
            try:
                data = self.seam.call("nvmlEventSetWait", self._set, 0, optional=False)
            except nv.NVMLError_Timeout:
                break
            if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                continue
            index = self.seam.call("nvmlDeviceGetIndex", data.device)
            xid = int(data.eventData)
            out.append(XidEvent(xid=xid, gpu_index=None if index is NA else int(index), source="nvml",
                                message=xid_message(xid), at=now))
        return out


# `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.`
_XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),\s*(.*)")


def read_dmesg(timeout_s: float = 5.0) -> Optional[str]:
    """The kernel ring buffer, or None when it is not readable here (dmesg_restrict, a container, no dmesg)."""
    try:
        r = Tool("dmesg").run(["dmesg"], timeout_s, check=False)
    except (OSError, OnboxError):  # no dmesg, not ours to run, or it hung: the Xid scan goes without
        return None
    return r.stdout if r.returncode == 0 else None


def pci_key(bus_id: str) -> Optional[Tuple[int, int, int]]:
    """(domain, bus, device) from NVML's '00000000:3B:00.0' or the kernel's '0000:3b:00'."""
    parts = bus_id.strip().split(":")
    if len(parts) < 3:
        return None
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2].split(".")[0], 16)
    except ValueError:
        return None


def parse_kernel_log(text: str, gpu_by_pci: Dict[Tuple[int, int, int], int]) -> List[XidEvent]:
    """Xid lines of a dmesg dump. A single GPU takes every line even when its PCI address is unknown."""
    only = next(iter(gpu_by_pci.values())) if len(gpu_by_pci) == 1 else None
    out = []
    for line in text.splitlines():
        m = _XID_LINE.search(line)
        if not m:
            continue
        xid = int(m.group(2))
        key = pci_key(m.group(1))
        index = gpu_by_pci.get(key, only) if key else only
        detail = m.group(3).strip()
        out.append(XidEvent(xid=xid, gpu_index=index, source="dmesg",
                            message="%s (%s)" % (xid_message(xid), detail) if detail else xid_message(xid)))
    return out


def gpu_pci_map(seam: NvmlSeam, handles: List[Tuple[int, Any]]) -> Dict[Tuple[int, int, int], int]:
    out = {}
    for index, h in handles:
        info = seam.call("nvmlDeviceGetPciInfo", h)
        key = pci_key(decode(info.busId)) if info is not NA else None
        if key is not None:
            out[key] = index
    return out


KernelLog = Callable[[], Optional[str]]
