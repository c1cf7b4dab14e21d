"""Real hangs under `onbox run`, healed: `torchrun --nproc_per_node 2` with gloo and an all_reduce every step, rank
1 SIGSTOPped (rank 0 then blocks in the collective, as an NCCL hang does on GPUs); a DataLoader worker SIGSTOPped.
Each is detected by the trainer's own cadence, the stacks of every process of the attempt are saved (the hung frame
`all_reduce` in them: by py-spy, or without it by the faulthandler the trainer opted into, the stopped rank by
/proc), the attempt is stopped and restarted, and training resumes at the newest durable step. And healthy
trainers are never judged hung: a checkpoint save longer than the bound while it writes, an eval that is silent for
many step times after it says `eval`.

The test signals only processes it started: the agent's descendants, found by pid AND start time, SIGCONTed at the
end. Detection and time to the next step are read from the agent's own events and the trainer's lines (printed by
`-s`: `python -m pytest -s tests/integration/test_hang_real.py`)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import pytest

from tests.checkpoint_files import committed_steps
from tests.conftest import REPO_ROOT
from tests.integration.supervisor_helpers import events, onbox, state
from tests.polling import wait_for
from tests.processes import kill_exact, pid_alive, start_ticks

pytestmark = [pytest.mark.integration, pytest.mark.slow]
torch = pytest.importorskip("torch")

TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "hang_trainer.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
# 0.2 s steps: the learned bound is max(10 x 0.2 s, 2 s) = 2 s; a save or an eval runs longer than that.
HANG = {"ONBOX_HANG_FACTOR": "10", "ONBOX_HANG_FLOOR": "2", "ONBOX_HANG_STARTUP": "60", "ONBOX_SYNC_INTERVAL": "0.2",
        "ONBOX_SETTLE_SECONDS": "0.3", "ONBOX_TERM_TIMEOUT": "2", "ONBOX_HEARTBEAT_INTERVAL": "1"}


def lines(home: Any, run: str) -> List[Dict[str, Any]]:
    out = []
    try:
        with open(os.path.join(str(home), "runs", run, "output.log")) as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def children(pid: int) -> List[int]:
    out: List[int] = []
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return out
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid)) as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> List[int]:
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def env_of(pid: int) -> Dict[str, str]:
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    return dict(x.decode(errors="replace").partition("=")[::2] for x in raw.split(b"\0") if b"=" in x)


class Stopped:
    """Processes this test SIGSTOPped (pid, start time): SIGCONTed at the end, whatever happened."""

    def __init__(self) -> None:
        self.refs: List[Tuple[int, int]] = []

    def stop(self, pid: int) -> Tuple[int, int]:
        start = start_ticks(pid)
        assert start is not None and kill_exact(pid, start, signal.SIGSTOP)
        self.refs.append((pid, start))
        return pid, start

    def release(self) -> None:
        for pid, start in self.refs:
            kill_exact(pid, start, signal.SIGCONT)


@pytest.fixture
def stopped(cleanup):
    s = Stopped()
    yield s
    s.release()


def attempt_child(home: Any, run: str, attempt: int) -> Tuple[int, int]:
    """The agent's child of `attempt` (pid, start time), as state.json records it."""
    rec = wait_for(lambda: next((a for a in state(home, run).get("attempts") or []
                                 if a.get("n") == attempt and a.get("pid")), None), 60, "attempt %d" % attempt)
    assert start_ticks(rec["pid"]) == rec["start_time"]
    return rec["pid"], rec["start_time"]


def launch(home: Any, run: str, argv: List[str], *opts: str, env: Optional[Dict[str, str]] = None) -> None:
    r = onbox(home, "run", "--name", run, "--workdir", REPO_ROOT, *opts, "--", *argv, timeout=120,
              env_extra=dict(HANG, **(env or {})))
    assert r.returncode == 0, r.stdout + r.stderr


def first_step_of(home: Any, run: str, attempt: int) -> Dict[str, Any]:
    return wait_for(lambda: next((x for x in lines(home, run) if x.get("attempt") == attempt and "step" in x), None),
                    120, "attempt %d's first step" % attempt)


