"""Box readings for a heartbeat: host (cgroup), disks, GPUs. Each reader is a seam the hook receives; the
defaults read through onbox.telemetry.host and onbox.gpu.readings (the NVML seam).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from onbox.fsutil import free_space


def default_gpu_reader(seam: Any = None) -> Callable[[], Dict[str, Any]]:
    """gpu_readings() over one NVML seam for the agent's life (Xid events accumulate on it); `seam` for tests.
    A GPU-less box reads {"available": False, "reason": ...}; gpu_readings never raises for that."""
    # imported here, when the agent builds its hooks before the first attempt starts, not at the first beat: the
    # beat runs on the agent's main thread, and a signal that lands while it imports waits for it (~10 ms)
    from onbox.gpu.nvml import NvmlSeam
    from onbox.gpu.readings import gpu_readings

    holder: Dict[str, Any] = {} if seam is None else {"seam": seam}

    def read() -> Dict[str, Any]:
        one = holder.setdefault("seam", NvmlSeam())  # NVML initialised once per agent
        return gpu_readings(one)

    return read


def default_host_reader(root: str = "/") -> Callable[[], Dict[str, Any]]:
    """The container's own view (U41): cgroup memory current/limit, oom_kill counter, CPU quota, usable CPUs;
    the host-wide load average beside it, never instead of it."""

    def read() -> Dict[str, Any]:
        from onbox.telemetry import host

        r = host.read_cgroup(root=root)
        la = host.load_average()
        return {
            "cgroup_version": r.version,
            "cgroup_path": r.path,
            "memory_current_bytes": r.memory_current_bytes,
            "memory_limit_bytes": r.memory_limit_bytes,
            "oom_kill": r.oom_kill,
            "cpu_quota_cores": r.cpu_quota_cores,
            "effective_cpus": host.effective_cpus(r),
            "load_average": list(la) if la is not None else None,
        }

    return read


def read_disks(paths: Sequence[Tuple[str, str]]) -> List[Dict[str, Any]]:
    """Free bytes and inodes (U7) for each (role, path); the same filesystem is listed once per role."""
    out: List[Dict[str, Any]] = []
    for role, path in paths:
        try:
            fs = free_space(path)
        except OSError as e:
            out.append({"role": role, "path": path, "error": str(e)})
            continue
        out.append({"role": role, "path": fs.path, "free_bytes": fs.free_bytes, "total_bytes": fs.total_bytes,
                    "free_inodes": fs.free_inodes, "total_inodes": fs.total_inodes})
    return out


@dataclasses.dataclass
class BoxReaders:
    gpu: Callable[[], Dict[str, Any]]
    host: Callable[[], Dict[str, Any]]
    disks: Callable[[Sequence[Tuple[str, str]]], List[Dict[str, Any]]] = read_disks


def default_readers(gpu: Optional[Callable[[], Dict[str, Any]]] = None,
                    host: Optional[Callable[[], Dict[str, Any]]] = None) -> BoxReaders:
    return BoxReaders(gpu=gpu or default_gpu_reader(), host=host or default_host_reader())
