"""Correlated loss (issue 31, part 3; `python -m tests.bench keeper_wave`): a spot market takes boxes in waves. N runs
train, each on its own network-namespace box (its own sshd, the real onbox.pyz, a real agent beating every 5 s to a
real tracker, the keeper's pure-Python trainer), with spares idle in the pool (up, sshd answering, no onbox.pyz
when the keeper starts: it warms them, pushed and started once, before any loss); `onboxctl keep` runs with its
defaults and has watched for --lost-after. Then K boxes vanish at the same
instant (their links down first: they answer nothing, every probe of them waits out its timeout; then their agents
and trainers SIGKILLed and their sshd stopped). Measured: the time from the cut to each lost run's first new step on
a spare (the trainer's own trace), and above all to the LAST one's, for K = 1, 4 and 16, each beside K = 1.

N is the same for every K (the same background: N agents and trainers on this machine), the spares are K. Each K
is a fresh fleet. Goal: K = 16 within ~1.5x of K = 1 (the keeper asks every box at once and recovers every run at
once: what is left is the machine's own CPU, shared by the keeper, every box and every recovery's processes).
`ONBOX_BENCH_WAVE=N:K1,K2,...` changes the sizes (e.g. 6:1,4 on a small machine). `ONBOX_BENCH_WAVE_WARM=1`: the
spares have onbox.pyz already (`onboxctl push` before the keeper starts: what a spare that was used once has), so
the wave costs no push and no first start of the pyz there. `ONBOX_BENCH_WAVE_RECORDS=DIR` keeps each wave's keeper
records, the new agents' events and the keeper's output in DIR.
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

HEARTBEAT = 5.0
STEP_INTERVAL = 0.2  # seconds a trainer step takes (16 trainers share 2 CPUs with everything else)
WAIT = 300.0  # seconds: the bound on a wave's recovery
GOAL = 1.5  # the last of K=16 within this many times K=1's


def _sizes() -> Tuple[int, List[int]]:
    spec = os.environ.get("ONBOX_BENCH_WAVE", "16:1,4,16")
    n, _, ks = spec.partition(":")
    return int(n), [int(k) for k in ks.split(",")]


def _warm() -> bool:
    return os.environ.get("ONBOX_BENCH_WAVE_WARM", "") not in ("", "0")


def _fleet(root: str, pyz: str, n: int, spares: int) -> Tuple[Any, Any, Any, List[str]]:
    """N runs r<i> on boxes b<i>, `spares` idle spares s<j> (pool p), the tracker; the rig and the run names."""
    from tests.hosts.keeper_rig import Rig
    from tests.hosts.sshd_box import BridgedBoxes
    from tests.hosts.tracker import TrackerProcess
    from tests.polling import wait_for

    made = BridgedBoxes(os.path.join(root, "boxes"))
    net = made.network(n + spares)
    boxes = made.start(net)
    tracker = TrackerProcess(os.path.join(root, "tracker"), host=net.netns(0).host_addr).start()
    rig = Rig(os.path.join(root, "ctl"), pyz, fast=False)
    rig.env["ONBOX_TRACKER_TOKEN"] = tracker.token
    for i in range(n):
        rig.add("b%d" % i, boxes[i], pool="p")
    for j in range(spares):
        rig.add("s%d" % j, boxes[n + j], pool="p")
        if _warm():
            rig.ctl("push", "s%d" % j, "--pyz", pyz)
    runs = ["r%d" % i for i in range(n)]

    def start(i: int) -> None:
        rig.ctl("push", "b%d" % i, "--pyz", pyz)
        argv = rig.run_argv("b%d" % i, "--tracker", tracker.url, "--tracker-token-file", tracker.token_file,
                            heartbeat=HEARTBEAT, lost_after=None, step_interval=STEP_INTERVAL, first_step=True)
        argv[argv.index("--name") + 1] = runs[i]
        rig.ctl(*argv, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(start, range(n)))
    for run in runs:
        with rig.named(run):
            wait_for(lambda: len(rig.committed()) >= 1, 120, "a durable commit of %s" % run, 0.2)
    return made, tracker, rig, runs


CPU_KINDS = ("keeper", "ssh masters", "boxes' sshd + onbox commands", "agents", "trainers", "tracker")


def _cpu(keeper: int) -> Dict[Tuple[int, int], Tuple[str, float]]:
    """Every process: (pid, start) -> (its kind, CPU seconds it and its reaped children used). Kinds: the keeper (its
    ssh clients are reaped into it), its ssh masters, what runs under the boxes' sshd (the onbox commands the
    keeper and `onboxctl` ask, rsync, the shells), the boxes' agents and trainers, the tracker; the rest is
    `other` (this machine's other work)."""
    tick = os.sysconf("SC_CLK_TCK")
    root_ns = os.readlink("/proc/self/ns/net")
    out: Dict[Tuple[int, int], Tuple[str, float]] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open("/proc/%d/stat" % pid) as f:
                stat = f.read()
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            ns = os.readlink("/proc/%d/ns/net" % pid)
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        used = sum(int(x) for x in rest[11:15]) / tick
        if pid == keeper:
            kind = "keeper"
        elif "onbox.pyz run " in cmd and ns != root_ns:  # its argv names the trainer too
            kind = "agents"
        elif "keep_trainer.py" in cmd:
            kind = "trainers"
        elif "tracker serve" in cmd:
            kind = "tracker"
        elif comm == "ssh" and ns == root_ns:
            kind = "ssh masters"
        elif comm.startswith("sshd") and ns != root_ns:
            kind = "boxes' sshd + onbox commands"
        else:
            kind = "other"
        out[(pid, int(rest[19]))] = (kind, used)
    return out


def _cpu_used(before: Dict[Tuple[int, int], Tuple[str, float]], after: Dict[Tuple[int, int], Tuple[str, float]],
              seconds: float) -> Dict[str, float]:
    """CPU seconds each kind used between the two snapshots, and `all`: the whole machine's in that time."""
    used: Dict[str, float] = {kind: 0.0 for kind in CPU_KINDS}
    for key, (kind, t) in after.items():
        if kind in used:
            used[kind] += t - (before[key][1] if key in before else 0.0)
    used["other"] = seconds - sum(used.values())  # processes that ended in between are in it, where not reaped
    used["all"] = seconds
    return used


def _machine_cpu() -> float:
    """CPU seconds this machine has spent working (all CPUs) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _wave(root: str, pyz: str, n: int, k: int) -> Dict[str, Any]:
    from controller.keeper.policy import RecoveryPolicy
    from tests.hosts.keeper_rig import PHASES
    from tests.hosts.sshd_box import BridgeNet
    from tests.polling import wait_for

    made, tracker, rig, runs = _fleet(root, pyz, n, k)
    try:
        t_keep = time.time()
        keeper = rig.keeper()
        armed = t_keep + RecoveryPolicy(pool="p").lost_after_s(HEARTBEAT) + 1.0

        def watched() -> bool:
            for run in runs:
                with rig.named(run):
                    if (rig.record().get("last_ok") or 0) <= armed:
                        return False
            return True

        wait_for(watched, 120, "the keeper watching every run for --lost-after", 0.3)
        lost = runs[:k]
        cpu0, machine0 = _cpu(keeper.pid), _machine_cpu()
        t_cut = time.time()
        for i in range(k):  # every link first: they vanish at the same instant
            subprocess.run(["ip", "-n", rig.boxes["b%d" % i].netns.ns, "link", "set", BridgeNet.IFNAME, "down"],
                           check=True, timeout=30)
        t_cut_end = time.time()
        for i, run in enumerate(lost):
            with rig.named(run):
                rig.kill_run("b%d" % i)
            rig.boxes["b%d" % i].stop()

        def firsts() -> Any:
            got = {e["box"]: float(e["time"]) for e in rig.first_steps() if str(e.get("box", "")).startswith("s")}
            return got if len(got) >= k else None

        first = wait_for(firsts, WAIT, "%d runs training again on spares" % k, 0.3)
        cpu = _cpu_used(cpu0, _cpu(keeper.pid), _machine_cpu() - machine0)
        t_end = time.time()
        phases: Dict[str, List[float]] = {p: [] for p in (*PHASES[:-1], "launch_started")}

        def relaunched(run: str) -> Any:
            with rig.named(run):
                rec = rig.record()
            last = rec.get("current") or (rec.get("history") or [None])[-1] or {}
            return rec if "relaunched" in (last.get("phases") or {}) else None

        records = {}
        for run in lost:  # the keeper writes `relaunched` once `onbox run` returned: maybe after the first step
            rec = records[run] = wait_for(lambda r=run: relaunched(r), 60, "%s's record" % run, 0.3)
            last = rec.get("current") or rec["history"][-1]
            for p, t in dict(last["phases"], launch_started=last.get("launch_started_at")).items():
                if p in phases and t is not None:
                    phases[p].append(t - t_cut)
        _keep(os.environ.get("ONBOX_BENCH_WAVE_RECORDS"), k, t_cut, records, first, rig)
        took = sorted(t - t_cut for t in first.values())
        return {"k": k, "n": n, "took": took, "cut_spread": t_cut_end - t_cut, "phases": phases, "cpu": cpu,
                "window": t_end - t_cut,
                "boxes": sorted(first), "load": os.getloadavg()}
    finally:
        rig.close()
        for run in runs:  # wherever each run lives now
            with rig.named(run):
                for name in rig.boxes:
                    rig.kill_run(name)
        tracker.stop()
        made.close()


def _keep(where: Any, k: int, t_cut: float, records: Dict[str, Any], first: Dict[str, float], rig: Any) -> None:
    """With ONBOX_BENCH_WAVE_RECORDS=DIR: the wave's keeper records, first steps and keeper output kept there."""
    if not where:
        return
    import json

    os.makedirs(where, exist_ok=True)
    agents = {}
    for run, rec in records.items():  # what the agent on its new box said, with the times
        with rig.named(run):
            agents[run] = [{"type": e.get("type"), "time": e.get("time")} for b in rec.get("boxes") or []
                           if b in rig.boxes for e in rig.events(b)]
    with open(os.path.join(where, "k%d.json" % k), "w") as f:
        json.dump({"cut": t_cut, "first": first, "records": records, "agents": agents}, f, indent=1)
    shutil.copy(str(rig.tmp / "keep.out"), os.path.join(where, "k%d-keep.out" % k))


def _spread(v: List[float]) -> str:
    return "%5.1f %5.1f %5.1f" % (min(v), statistics.median(v), max(v)) if v else "    -     -     -"


def _report(results: List[Dict[str, Any]]) -> bool:
    base = next((r for r in results if r["k"] == 1), results[0])
    print("N runs, K boxes lost at once (links cut, then killed); spares: K, warm (%s); heartbeat %g s, "
          "keep's defaults" % ("onbox.pyz pushed before the keeper started" if _warm()
                               else "no onbox.pyz when the keeper started: it warms them", HEARTBEAT))
    print("  %-4s %-4s %12s %12s %12s %14s" % ("N", "K", "first run", "median", "LAST run", "LAST / K=1's"))
    ok = True
    for r in results:
        ratio = r["took"][-1] / base["took"][-1]
        print("  %-4d %-4d %10.1f s %10.1f s %10.1f s %13.2fx" % (
            r["n"], r["k"], r["took"][0], statistics.median(r["took"]), r["took"][-1], ratio))
        if r["k"] >= 16:
            ok = ok and ratio <= GOAL
    print("  each phase, seconds after the cut (min median max over the K runs); launch_started: `onbox run` called "
          "(the keeper's side ends there, the box's begins: its agent, the trainer's start, its first step)")
    order = ("detected", "declared_lost", "box_chosen", "pushed", "launch_started", "relaunched")
    print("  %-4s %s %17s" % ("K", " ".join("%17s" % p for p in order), "first new step"))
    for r in results:
        print("  %-4d %s %17s" % (r["k"], " ".join("%17s" % _spread(r["phases"].get(p, [])) for p in order),
                                  _spread(r["took"])))
    for r in results:
        keeper, box = max(r["phases"]["launch_started"] or [0.0]), r["took"][-1] - max(
            r["phases"]["launch_started"] or [0.0])
        print("  K=%-3d the keeper's side: the cut to the LAST launch started %.1f s; the box's: from there to the "
              "LAST first new step %.1f s" % (r["k"], keeper, box))
    print("  CPU seconds used from the cut to the LAST first new step (%d CPUs), by whom:" % (os.cpu_count() or 0))
    kinds = (*CPU_KINDS, "other")
    print("  %-4s %7s %s %8s" % ("K", "window", " ".join("%14s" % x[:14] for x in kinds), "machine"))
    for r in results:
        print("  %-4d %6.1fs %s %8.1f" % (r["k"], r["window"], " ".join("%14.1f" % r["cpu"].get(x, 0.0) for x in kinds),
                                          r["cpu"]["all"]))
    print("  load average (1, 5, 15 min) at the end of each wave: %s on %d CPUs" % (
        "; ".join("%.1f %.1f %.1f" % r["load"] for r in results), os.cpu_count() or 0))
    print("  goal: the LAST of K=16 within %.1fx of K=1: %s" % (GOAL, "MET" if ok else "MISSED (see the phases: "
                                                                   "what grows with K is this machine's CPU)"))
    return ok


def main() -> int:
    from tests.bench.bench_keeper import _need

    why = _need()
    if why:
        print("skipped: %s" % why)
        return 0
    from tests.hosts.sshd_box import build_pyz

    n, ks = _sizes()
    root = tempfile.mkdtemp(prefix="onbox-wave-")
    results = []
    try:
        pyz = build_pyz(os.path.join(root, "dist"))
        for k in ks:
            if k > n:
                print("skipped K=%d: more than the N=%d runs" % (k, n))
                continue
            t0 = time.monotonic()
            try:
                results.append(_wave(os.path.join(root, "k%d" % k), pyz, n, k))
            except (subprocess.CalledProcessError, RuntimeError) as e:
                print("skipped K=%d: cannot make %d network-namespace boxes here: %s" % (k, n + k, e))
                continue
            print("  (K=%d: %.0f s with setup)" % (k, time.monotonic() - t0), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not results:
        return 0
    return 0 if _report(results) else 1


if __name__ == "__main__":
    sys.exit(main())
