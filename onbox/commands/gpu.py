"""`onbox gpu` (health) and `onbox reap` (who pins GPU memory; kill it with --force). Thin: parse, call, print."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import click

from onbox.clikit import FiniteFloat, LaidOut, echo_json
from onbox.errors import JobFailed, UsageError

DEVICES_HELP = "Glob of the NVIDIA device files to look for holders of (env ONBOX_GPU_DEVICES)."
NO_GPU = "no GPU readings: %s"


def _gib(v: Optional[float]) -> str:
    return "-" if v is None else "%.1f" % (v / 2**30)


def _age(s: float) -> str:
    for unit, size, upto in (("s", 1, 120), ("m", 60, 7200), ("h", 3600, 172800)):
        if s < upto:
            return "%d%s" % (s // size, unit)
    return "%dd" % (s // 86400)


def _na(v: Any, fmt: str = "%s") -> str:
    return "N/A" if v is None else fmt % v


def _seam() -> Any:
    from onbox.gpu.nvml import NvmlSeam

    return NvmlSeam()


def _monitor(seam: Any) -> Any:
    from onbox.gpu.readings import GpuMonitor

    return GpuMonitor(seam)


@click.command("gpu", cls=LaidOut, examples=["onbox gpu", "onbox gpu --json   # what the heartbeats carry"])
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (the heartbeat's GPU readings).")
@click.option("--devices", default="/dev/nvidia*", envvar="ONBOX_GPU_DEVICES", show_default=True, help=DEVICES_HELP)
def gpu(as_json: bool, devices: str) -> None:
    """GPU health, with a verdict per GPU: healthy, throttled, memory pinned by N holders, or dead.

    Utilisation beside SM clock and power (U21), memory, temperature, throttle reasons (U23), ECC,
    Xid events (U22: Xid 48/79 = dead card, re-rent) and a verdict per GPU: healthy, throttled, memory pinned by N
    holders, or dead. A box without the NVIDIA driver prints why and exits 0."""
    from onbox.gpu.holders import HolderScan
    from onbox.gpu.ownership import AttemptIndex, classify
    from onbox.paths import runs_dir

    seam = _seam()
    scan = HolderScan(devices, seam=seam).scan()
    classify(scan, AttemptIndex.load(runs_dir()))
    by_gpu: Dict[int, List[Dict[str, Any]]] = {
        i: [{"pid": h.pid, "owner": h.owner} for h in hs] for i, hs in scan.by_gpu().items()}
    doc = _monitor(seam).readings(holders=by_gpu)
    doc["holders"] = scan.to_dict()
    if as_json:
        echo_json(doc)
        return
    if not doc["available"]:
        click.echo(NO_GPU % doc["reason"])
    else:
        click.echo("driver %s, CUDA %s" % (doc["driver_version"], doc["cuda_driver_version"]))
    for g in doc["gpus"]:
        click.echo("GPU %d  %s  [%s] %s" % (g["index"], g["name"], g["verdict"], g["verdict_reason"]))
        click.echo("  util %s  SM %s/%s MHz  power %s/%s W  temp %s  (U21: util only means a kernel ran)" % (
            _na(g["util_percent"], "%d%%"), _na(g["sm_clock_mhz"]), _na(g["sm_clock_max_mhz"]),
            _na(g["power_w"], "%.0f"), _na(g["power_limit_w"], "%.0f"), _na(g["temperature_c"], "%d C")))
        ecc = g["ecc"]
        click.echo("  memory %s/%s GiB  throttle: %s  ECC uncorrected: %s volatile, %s aggregate" % (
            _gib(g["memory_used_bytes"]), _gib(g["memory_total_bytes"]), ", ".join(g["throttle_reasons"]) or "none",
            _na(ecc["uncorrected_volatile"]), _na(ecc["uncorrected_aggregate"])))
        xids = ", ".join("%d (%s)" % (e["xid"], e["source"]) for e in g["xid_events"])
        click.echo("  Xid: %s  holders: %d" % (xids or "none", len(by_gpu.get(g["index"], []))))
    if doc["available"]:
        click.echo("Xid sources: NVML %s; dmesg %s" % (doc["xid_sources"]["nvml"], doc["xid_sources"]["dmesg"]))
    _print_scan_footer(doc["holders"])


def _print_scan_footer(scan: Dict[str, Any]) -> None:
    if not scan["devices"]:
        click.echo("no NVIDIA device files here (--devices): nothing can hold a GPU")
        return
    click.echo("device holders: %d of %d processes (scan %.0f ms)" % (
        len(scan["holders"]), scan["scanned"], scan["duration_s"] * 1000))
    if scan["unreadable"]:
        click.echo("  %d processes could not be read (permission): they may hold a GPU; %s" % (
            scan["unreadable"], "run as root to see them" if os.geteuid() != 0
            else "not even root may read them here (another user namespace)"))
    containers: Dict[str, List[Dict[str, Any]]] = {}
    for h in scan["holders"]:
        if h.get("container"):
            containers.setdefault(h["container"], []).append(h)
    for cid, hs in sorted(containers.items()):
        runs = sorted({"%s attempt %s" % (h["run"], h["attempt"]) for h in hs if h.get("run")})
        click.echo("  container %s: %d holder(s) (pid %s)%s" % (
            cid[:12], len(hs), ", ".join(str(h["pid"]) for h in hs),
            ", started by run %s" % "; ".join(runs) if runs else ", not started by onbox here"))
    for u in scan["nvml_unmatched"]:
        click.echo("  NVML pid %d holds %s GiB on GPU %d but is not a process here: it lives in another container "
                   "or on the host (PID namespace differs): restart that container" % (
                       u["pid"], _gib(u["memory_bytes"]), u["gpu"]))


@click.command("reap", cls=LaidOut, examples=[
    "onbox reap                      # dry run: every holder, with a verdict and the reason",
    "onbox reap --force              # kill the candidates",
    "onbox reap --force --min-age 300 --all-users"])
@click.option("--force", is_flag=True, help="Kill the candidates (TERM, wait, KILL). Without it: a dry run.")
@click.option("--all-users", is_flag=True, help="As root: also consider other users' processes.")
@click.option("--min-age", type=FiniteFloat(0.0, 1e9), default=60.0, show_default=True, metavar="S",
              help="Never touch a holder younger than S seconds.")
@click.option("--term-timeout", type=FiniteFloat(0.0, 3600.0), default=5.0, show_default=True, metavar="S",
              help="Seconds between SIGTERM and SIGKILL (0-3600).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--devices", default="/dev/nvidia*", envvar="ONBOX_GPU_DEVICES", show_default=True, help=DEVICES_HELP)
def reap(force: bool, all_users: bool, min_age: float, term_timeout: float, as_json: bool, devices: str) -> None:
    """Find processes pinning GPU memory (U11) and say, per holder, whether it may be reaped and why.

    Candidates: orphans of this box's earlier run attempts, and foreign holders that are invisible to NVML or
    idle, older than --min-age. Never the current attempt of a run, never another user's process unless root
    and --all-users, never a process of another container (restart that container instead). Every kill is
    logged to $ONBOX_HOME/reap.jsonl. Exit 1 when --force could not free every candidate."""
    from onbox.gpu.reaper import kill_log, survey
    from onbox.gpu.reaper import reap as do_reap
    from onbox.paths import onbox_home, runs_dir

    if min_age < 0 or term_timeout < 0:
        raise UsageError("--min-age and --term-timeout must be >= 0 seconds")
    if all_users and os.geteuid() != 0:
        raise UsageError("--all-users needs root", hint="run it with sudo, or leave out --all-users")
    seam = _seam()
    scan, decisions = survey(devices=devices, seam=seam, runs_dir=runs_dir(), min_age_s=min_age,
                             all_users=all_users)
    if force:
        do_reap(decisions, term_timeout_s=term_timeout, record=kill_log(os.path.join(onbox_home(), "reap.jsonl")))
    failed = [d for d in decisions if d.verdict == "reap" and force
              and d.outcome not in ("terminated by SIGTERM", "killed by SIGKILL (ignored SIGTERM)", "already gone")]
    if as_json:
        doc = scan.to_dict()
        doc.pop("holders")
        doc.update(forced=force, decisions=[d.to_dict() for d in decisions])
        echo_json(doc)
    else:
        _print_table(decisions, force)
        _print_scan_footer(scan.to_dict())
        if not force and any(d.verdict == "reap" for d in decisions):
            click.echo("dry run: `onbox reap --force` kills the holders marked 'reap'")
    if failed:
        raise JobFailed("%d of the holders to reap are still alive" % len(failed),
                        hint="see the outcome column; a process stuck in state D needs a reboot (re-rent)")


def _print_table(decisions: List[Any], force: bool) -> None:
    if not decisions:
        click.echo("no process holds an NVIDIA device file")
        return
    rows = [("PID", "USER", "AGE", "SID", "CONTAINER", "GPU", "MEM GiB", "NVML", "OWNER", "VERDICT",
             "REASON" if not force else "OUTCOME", "COMMAND")]
    for d in decisions:
        h = d.holder
        nvml = {True: "yes", False: "no", None: "?"}[h.nvml_visible]
        owner = h.owner if not h.run else "%s:%s#%s" % (h.owner, h.run, h.attempt)
        rows.append((str(h.pid), h.user, _age(h.age_s), str(h.sid), h.container_short, ",".join(map(str, h.gpus)) or "-",
                     _gib(h.gpu_memory_bytes), nvml, owner, d.verdict,
                     (d.outcome or d.reason) if force else d.reason, h.command[:40]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
