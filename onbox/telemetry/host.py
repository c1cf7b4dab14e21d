"""Host readings scoped to THIS container: its cgroup (v1, v2 or hybrid), CPU quota, load average.

U41: on a shared box `uptime`/`free` describe the whole physical host; the cgroup is what this run can use and
what OOM-kills it. Every path is prefixed by `root`, so tests read fixture trees of real cgroup files.

Layouts handled:
- v2 (pure): `/sys/fs/cgroup/cgroup.controllers` exists; one hierarchy, `/proc/<pid>/cgroup` is `0::<path>`.
  Files: memory.max ("max" = unlimited), memory.current, memory.events (`oom_kill N`), cpu.max ("QUOTA PERIOD").
- v1: one mount per controller (`/sys/fs/cgroup/memory`, `/sys/fs/cgroup/cpu,cpuacct` + a `cpu` symlink ...);
  memory.limit_in_bytes (unlimited reads 9223372036854771712), memory.usage_in_bytes, memory.oom_control
  (`oom_kill N`, kernel >= 4.13), cpu.cfs_quota_us (-1 = none) / cpu.cfs_period_us.
- hybrid: v1 controllers plus a v2 hierarchy at `/sys/fs/cgroup/unified` (usually holding no controllers; a
  controller found there and not in v1 is read from it).

The own-cgroup directory is `<mount>/<path from /proc/<pid>/cgroup>`. Inside a container without a cgroup
namespace that path names the HOST's hierarchy while the mount shows only the container's subtree, so the
lookup falls back to shorter suffixes of the path and finally to the mount's root files.
Limits are the tightest along the path from the own cgroup up to the mount root (a parent's limit binds too).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

# v1 reports "no limit" as LONG_MAX rounded down to the page size (9223372036854771712); treat anything this
# large as unlimited (no real box has 4 EiB of RAM).
V1_UNLIMITED_FLOOR = 1 << 62

CGROUP_MOUNT = "sys/fs/cgroup"


@dataclasses.dataclass
class CgroupReading:
    version: str  # "v1" | "v2" | "hybrid" | "none"
    path: str  # the container's own cgroup path (from /proc/<pid>/cgroup; the memory controller's on v1)
    memory_limit_bytes: Optional[int]  # None = unlimited (v1 9223372036854771712 counts as unlimited)
    memory_current_bytes: Optional[int]
    oom_kill: Optional[int]  # memory.events oom_kill (v2) / memory.oom_control oom_kill (v1)
    cpu_quota_cores: Optional[float]  # cpu.max / cfs_quota_us÷period; None = unlimited

    def to_dict(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:  # absent, EACCES, or a controller file the kernel refuses to read: "not available"
        return None


def _read_int(path: str) -> Optional[int]:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _keyed(path: str, key: str) -> Optional[int]:
    """The value of `key` in a flat keyed file such as memory.events or memory.oom_control."""
    text = _read(path)
    if text is None:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def parse_proc_cgroup(text: str) -> Dict[str, str]:
    """`/proc/<pid>/cgroup` -> {controller: path}; the v2 line (`0::/path`) is under "". Named hierarchies
    (`name=systemd`) keep their name. Each controller also appears under its joined mount name ("cpu,cpuacct")."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out[""] = path
            continue
        out[controllers] = path
        for c in controllers.split(","):
            out[c] = path
    return out


def _detect_version(cgroot: str) -> str:
    if os.path.exists(os.path.join(cgroot, "cgroup.controllers")):
        return "v2"  # pure v2 iff /sys/fs/cgroup/cgroup.controllers exists
    try:
        entries = os.listdir(cgroot)
    except OSError:
        return "none"
    has_v1 = any(os.path.isdir(os.path.join(cgroot, e)) and e != "unified" for e in entries)
    has_unified = os.path.exists(os.path.join(cgroot, "unified", "cgroup.controllers"))
    if has_v1 and has_unified:
        return "hybrid"
    if has_v1:
        return "v1"
    return "v2" if has_unified else "none"


