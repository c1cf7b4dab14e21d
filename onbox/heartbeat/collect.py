"""Box readings for a heartbeat: host (cgroup), disks, GPUs. Each reader is a seam the hook receives.

The host and GPU readers come from onbox.telemetry.host / onbox.telemetry.gpu; until a build has them, the
section says "not available" with the reason instead of failing the beat.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from onbox.fsutil import free_space


def _clean(v: Any) -> Any:
    from onbox.telemetry.nvml import NA

    return None if v is NA else v


def default_gpu_reader() -> Callable[[], Dict[str, Any]]:
    try:
        from onbox.telemetry.gpu import gpu_readings  # type: ignore[attr-defined]
    except ImportError:
        gpu_readings = None
    if gpu_readings is None:
        return lambda: {"available": False, "reason": "GPU readings are not in this build", "gpus": []}
    seam_holder: Dict[str, Any] = {}

    def read() -> Dict[str, Any]:
        from onbox.telemetry.nvml import NvmlSeam

        seam = seam_holder.setdefault("seam", NvmlSeam())  # one seam: NVML initialised once per agent
        return gpu_readings(seam)

    return read


def default_host_reader() -> Callable[[], Dict[str, Any]]:
    try:
        from onbox.telemetry import host  # type: ignore[attr-defined]
    except ImportError:
        host = None
    if host is None or not hasattr(host, "read_cgroup"):
        return lambda: {"available": False, "reason": "host readings are not in this build"}

    def read() -> Dict[str, Any]:
        r = host.read_cgroup()
        out: Dict[str, Any] = {
            "cgroup_version": getattr(r, "version", None),
            "cgroup_path": getattr(r, "path", None),
            "memory_current_bytes": getattr(r, "memory_current_bytes", None),
            "memory_limit_bytes": getattr(r, "memory_limit_bytes", None),
            "oom_kill": getattr(r, "oom_kill", None),
            "cpu_quota_cores": getattr(r, "cpu_quota_cores", None),
        }
        if hasattr(host, "effective_cpus"):
            out["effective_cpus"] = host.effective_cpus()
        if hasattr(host, "load_average"):
            la = host.load_average()
            out["load_average"] = list(la) if la is not None else None
        return {k: _clean(v) for k, v in out.items()}

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
