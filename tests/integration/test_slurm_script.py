"""The generated sbatch script on a real Slurm, with a probe in the agent's place (no supervisor needed): the
agent is exec'd, receives `scancel --signal=USR1 --batch`, requeues through onbox.slurm.job.requeue, and the job comes
back with SLURM_RESTART_COUNT=1 under the same run name, its log appended, not truncated."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env
from tests.polling import wait_for

PROBE = os.path.join(REPO_ROOT, "tests", "integration", "slurm_probe_agent.py")
pytestmark = pytest.mark.integration


def read_events(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]




@pytest.mark.slow
def test_script_execs_agent_which_gets_the_signal_requeues_and_comes_back(slurm_cluster, tmp_path):
    log = str(tmp_path / "probe.jsonl")
    env = subprocess_env({"SLURM_CONF": slurm_cluster.conf, "PROBE_LOG": log, "PROBE_REPO": REPO_ROOT})
    out = str(tmp_path / "job.out")
    cp = subprocess.run([sys.executable, "-m", "onbox", "sbatch", "--json", "--agent", "%s %s" % (sys.executable, PROBE),
                         "--output", out, "--name", "probe", "--durable", str(tmp_path / "durable"),
                         "--restart", "never", "--", "python", "train.py", "two words"],
                        env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert cp.returncode == 0, cp.stderr
    job_id = json.loads(cp.stdout)["job_id"]
    assert job_id.isdigit()

    first = wait_for(lambda: [e for e in read_events(log) if e["event"] == "start"], 30, "the probe to start")[0]
    assert first["parent"] == "slurmstepd", "the agent must be exec'd: its parent is %s" % first["parent"]
    assert first["argv"] == ["run", "--foreground", "--name", "probe", "--durable", str(tmp_path / "durable"),
                             "--restart", "never", "--", "python", "train.py", "two words"]
    assert first["restart_env"] is None  # absent on the first run, not 0
    assert first["slurm"]["job_id"] == job_id and first["slurm"]["restart_count"] == 0
    assert first["onbox_env"]["ONBOX_PREEMPT_SIGNAL"] == "USR1" and first["onbox_env"]["ONBOX_REQUEUE"] == "1"

    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    info = slurm_cluster.wait_job(job_id, ("COMPLETED",), timeout=60, restarts=1)
    assert info["Restarts"] == "1" and info["ExitCode"] == "0:0"

    events = read_events(log)
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "signal", "requeued", "start"], kinds
    assert events[1]["signum"] == 10 and events[1]["pid"] == first["pid"]
    second = events[3]
    assert second["restart_env"] == "1" and second["slurm"]["restart_count"] == 1
    assert second["argv"] == first["argv"]  # the same run name: the requeue continues the same run
    with open(out) as f:
        banner = [line for line in f if line.startswith("onbox: job ")]
    assert banner == ["onbox: job %s run probe restart 0 on %s\n" % (job_id, slurm_cluster.host),
                      "onbox: job %s run probe restart 1 on %s\n" % (job_id, slurm_cluster.host)], banner


def submit(slurm_cluster, tmp_path, args, mode, sbatch_extra=()):
    log = str(tmp_path / "probe.jsonl")
    env = subprocess_env({"SLURM_CONF": slurm_cluster.conf, "PROBE_LOG": log, "PROBE_REPO": REPO_ROOT,
                          "PROBE_MODE": mode})
    cp = subprocess.run([sys.executable, "-m", "onbox", "sbatch", "--print", "--agent",
                         "%s %s" % (sys.executable, PROBE), "--output", str(tmp_path / "job-%A_%a.out"), *args],
                        env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert cp.returncode == 0, cp.stderr
    script = tmp_path / "job.sh"
    script.write_text(cp.stdout)
    sub = subprocess.run(["sbatch", "--parsable", *sbatch_extra, str(script)], env=env, capture_output=True,
                         text=True, timeout=60, cwd=str(tmp_path))
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0], log


def test_array_tasks_are_each_their_own_run(slurm_cluster, tmp_path):
    array_id, log = submit(slurm_cluster, tmp_path, ["--array", "0-1", "--", "true"], "exit-at-start")
    for task in ("0", "1"):
        slurm_cluster.wait_job("%s_%s" % (array_id, task), ("COMPLETED",), timeout=60)
    starts = sorted((e["slurm"]["array_task_id"], e["argv"][3]) for e in read_events(log) if e["event"] == "start")
    assert starts == [("0", "slurm-%s_0" % array_id), ("1", "slurm-%s_1" % array_id)]


def test_multinode_script_runs_one_agent_per_node_under_srun_and_forwards_the_signal(slurm_cluster, tmp_path):
    """The --nodes>1 script, squeezed onto this one node (`sbatch --nodes=1` overrides the #SBATCH line): srun
    starts the agent as a step task and forwards the batch signal to it; node 0 keeps the run name and requeue."""
    job_id, log = submit(slurm_cluster, tmp_path, ["--nodes", "2", "--signal", "USR2", "--", "true"],
                         "exit-on-signal", sbatch_extra=("--nodes=1",))
    first = wait_for(lambda: [e for e in read_events(log) if e["event"] == "start"], 30, "the probe to start")[0]
    assert first["parent"] == "slurmstepd"
    assert first["argv"][3] == "slurm-%s" % job_id
    assert first["slurm"]["is_primary"] is True
    assert first["onbox_env"]["ONBOX_REQUEUE"] == "1" and first["onbox_env"]["ONBOX_PREEMPT_SIGNAL"] == "USR2"
    assert first["master"] == slurm_cluster.host  # torchrun's rendezvous host: the first node of the allocation
    slurm_cluster.run(["scancel", "--signal=USR2", "--batch", job_id])
    wait_for(lambda: [e for e in read_events(log) if e["event"] == "signal"], 30, "the signal to reach the agent")
    info = slurm_cluster.wait_job(job_id, ("COMPLETED",), timeout=60)
    assert info["Restarts"] == "0"