def _suffixes(path: str) -> List[str]:
    """'/a/b/c' -> ['a/b/c', 'b/c', 'c', '']: the own cgroup as seen from a mount of some subtree."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[i:]) for i in range(len(parts))] + [""]


def _own_dir(base: str, path: str) -> str:
    for suffix in _suffixes(path):
        candidate = os.path.join(base, suffix) if suffix else base
        if os.path.isdir(candidate):
            return candidate
    return base


def _chain(base: str, own: str) -> List[str]:
    """Directories from the own cgroup up to (and including) the mount root."""
    out = [own]
    cur = own
    base = os.path.normpath(base)
    while os.path.normpath(cur) != base and len(cur) > len(base):
        cur = os.path.dirname(cur)
        out.append(cur)
    return out


def _controller_dir(cgroot: str, version: str, controller: str,
                    paths: Dict[str, str]) -> Optional[Tuple[str, str, bool]]:
    """(mount base, own dir, is_v2) for a controller, or None when this box does not have it."""
    if version == "v2":
        return cgroot, _own_dir(cgroot, paths.get("", "/")), True
    if version in ("v1", "hybrid"):
        names = [k for k in paths if k and "," in k and controller in k.split(",")] + [controller]
        for name in names:
            base = os.path.join(cgroot, name)
            if os.path.isdir(base) and controller in paths:
                return base, _own_dir(base, paths[controller]), False
        if version == "hybrid":
            unified = os.path.join(cgroot, "unified")
            enabled = (_read(os.path.join(unified, "cgroup.controllers")) or "").split()
            if controller in enabled:
                return unified, _own_dir(unified, paths.get("", "/")), True
    return None


def _min_limit(values: Sequence[Optional[float]]) -> Optional[float]:
    finite = [v for v in values if v is not None]
    return min(finite) if finite else None


def _memory_limit_v2(d: str) -> Optional[int]:
    text = _read(os.path.join(d, "memory.max"))
    if text is None or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _memory_limit_v1(d: str) -> Optional[int]:
    value = _read_int(os.path.join(d, "memory.limit_in_bytes"))
    if value is None or value >= V1_UNLIMITED_FLOOR or value < 0:
        return None
    return value


def _cpu_quota_v2(d: str) -> Optional[float]:
    text = _read(os.path.join(d, "cpu.max"))
    if not text:
        return None
    parts = text.split()
    if parts[0] == "max":
        return None
    try:
        period = float(parts[1]) if len(parts) > 1 else 100000.0
        return float(parts[0]) / period if period > 0 else None
    except ValueError:
        return None


def _cpu_quota_v1(d: str) -> Optional[float]:
    quota = _read_int(os.path.join(d, "cpu.cfs_quota_us"))
    period = _read_int(os.path.join(d, "cpu.cfs_period_us"))
    if quota is None or quota < 0 or not period:
        return None  # -1 = no quota
    return quota / period


def read_cgroup(root: str = "/", pid: str = "self") -> CgroupReading:
    """This process's (or `pid`'s) cgroup: version, own path, memory limit/current, oom_kill, CPU quota."""
    cgroot = os.path.join(root, CGROUP_MOUNT)
    proc_text = _read(os.path.join(root, "proc", str(pid), "cgroup"))
    version = _detect_version(cgroot)
    if proc_text is None or version == "none":
        return CgroupReading("none", "", None, None, None, None)
    paths = parse_proc_cgroup(proc_text)
    own_path = paths.get("memory", paths.get("", "/")) if version != "v2" else paths.get("", "/")

    limit: Optional[int] = None
    current: Optional[int] = None
    oom: Optional[int] = None
    mem = _controller_dir(cgroot, version, "memory", paths)
    if mem is not None:
        base, own, v2 = mem
        chain = _chain(base, own)
        if v2:
            # The root cgroup has no memory.max; a parent's memory.max binds the child as well.
            limit = _min_limit([_memory_limit_v2(d) for d in chain])  # type: ignore[assignment]
            current = _read_int(os.path.join(own, "memory.current"))
            oom = _keyed(os.path.join(own, "memory.events"), "oom_kill")
        else:
            limit = _min_limit([_memory_limit_v1(d) for d in chain])  # type: ignore[assignment]
            current = _read_int(os.path.join(own, "memory.usage_in_bytes"))
            oom = _keyed(os.path.join(own, "memory.oom_control"), "oom_kill")
        if limit is not None:
            limit = int(limit)

    quota: Optional[float] = None
    cpu = _controller_dir(cgroot, version, "cpu", paths)
    if cpu is not None:
        base, own, v2 = cpu
        reader = _cpu_quota_v2 if v2 else _cpu_quota_v1
        quota = _min_limit([reader(d) for d in _chain(base, own)])

    return CgroupReading(version=version, path=own_path, memory_limit_bytes=limit,
                         memory_current_bytes=current, oom_kill=oom, cpu_quota_cores=quota)


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def effective_cpus(reading: CgroupReading, affinity: Union[int, Iterable[int], None] = None) -> int:
    """CPUs this container can really use: ceil(CPU quota) bounded by the affinity mask, at least 1.

    U40: torch/OpenMP size their thread pools to the HOST core count (os.cpu_count() ignores the quota), so a
    12-vCPU slice of a 64-core host runs 64 threads that thrash; cap threads at this number.
    `affinity` is a CPU count or a set of CPU ids (os.sched_getaffinity(0) when None).
    """
    if affinity is None:
        cpus = _affinity()
    elif isinstance(affinity, int):
        cpus = affinity
    else:
        cpus = len(set(affinity))
    if reading.cpu_quota_cores is not None and reading.cpu_quota_cores > 0:
        cpus = min(cpus, math.ceil(reading.cpu_quota_cores - 1e-9))
    return max(1, cpus)


def load_average() -> Optional[Tuple[float, float, float]]:
    """1/5/15-minute load average of the WHOLE host (U41: not this container's; show it only beside the cgroup)."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None
