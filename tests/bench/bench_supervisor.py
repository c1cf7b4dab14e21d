"""Supervisor benchmarks (issue 3).

1. Signal forwarding: SIGTERM to the agent -> the child's SIGTERM handler runs; p50/p99 over N trials (default
   200), beside the baseline of SIGTERM sent straight to the same kind of child. Target p99 <= 20 ms.
2. Idle overhead of a real detached agent (`python -m onbox run -- sleep`) for D seconds (default 60;
   ONBOX_BENCH_IDLE_SECONDS shortens it): its CPU seconds (as % of one core) and RSS, beside a bare `nohup sleep`. Targets <= 0.5 % of a core,
   <= 40 MB RSS.

Steady state: SIGTERM is sent once the attempt is recorded running and the agent's first beat is written (its start-up
is over); a shorter series sent the moment it is recorded running is printed beside it.
Each latency trial forks an agent from this process (no interpreter start per trial) running the real Supervisor loop.
Cloud metadata polling is off (notice_source=none): the bench must not touch the network.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Tuple

# The handler is a real Python handler; the main loop blocks in select() on the signal wakeup fd (a bare
# signal.pause() loses a signal that lands between the handler check and the pause() call).
CHILD = r"""
import os, select, signal, sys, time
out, ready = sys.argv[1], sys.argv[2]
fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
def on_term(signum, frame):
    os.write(fd, repr(time.monotonic()).encode())
    os._exit(0)
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
signal.signal(signal.SIGTERM, on_term)
open(ready, "w").close()
while True:
    select.select([r], [], [], 60)
"""


def _reap(pid: int, timeout: float = 15.0) -> None:
    """waitpid with a bound: a stuck agent is killed instead of hanging the benchmark."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _wait_file(path: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path) >= 0:
            return True
        time.sleep(0.0005)
    return False


def _wait_running(run_dir: str, timeout: float = 10.0, steady: bool = True) -> bool:
    """The agent has recorded the attempt as running; with `steady`, its start-up is over too: its first beat (the
    first tick, which loads the GPU readings) has been written, and 20 ms more."""
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(run_dir, "state.json")) as f:
                if json.load(f).get("state") == "running":
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.0005)
    else:
        return False
    if not steady:
        time.sleep(0.002)
        return True
    if not _wait_file(os.path.join(run_dir, "heartbeats", "seq.json"), max(0.0, deadline - time.monotonic())):
        return False
    time.sleep(0.02)
    return True


