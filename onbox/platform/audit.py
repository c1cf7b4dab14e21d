"""The pre-flight check (`onbox audit`): is this box fit for the run? Asked before anything starts, in under 2 seconds.

Each check gives a verdict (ok / warn / fail / info), a one-line summary and, when something needs doing, a hint.
A `fail` makes the box unfit (exit 3): the checkpoint dir is unwritable or below the free-space/inode floor, the
durable target is unusable, the torch build needs a newer CUDA than the driver has. Nothing here writes
anything except a probe file that is removed at once, and nothing imports torch (U28: its version and CUDA
build are read from its files, so the image's torch is never touched and the audit stays fast).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

from onbox import vocab
from onbox.fsutil import FreeSpace, free_space, is_writable_dir

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
GiB = 1024 ** 3
TOOLS = ("tmux", "rsync", "rclone")


@dataclasses.dataclass
class Check:
    name: str  # stable id, e.g. "disk.ckpt", "cgroup.memory"
    verdict: str  # ok | warn | fail | info
    summary: str
    hint: Optional[str] = None
    data: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class AuditOptions:
    ckpt_dir: Optional[str] = None
    durable: Optional[str] = None
    min_free_gb: float = 10.0
    min_free_inodes: int = 10000
    profile: Optional[str] = None
    profile_file: Optional[str] = None


@dataclasses.dataclass
class Seams:
    """The system as the audit sees it; tests pass fixture roots and fakes."""

    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(os.environ))
    cgroup_root: str = "/"
    nvml: Any = None  # an NvmlSeam; None = the real one
    which: Callable[[str], Optional[str]] = shutil.which
    torch_dir: Optional[str] = None  # the torch package dir; None = find_spec("torch")


@dataclasses.dataclass
class AuditReport:
    checks: List[Check]
    elapsed_s: float

    @property
    def fit(self) -> bool:
        return not any(c.verdict == FAIL for c in self.checks)

    def to_dict(self) -> Dict[str, Any]:
        from onbox import __version__

        return {"schema": vocab.SCHEMA_AUDIT, "onbox_version": __version__, "fit": self.fit,
                "elapsed_s": round(self.elapsed_s, 3), "checks": [dataclasses.asdict(c) for c in self.checks]}


def _gb(n: int) -> str:
    return "%.1f GB" % (n / GiB)


def is_remote(target: str) -> bool:
    """rclone remotes look like "name:path"; local paths are absolute or relative without a colon first."""
    return bool(re.match(r"^[A-Za-z0-9_.-]+:", target)) and not target.startswith("/")


def check_python() -> Check:
    v = sys.version_info
    return Check("python", OK, "Python %d.%d.%d at %s" % (v[0], v[1], v[2], sys.executable),
                 data={"version": "%d.%d.%d" % (v[0], v[1], v[2]), "executable": sys.executable})


def check_space(name: str, label: str, path: str, opts: AuditOptions, must_write: bool, floor: bool) -> Check:
    """Free bytes AND inodes (U7) of the filesystem holding `path`; writability when `must_write`.

    `floor`: below --min-free-gb / --min-free-inodes is a fail (the run's own disks), else a warning.
    """
    path = os.path.abspath(os.path.expanduser(path))
    fs: FreeSpace = free_space(path)
    data: Dict[str, Any] = {"path": path, "measured_at": fs.path, "free_bytes": fs.free_bytes,
                            "total_bytes": fs.total_bytes, "free_inodes": fs.free_inodes,
                            "total_inodes": fs.total_inodes}
    inodes = ("%d free inodes" % fs.free_inodes) if fs.has_inode_limit else "no inode limit"
    summary = "%s %s: %s free of %s, %s" % (label, path, _gb(fs.free_bytes), _gb(fs.total_bytes), inodes)
    bad = FAIL if floor else WARN
    if must_write:
        writable = is_writable_dir(fs.path)
        data["writable"] = writable
        if not writable:
            return Check(name, bad, "%s %s is not writable (checked %s)" % (label, path, fs.path),
                         "pick a writable directory (a read-only mount or another user's dir cannot hold "
                         "checkpoints)", data)
    min_bytes = int(opts.min_free_gb * GiB)
    if fs.free_bytes < min_bytes:
        return Check(name, bad, summary + " (below %s)" % _gb(min_bytes),
                     "free space or point --ckpt-dir/--durable elsewhere; a save that hits a full disk dies "
                     "mid-write (U6)", data)
    if fs.has_inode_limit and fs.free_inodes < opts.min_free_inodes:
        return Check(name, bad, summary + " (below %d inodes)" % opts.min_free_inodes,
                     "the disk dies on inodes before bytes (U7): delete small files (eval outputs, caches) "
                     "or write elsewhere", data)
    if fs.free_bytes < 2 * min_bytes or (fs.has_inode_limit and fs.free_inodes < 2 * opts.min_free_inodes):
        return Check(name, WARN, summary + " (close to the floor)", "watch it: `df -h` and `df -i` (U7)", data)
    return Check(name, OK, summary, data=data)


def check_cgroup(seams: Seams) -> List[Check]:
    from onbox.telemetry.host import effective_cpus, load_average, read_cgroup

    r = read_cgroup(seams.cgroup_root)
    out: List[Check] = []
    data = r.to_dict()
    if r.version == "none":
        out.append(Check("cgroup.memory", INFO, "no cgroup filesystem found", data=data))
    else:
        limit = "no limit" if r.memory_limit_bytes is None else _gb(r.memory_limit_bytes)
        current = "?" if r.memory_current_bytes is None else _gb(r.memory_current_bytes)
        summary = "cgroup %s %s: memory %s used, limit %s, oom_kill %s" % (
            r.version, r.path, current, limit, "n/a" if r.oom_kill is None else r.oom_kill)
        verdict, hint = OK, None
        if r.oom_kill:
            verdict, hint = WARN, ("the kernel already OOM-killed %d process(es) in this cgroup: a bare 'Killed' "
                                   "(exit 137) is memory, not a bug; lower num_workers or batch size (U9)"
                                   % r.oom_kill)
        elif r.memory_limit_bytes and r.memory_current_bytes and r.memory_current_bytes > 0.9 * r.memory_limit_bytes:
            verdict, hint = WARN, "memory is above 90% of the cgroup limit (U9)"
        out.append(Check("cgroup.memory", verdict, summary, hint, data))
    cpus = effective_cpus(r)
    host_cpus = os.cpu_count() or cpus
    omp = seams.environ.get("OMP_NUM_THREADS")
    quota = "no CPU quota" if r.cpu_quota_cores is None else "CPU quota %.2f cores" % r.cpu_quota_cores
    cpu_data = {"quota_cores": r.cpu_quota_cores, "effective_cpus": cpus, "host_cpus": host_cpus,
                "omp_num_threads": omp, "load_average": load_average()}
    summary = "%s -> %d usable CPUs (host has %d); OMP_NUM_THREADS=%s" % (quota, cpus, host_cpus, omp or "unset")
    if omp and omp.isdigit() and int(omp) > cpus:
        out.append(Check("cpu.threads", WARN, summary, "OMP_NUM_THREADS exceeds the usable CPUs: threads "
                         "thrash the slice and starve the GPU; set it to %d (U40)" % cpus, cpu_data))
    elif not omp and cpus < host_cpus:
        out.append(Check("cpu.threads", INFO, summary, "torch would start %d threads; `onbox run` sets "
                         "OMP_NUM_THREADS=%d for the job (U40)" % (host_cpus, cpus), cpu_data))
    else:
        out.append(Check("cpu.threads", OK, summary, data=cpu_data))
    return out


def check_gpus(seams: Seams) -> Check:
    from onbox.gpu.readings import inventory

    inv = inventory(seams.nvml)
    data = inv.to_dict()
    if not inv.available:
        return Check("gpu", INFO, "no GPUs: %s" % inv.reason, data=data)
    names = ", ".join("%d: %s (%s)" % (g.index, g.name, _gb(g.memory_total_bytes) if g.memory_total_bytes else "?")
                      for g in inv.gpus)
    return Check("gpu", OK, "%d GPU(s), driver %s, CUDA %s: %s" % (len(inv.gpus), inv.driver_version,
                                                                 inv.cuda_driver_version, names or "none"), data=data)


def _torch_build(torch_dir: str) -> Dict[str, Optional[str]]:
    """torch's version and CUDA build from torch/version.py, without importing torch (slow; U28)."""
    out: Dict[str, Optional[str]] = {"version": None, "cuda": None}
    try:
        with open(os.path.join(torch_dir, "version.py"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return out
    for key, pattern in (("version", r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)"),
                         ("cuda", r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)")):
        m = re.search(pattern, text, re.M)
        out[key] = m.group(1) if m else None
    return out


def _major_minor(v: str) -> tuple:
    parts = re.findall(r"\d+", v)[:2]
    return tuple(int(p) for p in parts) + (0,) * (2 - len(parts))


def check_torch(seams: Seams, gpu: Check) -> Check:
    torch_dir = seams.torch_dir
    if torch_dir is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return Check("torch", INFO, "torch is not importable by %s" % sys.executable,
                         "fine for onbox itself; the job's own python may differ")
        torch_dir = next(iter(spec.submodule_search_locations))
    build = _torch_build(torch_dir)
    data: Dict[str, Any] = {"dir": torch_dir, "version": build["version"], "cuda_build": build["cuda"],
                            "cuda_driver": gpu.data.get("cuda_driver_version")}
    summary = "torch %s, CUDA build %s" % (build["version"] or "?", build["cuda"] or "none (CPU)")
    driver = gpu.data.get("cuda_driver_version")
    if not gpu.data.get("available"):
        return Check("torch", INFO, summary + "; no driver to compare with", data=data)
    if not build["cuda"]:
        return Check("torch", WARN, summary + " on a box with GPUs",
                     "this torch cannot use the GPUs; use the image's CUDA torch, don't reinstall over it (U28)", data)
    if driver and _major_minor(build["cuda"]) > _major_minor(driver):
        if _major_minor(build["cuda"])[0] > _major_minor(driver)[0]:
            return Check("torch", FAIL, summary + " needs a newer driver (driver supports CUDA %s)" % driver,
                         "the host driver can't be changed on a rental: install a torch built for CUDA <= %s "
                         "(U28)" % driver, data)
        return Check("torch", WARN, summary + " is newer than the driver's CUDA %s (minor-version "
                     "compatibility usually holds; PTX JIT may fail)" % driver,
                     "prefer a torch built for CUDA <= %s (U28)" % driver, data)
    return Check("torch", OK, summary + ", driver supports CUDA %s" % driver, data=data)


def check_tools(seams: Seams, durable: Optional[str]) -> List[Check]:
    out = []
    for tool in TOOLS:
        path = seams.which(tool)
        if path:
            out.append(Check("tool.%s" % tool, OK, "%s: %s" % (tool, path), data={"path": path}))
        elif tool == "rclone" and durable and is_remote(durable):
            out.append(Check("tool.rclone", FAIL, "rclone not found but --durable %s is an rclone remote" % durable,
                             "install rclone (a static binary, no root needed) or use a mounted path", {}))
        else:
            why = {"tmux": "onbox detaches without it; handy for interactive sessions",
                   "rsync": "onboxctl pull uses rsync over SSH",
                   "rclone": "needed only for object-store durable targets"}[tool]
            out.append(Check("tool.%s" % tool, INFO, "%s not found (%s)" % (tool, why), data={"path": None}))
    return out


def _extraction_root(environ: Mapping[str, str]) -> str:
    from onbox.platform import extractroot

    root = extractroot.current_root()
    if root:
        return root
    return os.path.expanduser(environ.get("SHIV_ROOT") or "~/.shiv")  # where a pyz would extract (checkout run)


def run_audit(opts: AuditOptions, seams: Optional[Seams] = None) -> AuditReport:
    from onbox.paths import onbox_home
    from onbox.platform import profiles

    seams = seams or Seams()
    t0 = time.monotonic()
    checks: List[Check] = [check_python()]
    prof, why = profiles.select(opts.profile, opts.profile_file, seams.environ)
    bill, paths = prof.table("billing"), prof.table("paths")
    checks.append(Check("profile", INFO, "%s (%s): meter stop %r%s, verified %s" % (
        prof.name, why, bill["meter_stop"], " IRREVERSIBLE" if bill["irreversible"] else "", bill["verified"]),
        data={"name": prof.name, "evidence": why, "run_defaults": prof.run_defaults()}))

    fast = os.path.expanduser(paths.get("fast") or "")
    ckpt = opts.ckpt_dir or (fast if fast.startswith("/") and os.path.isdir(fast) else onbox_home())
    checks.append(check_space("disk.ckpt", "checkpoint dir", ckpt, opts, must_write=True, floor=True))
    durable = opts.durable
    if durable is None:
        guess = os.path.expanduser(prof.run_defaults().get("durable") or paths.get("durable") or "")
        usable = guess.startswith("/") and "<" not in guess
        durable = guess if usable and (os.path.isdir(guess) or os.path.isdir(os.path.dirname(guess))) else None
    if durable and is_remote(durable):
        checks.append(Check("disk.durable", INFO, "durable %s is an rclone remote (checked by `onbox sync`)" % durable))
    elif durable:
        check = check_space("disk.durable", "durable dir", durable, opts, must_write=True,
                            floor=opts.durable is not None)
        if paths.get("inode_cap"):
            check.data["inode_cap"] = paths["inode_cap"]
            check.hint = (check.hint + "; " if check.hint else "") + "%s caps this filesystem at %d inodes (U7)" % (
                prof.name, paths["inode_cap"])
        checks.append(check)
    else:
        checks.append(Check("disk.durable", WARN, "no durable target (--durable)",
                            "checkpoints on this box die with it: give --durable a mounted path or rclone remote"))
    home = check_space("disk.home", "home", os.path.expanduser("~"), opts, must_write=False, floor=False)
    home.data["writable"] = is_writable_dir(home.data["measured_at"])
    if not home.data["writable"] and home.verdict == OK:
        home.verdict, home.hint = WARN, ("$HOME is read-only: onbox keeps its state in $ONBOX_HOME (now %s) and "
                                         "extracts itself elsewhere; caches that default to ~ (pip, HF) need "
                                         "redirecting" % onbox_home())
    checks.append(home)
    checks.append(check_space("disk.extract", "extraction root", _extraction_root(seams.environ), opts,
                              must_write=False, floor=False))
    checks.extend(check_cgroup(seams))
    gpu = check_gpus(seams)
    checks.append(gpu)
    checks.append(check_torch(seams, gpu))
    checks.extend(check_tools(seams, durable))
    return AuditReport(checks, time.monotonic() - t0)
