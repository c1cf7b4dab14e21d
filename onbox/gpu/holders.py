"""Who holds the GPU: every process with an NVIDIA device file open, found through `/proc/*/fd` links.

Shell equivalent: `fuser -v /dev/nvidia*` (or `lsof /dev/nvidia*`). nvidia-smi, gpustat and nvitop only show what
NVML lists, and NVML misses exactly the processes that matter (U11): DataLoader workers forked after CUDA init,
orphaned DDP workers, processes of another PID namespace. So the truth comes from the fd table, and NVML's
process list is only a cross-check (NVML PIDs may be host PIDs inside a container; never trust them
alone).

GPU files map to NVML indices through their device minor numbers: /dev/nvidia<N> has minor N and
nvmlDeviceGetMinorNumber names the index that owns it. nvidiactl and nvidia-uvm are held by every CUDA process but
name no GPU. Processes whose fd table cannot be read (another user's, without root) are counted and listed,
never silently dropped (gpustat's bug).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import pwd
import re
import stat
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.gpu.nvml import NA, NvmlSeam, running_processes
from onbox.proc import read_stat

DEFAULT_DEVICES = "/dev/nvidia*"
_GPU_NAME = re.compile(r"^nvidia(\d+)$")
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclasses.dataclass
class DeviceFile:
    path: str
    kind: str  # "gpu" (/dev/nvidia<N>), "ctl" (nvidiactl), "uvm" (nvidia-uvm*), "other" (modeset, caps)
    minor: Optional[int]  # gpu files: the device minor (st_rdev), or N of the name for a stand-in regular file
    rdev: Optional[int]  # char devices only


def device_files(pattern: str = DEFAULT_DEVICES) -> List[DeviceFile]:
    """The NVIDIA device files matching `pattern` (a glob; tests pass stand-in files in a temp dir)."""
    out = []
    for path in sorted(glob.glob(pattern)):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            continue  # /dev/nvidia-caps
        name = os.path.basename(path)
        is_chr = stat.S_ISCHR(st.st_mode)
        m = _GPU_NAME.match(name)
        if m:
            kind, minor = "gpu", os.minor(st.st_rdev) if is_chr else int(m.group(1))
        elif name == "nvidiactl":
            kind, minor = "ctl", None
        elif name.startswith("nvidia-uvm"):
            kind, minor = "uvm", None
        else:
            kind, minor = "other", None
        out.append(DeviceFile(path=path, kind=kind, minor=minor, rdev=st.st_rdev if is_chr else None))
    return out


@dataclasses.dataclass
class Holder:
    pid: int
    ppid: int
    uid: int
    user: str
    command: str
    state: str  # the kernel's one-letter state (R, S, D, Z, ...)
    age_s: float
    start_time: float  # wall clock (epoch seconds) the process started
    start_ticks: int  # /proc/<pid>/stat starttime: with the pid, identifies the process (PID reuse guard)
    sid: int
    pgid: int
    devices: List[str]  # device files it holds open
    gpus: List[int]  # NVML indices of the GPUs among them
    other_pid_ns: bool  # lives in another PID namespace than the scanner (another container)
    ns_pids: List[int]  # NSpid: its pid in each nested namespace, outermost first
    nvml_visible: Optional[bool] = None  # None: unknown (no NVML, or NVML's PIDs are from another namespace)
    gpu_memory_bytes: Optional[int] = None  # NVML's usedGpuMemory summed over GPUs, when NVML lists it
    owner: str = "foreign"  # set by the reaper: "self", "current", "earlier" or "foreign"
    run: Optional[str] = None
    attempt: Optional[int] = None
    container: Optional[str] = None  # id of the container it runs in (from its cgroup), None: the scanner's own

    @property
    def container_short(self) -> str:
        return self.container[:12] if self.container else "-"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ScanResult:
    holders: List[Holder]
    scanned: int  # processes looked at
    unreadable: List[int]  # pids whose fd table could not be read (permission): may hold a GPU
    vanished: int  # processes that exited during the scan
    devices: List[DeviceFile]
    nvml_unmatched: List[Dict[str, Any]]  # NVML processes no scanned process matches: {gpu, pid, memory_bytes}
    nvml_available: bool
    duration_s: float
    nvml_error: Optional[str] = None  # NVML answered but failed: the scan stands, the cross-check does not

    def by_gpu(self) -> Dict[int, List[Holder]]:
        out: Dict[int, List[Holder]] = {}
        for h in self.holders:
            for g in h.gpus:
                out.setdefault(g, []).append(h)
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {
            "holders": [h.to_dict() for h in self.holders],
            "scanned": self.scanned,
            "unreadable": len(self.unreadable),
            "unreadable_pids": self.unreadable[:50],
            "vanished": self.vanished,
            "devices": [dataclasses.asdict(d) for d in self.devices],
            "nvml_unmatched": self.nvml_unmatched,
            "nvml_available": self.nvml_available,
            "nvml_error": self.nvml_error,
            "duration_s": round(self.duration_s, 4),
        }


# A container's id in a cgroup path: /docker/<id> (cgroup v1, cgroupfs), /system.slice/docker-<id>.scope (systemd),
# cri-containerd-<id>.scope and /kubepods/.../<id> (Kubernetes), libpod-<id>.scope (podman): 64 hex digits.
_CONTAINER_RE = re.compile(r"(?:^|[/-])([0-9a-f]{64})(?:\.scope)?(?=/|$)")


def container_id(cgroup_text: str) -> Optional[str]:
    """The container a process runs in, from /proc/<pid>/cgroup; None outside any (or in a private cgroup
    namespace, which shows "/": then the process is in the scanner's own container, if any). U11: a killed
    container's leftovers pin VRAM nvidia-smi cannot attribute; naming the container says which one to stop."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        m = _CONTAINER_RE.search(path)
        if m:
            return m.group(1)
    return None


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _user(uid: int, cache: Dict[int, str]) -> str:
    if uid not in cache:
        try:
            cache[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            cache[uid] = str(uid)
    return cache[uid]


class HolderScan:
    """Scans `/proc` for NVIDIA device holders. `devices` is the device-file glob; `proc` the procfs root."""

    def __init__(self, devices: str = DEFAULT_DEVICES, proc: str = "/proc", seam: Optional[NvmlSeam] = None,
                 listdir: Callable[[Any], List[str]] = os.listdir,
                 readlink: Callable[..., str] = os.readlink) -> None:
        self.pattern = devices
        self.proc = proc
        self.seam = seam
        self.listdir = listdir  # seams: tests make a directory or a link unreadable (root reads everything)
        self.readlink = readlink

    def _raw(self, files: List[DeviceFile]) -> Tuple[Dict[int, List[str]], int, List[int], int]:
        """pid -> device paths held. The hot loop: per process one open of its fd directory, one listdir and one
        readlink per fd relative to that directory (dir_fd: no path walk through /proc each time), no stat unless
        a link names an NVIDIA path we do not know (a device node under another name, e.g. another mount
        namespace), then its st_rdev decides."""
        by_path = {d.path: d.path for d in files}
        by_rdev = {d.rdev: d.path for d in files if d.rdev is not None}
        proc = self.proc
        hits: Dict[int, List[str]] = {}
        unreadable: List[int] = []
        scanned = vanished = 0
        readlink, listdir, open_, close = self.readlink, self.listdir, os.open, os.close
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
        for name in listdir(proc):
            if not name.isdigit():
                continue
            scanned += 1
            try:
                dfd = open_(proc + "/" + name + "/fd", flags)
            except PermissionError:
                unreadable.append(int(name))
                continue
            except OSError:  # ENOENT/ESRCH: it exited meanwhile
                vanished += 1
                continue
            try:
                fds = listdir(dfd)
            except PermissionError:
                unreadable.append(int(name))
                close(dfd)
                continue
            except OSError:
                vanished += 1
                close(dfd)
                continue
            held = None
            denied = False
            for fd in fds:
                try:
                    target = readlink(fd, dir_fd=dfd)
                except PermissionError:  # listable but not readable (ptrace access mode check)
                    denied = True
                    continue
                except OSError:  # the fd closed meanwhile
                    continue
                path = by_path.get(target)
                if path is None and by_rdev and target.startswith("/dev/nvidia"):
                    try:
                        path = by_rdev.get(os.stat(fd, dir_fd=dfd).st_rdev)
                    except OSError:
                        path = None
                if path is not None:
                    if held is None:
                        held = hits[int(name)] = []
                    if path not in held:
                        held.append(path)
            close(dfd)
            if denied:
                unreadable.append(int(name))
        return hits, scanned, unreadable, vanished

    def scan(self) -> ScanResult:
        t0 = time.monotonic()
        files = device_files(self.pattern)
        if not files:  # a GPU-less box: nothing can hold a GPU, and NVML need not load
            return ScanResult(holders=[], scanned=0, unreadable=[], vanished=0, devices=[], nvml_unmatched=[],
                              nvml_available=False, duration_s=time.monotonic() - t0)
        nvml_error = None
        try:
            minor_to_index = self._minor_map()
        except self.seam.nvml.NVMLError as e:  # type: ignore[union-attr]  # seam exists when NVML answered
            minor_to_index, nvml_error = {}, str(e)
        kind_of = {d.path: d for d in files}
        hits, scanned, unreadable, vanished = self._raw(files)
        boot = self._boot_time()
        uptime = self._uptime()
        my_ns = self._pid_ns("self")
        self._my_container = container_id(_read(self.proc + "/self/cgroup") or "")
        users: Dict[int, str] = {}
        holders = []
        for pid, paths in sorted(hits.items()):
            h = self._describe(pid, paths, kind_of, minor_to_index, boot, uptime, my_ns, users)
            if h is None:
                vanished += 1
            else:
                holders.append(h)
        nvml_ok = False
        unmatched: List[Dict[str, Any]] = []
        if nvml_error is None:
            try:
                nvml_ok, unmatched = self._cross_check(holders)
            except self.seam.nvml.NVMLError as e:  # type: ignore[union-attr]
                nvml_error = str(e)
                for h in holders:
                    h.nvml_visible, h.gpu_memory_bytes = None, None
        return ScanResult(holders=holders, scanned=scanned, unreadable=unreadable, vanished=vanished,
                          devices=files, nvml_unmatched=unmatched, nvml_available=nvml_ok,
                          duration_s=time.monotonic() - t0, nvml_error=nvml_error)

    # -- details of a holder
    def _describe(self, pid: int, paths: List[str], kind_of: Dict[str, DeviceFile], minor_to_index: Dict[int, int],
                  boot: float, uptime: float, my_ns: Optional[str], users: Dict[int, str]) -> Optional[Holder]:
        base = "%s/%d/" % (self.proc, pid)
        st = read_stat(pid, self.proc)
        status = _read(base + "status")
        if st is None or status is None:
            return None
        uid, ns_pids = 0, [pid]
        for line in status.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
            elif line.startswith("NSpid:"):
                ns_pids = [int(x) for x in line.split()[1:]]
        cmdline = (_read(base + "cmdline") or "").replace("\0", " ").strip()
        minors = [kind_of[p].minor for p in paths if kind_of[p].kind == "gpu"]
        gpus = sorted({minor_to_index.get(m, m) for m in minors if m is not None})
        ns = self._pid_ns(str(pid))
        started = st.start_time / CLK_TCK
        container = container_id(_read(base + "cgroup") or "")
        return Holder(
            pid=pid, ppid=st.ppid, uid=uid, user=_user(uid, users), command=cmdline or "[%s]" % st.comm,
            state=st.state, age_s=max(0.0, uptime - started), start_time=boot + started, start_ticks=st.start_time,
            sid=st.sid, pgid=st.pgid, devices=sorted(paths), gpus=gpus,
            other_pid_ns=bool(my_ns and ns and ns != my_ns), ns_pids=ns_pids,
            container=container if container != getattr(self, "_my_container", None) else None,
        )

    def _pid_ns(self, pid: str) -> Optional[str]:
        try:
            return os.readlink("%s/%s/ns/pid" % (self.proc, pid))
        except OSError:
            return None

    def _boot_time(self) -> float:
        for line in (_read(self.proc + "/stat") or "").splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
        return time.time() - self._uptime()

    def _uptime(self) -> float:
        text = _read(self.proc + "/uptime")
        return float(text.split()[0]) if text else 0.0

    # -- NVML
    def _minor_map(self) -> Dict[int, int]:
        """Device minor -> NVML index. Without NVML, /dev/nvidia<N> is taken as GPU N."""
        seam = self.seam
        if seam is None or not seam.available():
            return {}
        out = {}
        for i, h in nvml_handles(seam):
            minor = seam.call("nvmlDeviceGetMinorNumber", h)
            if minor is not NA:
                out[int(minor)] = i
        return out

    def _cross_check(self, holders: List[Holder]) -> Tuple[bool, List[Dict[str, Any]]]:
        """Mark each holder NVML-visible or not, and list NVML processes no holder matches."""
        seam = self.seam
        if seam is None or not seam.available():
            return False, []
        # NVML translates PIDs to the CALLER's namespace (or, on old drivers in a container, gives host PIDs):
        # only the holder's pid as seen from here can match, never its pid inside its own namespace.
        by_pid = {h.pid: h for h in holders}
        unmatched: List[Dict[str, Any]] = []
        listed: Dict[int, bool] = {}  # gpu index -> NVML gave a process list
        nv = seam.nvml
        for i, handle in nvml_handles(seam):
            try:
                procs = running_processes(seam, handle)
            except (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown):
                procs = NA
            listed[i] = procs is not NA
            for p in ([] if procs is NA else procs):
                h = by_pid.get(p.pid)
                if h is None:
                    unmatched.append({"gpu": i, "pid": p.pid, "memory_bytes": p.usedGpuMemory})
                    continue
                h.nvml_visible = True
                if p.usedGpuMemory is not None:
                    h.gpu_memory_bytes = (h.gpu_memory_bytes or 0) + p.usedGpuMemory
        foreign_ns_gpus = {u["gpu"] for u in unmatched}
        for h in holders:
            if h.nvml_visible or not h.gpus:
                continue
            if any(g in foreign_ns_gpus for g in h.gpus) or not all(listed.get(g) for g in h.gpus):
                h.nvml_visible = None  # NVML's PIDs are from another namespace here (or no list): can't tell
            else:
                h.nvml_visible = False
        return True, unmatched


def nvml_handles(seam: NvmlSeam) -> List[Tuple[int, Any]]:
    """(index, handle) of every GPU NVML can still reach; a lost one (Xid 79) is left out, never fatal here."""
    nv = seam.nvml
    out = []
    for i in range(seam.call("nvmlDeviceGetCount", optional=False)):
        try:
            out.append((i, seam.call("nvmlDeviceGetHandleByIndex", i, optional=False)))
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_Unknown):
            continue
    return out