def gloo_hang(home: Any, run: str, durable: str, stopped: Stopped, env: Optional[Dict[str, str]] = None,
              faulthandler: bool = False) -> Dict[str, Any]:
    """torchrun, 2 ranks; rank 1 SIGSTOPped once a checkpoint is durable; returns the hang_detected event and what
    the test saw (the stopped rank, the times)."""
    argv = [TORCHRUN, "--nproc-per-node=2", TRAINER, "--sleep", "0.2", "--save-every", "5"]
    launch(home, run, argv + (["--faulthandler"] if faulthandler else []), "--durable", durable, env=env)
    wait_for(lambda: committed_steps(durable, run) and any(x.get("step", -1) >= 12 for x in lines(home, run)), 120,
             "steps and a durable checkpoint")
    child, _ = attempt_child(home, run, 0)
    rank1 = wait_for(lambda: next((p for p in descendants(child) if env_of(p).get("RANK") == "1"
                                   and env_of(p).get("LOCAL_RANK") == "1"), None), 30, "rank 1 among the agent's descendants")
    stopped_at = time.time()
    ref = stopped.stop(rank1)
    hang = wait_for(lambda: next(iter(e for e in events(home, run) if e["type"] == "hang_detected"), None), 60,
                    "hang_detected")
    return {"hang": hang, "rank1": ref, "stopped_at": stopped_at}


def stacks_of(hang: Dict[str, Any]) -> str:
    with open(hang["stacks"]) as f:
        return f.read()


def test_a_gloo_collective_hang_is_detected_its_stacks_kept_and_the_run_resumes_at_the_newest_durable_step(
        onbox_home, tmp_path, stopped):
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH") or os.defpath])
    if shutil.which("py-spy", path=path) is None:
        pytest.skip("py-spy is not installed (the dev dependencies install it: pip install py-spy==0.4.2)")
    run, durable = "gloo", str(tmp_path / "durable")
    seen = gloo_hang(onbox_home, run, durable, stopped, env={"PATH": path})  # the venv's py-spy on the agent's PATH
    hang = seen["hang"]
    # detected by the cadence: past the 2 s bound onbox/supervisor/README.md ("Hung trainers") states, within a loop step and a look at the dir
    assert hang["phase"] == "train" and "median step interval" in hang["rule"]
    assert abs(hang["bound_s"] - max(2.0, 10 * hang["typical_step_s"])) < 0.01 and hang["bound_s"] < 3.0
    assert hang["bound_s"] <= hang["quiet_s"] <= hang["bound_s"] + 1.0
    text = stacks_of(hang)
    by_pid = {p["pid"]: p for p in hang["processes"]}
    assert by_pid[seen["rank1"][0]]["state"].startswith("T")  # the stopped rank, read by py-spy --nonblocking
    assert "all_reduce" in text and "py-spy" in text  # the blocked rank's frame
    assert any("all_reduce" in (p["top"] or "") for p in hang["processes"])
    assert len(hang["processes"]) >= 3  # torchrun and both workers, not only the launcher
    # then the attempt is stopped (every rank, the stopped one too) and restarted from the newest durable checkpoint
    exit0 = wait_for(lambda: (state(onbox_home, run).get("attempts") or [{}])[0].get("exit"), 60, "attempt 0's exit")
    assert exit0["classification"] == "hung"
    wait_for(lambda: not pid_alive(seen["rank1"][0]) or start_ticks(seen["rank1"][0]) != seen["rank1"][1], 30,
             "the stopped rank to be gone")
    first = first_step_of(onbox_home, run, 1)
    start = next(x for x in lines(onbox_home, run) if x.get("event") == "start" and x.get("attempt") == 1
                 and x.get("rank") == 0)
    resumed = int(os.path.basename(start["resume"])[len("step_"):-len(".pt")])
    assert resumed in committed_steps(durable, run) and first["step"] == start["start"] == resumed + 1
    assert resumed >= hang["step"] - 5  # the newest one: saved every 5 steps
    back = wait_for(lambda: next(iter(e for e in events(onbox_home, run) if e["type"] == "hang_recovered"), None),
                    30, "hang_recovered")
    # the stacks are with the logs on durable storage, and the warning said everywhere
    copies = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(durable, run, "logs")) for f in fs
              if f == "hang-stacks.0.txt"]
    assert copies
    status = json.loads(onbox(onbox_home, "status", run, "--json").stdout)
    assert [w["code"] for w in status["warnings"]] == ["hang"]
    print("\ngloo hang: detected %.2f s after SIGSTOP (quiet %.2f s, bound %.1f s); first new step %.2f s after "
          "SIGSTOP, %.2f s after the detection; resumed at step %d (durable %d)" % (
              hang["time"] - seen["stopped_at"], hang["quiet_s"], hang["bound_s"], first["t"] - seen["stopped_at"],
              back["after_s"], first["step"], resumed))
    onbox(onbox_home, "stop", run, "--grace", "2")