def _read_float(path: str, timeout: float = 10.0) -> Optional[float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read()
            if text:
                return float(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.0005)
    return None


def _fork_agent(home: str, name: str, command: List[str], tick: float = 0.5) -> int:
    """Fork a process that runs the real Supervisor on `command` in the foreground; returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            from onbox.config import RunConfig
            from onbox.subsystems import make_hooks
            from onbox.supervisor.loop import Supervisor, exit_code_for
            from onbox.supervisor.rundir import RunDir

            cfg = RunConfig(name=name, command=command, notice_source="none", tick_interval=tick, grace=5.0,
                            sync_reserve=0.0, term_timeout=1.0).validate()
            rd = RunDir(os.path.join(home, "runs", name))
            os.makedirs(rd.path, exist_ok=True)
            rd.write_config(cfg.to_dict())
            code = exit_code_for(Supervisor(cfg, rd, hooks_factory=make_hooks).run())
        finally:
            os._exit(code)
    return pid


def _percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def signal_latency(trials: int, tmp: str, steady: bool = True) -> Tuple[List[float], List[float]]:
    """SIGTERM to the agent -> the child's handler, and the baseline; `steady` False: sent the moment the agent
    recorded the attempt running (its first tick, the first beat, may be under way)."""
    via_agent, direct = [], []
    for i in range(trials):
        name = "lat%d%s" % (i, "" if steady else "s")
        out, ready = os.path.join(tmp, name + ".out"), os.path.join(tmp, name + ".ready")
        agent = _fork_agent(tmp, name, [sys.executable, "-S", "-c", CHILD, out, ready])
        if not _wait_file(ready) or not _wait_running(os.path.join(tmp, "runs", name), steady=steady):
            raise RuntimeError("the child of trial %d never got ready" % i)
        t0 = time.monotonic()
        os.kill(agent, signal.SIGTERM)
        t1 = _read_float(out)
        _reap(agent)
        if t1 is not None:
            via_agent.append((t1 - t0) * 1000.0)
        # baseline: the same child, signalled directly
        out2, ready2 = out + ".b", ready + ".b"
        p = subprocess.Popen([sys.executable, "-S", "-c", CHILD, out2, ready2])
        _wait_file(ready2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        t1 = _read_float(out2)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        if t1 is not None:
            direct.append((t1 - t0) * 1000.0)
    return via_agent, direct


def _cpu_rss(pid: int) -> Tuple[float, float]:
    """(utime+stime in seconds, RSS in MB) of a process from /proc."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    rss_kb = 0
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return cpu, rss_kb / 1024.0


def idle_overhead(seconds: float, tmp: str) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """The real detached agent (`python -m onbox run -- sleep`), as a user starts it, against a bare nohup sleep."""
    import json

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONBOX_")}
    env.update(ONBOX_HOME=tmp, ONBOX_NOTICE_SOURCE="none", PYTHONPATH=repo)
    out = subprocess.run([sys.executable, "-m", "onbox", "run", "--name", "idle", "--json", "--",
                          "sleep", str(seconds + 30)], env=env, capture_output=True, text=True, timeout=60, check=True)
    agent = int(json.loads(out.stdout)["agent_pid"])
    bare = subprocess.Popen(["nohup", "sleep", str(seconds + 30)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # let start-up settle: we measure the steady state
        a0, _ = _cpu_rss(agent)
        b0, _ = _cpu_rss(bare.pid)
        time.sleep(seconds)
        a1, a_rss = _cpu_rss(agent)
        b1, b_rss = _cpu_rss(bare.pid)
    finally:
        subprocess.run([sys.executable, "-m", "onbox", "stop", "idle", "--grace", "5"], env=env,
                       capture_output=True, timeout=60)
        bare.kill()
        bare.wait(timeout=10)
    return ((a1 - a0) / seconds * 100.0, a_rss), ((b1 - b0) / seconds * 100.0, b_rss)


def main() -> int:
    import onbox.supervisor.loop  # noqa: F401  imported once here, so each forked agent starts at once

    trials = int(os.environ.get("ONBOX_BENCH_TRIALS", "200"))
    seconds = float(os.environ.get("ONBOX_BENCH_IDLE_SECONDS", "60"))
    missed = 0
    with tempfile.TemporaryDirectory(prefix="onbox-bench-") as tmp:
        via, direct = signal_latency(trials, tmp)
        p50, p99 = _percentile(via, 50), _percentile(via, 99)
        print("signal forwarding, SIGTERM to agent -> child handler (%d trials): p50 %.2f ms  p99 %.2f ms  "
              "max %.2f ms   [target p99 <= 20 ms]" % (len(via), p50, p99, max(via)))
        print("  baseline, SIGTERM straight to the child:            p50 %.2f ms  p99 %.2f ms"
              % (_percentile(direct, 50), _percentile(direct, 99)))
        print("  mean over agent: %.2f ms" % (statistics.mean(via) - statistics.mean(direct)))
        early, _ = signal_latency(max(20, trials // 4), tmp, steady=False)
        print("  sent the moment the attempt is recorded running (its first tick may be under way), %d trials: "
              "p50 %.2f ms  p99 %.2f ms" % (len(early), _percentile(early, 50), _percentile(early, 99)))
        missed += p99 > 20.0
        (a_cpu, a_rss), (b_cpu, b_rss) = idle_overhead(seconds, tmp)
        print("idle overhead supervising sleep for %.0f s: agent %.3f %% of a core, RSS %.1f MB   "
              "[targets <= 0.5 %%, <= 40 MB]" % (seconds, a_cpu, a_rss))
        print("  baseline, bare nohup sleep:                 %.3f %% of a core, RSS %.1f MB" % (b_cpu, b_rss))
        missed += a_cpu > 0.5 or a_rss > 40.0
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