def test_without_py_spy_the_opted_in_faulthandler_and_proc_give_the_stacks(onbox_home, tmp_path, stopped):
    path = "/usr/sbin:/usr/bin:/sbin:/bin"
    if shutil.which("py-spy", path=path):
        pytest.skip("py-spy is installed system-wide: the fallback cannot be shown here")
    run = "nospy"
    seen = gloo_hang(onbox_home, run, str(tmp_path / "durable"), stopped, env={"PATH": path}, faulthandler=True)
    hang = seen["hang"]
    text = stacks_of(hang)
    methods = {p["pid"]: p["method"] for p in hang["processes"]}
    assert "faulthandler" in methods.values() and "py-spy" not in methods.values()
    assert "all_reduce" in text  # rank 0's own dump: the frame it waits in
    rank1 = next(p for p in hang["processes"] if p["pid"] == seen["rank1"][0])
    assert rank1["state"].startswith("T") and rank1["method"] == "none"  # stopped: never signalled, /proc only
    assert "the process is stopped (state T)" in text and "py-spy is not on the agent's PATH" in text
    assert "not opted in" in text  # torchrun itself never registered: it got no signal
    onbox(onbox_home, "stop", run, "--grace", "2")


def test_a_stopped_dataloader_worker_is_a_hang_too(onbox_home, tmp_path, stopped):
    run = "loader"
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH") or os.defpath])  # its py-spy
    beats = str(tmp_path / "beats.jsonl")
    launch(onbox_home, run, [sys.executable, TRAINER, "--workers", "1", "--sleep", "0.2"], "--on-hang", "stop",
           "--heartbeat-file", beats, env={"PATH": path})
    wait_for(lambda: any(x.get("step", -1) >= 12 for x in lines(onbox_home, run)), 120, "steps")
    child, _ = attempt_child(onbox_home, run, 0)
    worker = wait_for(lambda: next(iter(children(child)), None), 30, "the DataLoader worker")
    stopped.stop(worker)
    hang = wait_for(lambda: next(iter(e for e in events(onbox_home, run) if e["type"] == "hang_detected"), None), 60,
                    "hang_detected")
    assert hang["phase"] == "train" and {p["pid"] for p in hang["processes"]} >= {child, worker}
    if shutil.which("py-spy", path=path):
        main = next(p for p in hang["processes"] if p["pid"] == child)
        assert main["method"] == "py-spy" and "_next_data" in stacks_of(hang)  # the main process waits for a batch
    st = wait_for(lambda: state(onbox_home, run).get("state") in ("failed",) and state(onbox_home, run), 60,
                  "the run to end")
    assert st["last_exit"]["classification"] == "hung"
    wait_for(lambda: not pid_alive(worker), 30, "the stopped worker to be gone")
    # said everywhere: onbox status (text and --json), training_status.md's next line, the beats' alerts
    text = onbox(onbox_home, "status", run).stdout
    assert "WARNING: attempt 0 hung at step" in text and hang["stacks"] in text
    assert [w["code"] for w in json.loads(onbox(onbox_home, "status", run, "--json").stdout)["warnings"]] == ["hang"]
    with open(os.path.join(str(onbox_home), "runs", run, "training_status.md")) as f:
        assert "- next: fix the hang (read the stacks in %s)" % hang["stacks"] in f.read()
    with open(beats) as f:
        alerts = [a for line in f for a in json.loads(line)["alerts"] if a["code"] == "hang"]
    assert alerts and alerts[-1]["data"]["stacks"] == hang["stacks"] and alerts[-1]["data"]["action"] == "stop"


def test_a_slow_checkpoint_save_and_a_long_silent_eval_are_no_hang(onbox_home, tmp_path, cleanup):
    # bound 2 s; every 10th step a save writing for 5 s, every 15th an eval silent for 4 s (20 step times)
    run = "healthy"
    launch(onbox_home, run, [sys.executable, TRAINER, "--steps", "46", "--sleep", "0.2", "--save-every", "10",
                             "--save-seconds", "5", "--eval-every", "15", "--eval-seconds", "4"])
    st = wait_for(lambda: state(onbox_home, run).get("state") in ("done", "failed") and state(onbox_home, run), 240,
                  "the run to end")
    assert st["state"] == "done" and st["restarts"] == 0
    assert [e for e in events(onbox_home, run) if e["type"].startswith("hang")] == []
    assert sum(1 for x in lines(onbox_home, run) if "eval_loss" in x) == 3
