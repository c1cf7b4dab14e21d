"""End to end on a real Slurm: `onbox sbatch` + the agent (supervisor + checkpoints) + the stand-in trainer.

Contracts used (onbox/supervisor/README.md, onbox/slurm/README.md): the run dir $ONBOX_HOME/runs/<run>/ (state.json, events.jsonl, output.log), exit 75 on
preemption, ONBOX_RESUME_FROM, the durable layout <durable>/<run>/checkpoints/<name>/MANIFEST.json. The run is
named after the job: slurm-<job id>.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env
from tests.polling import wait_for
from tests.processes import pid_alive

TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "slurm_trainer.py")
pytestmark = [pytest.mark.integration]


class Job:
    def __init__(self, cluster, tmp_path, job_id):
        self.cluster, self.tmp, self.id = cluster, tmp_path, job_id
        self.run = "slurm-%s" % job_id
        self.run_dir = os.path.join(str(tmp_path / "home"), "runs", self.run)
        self.durable = str(tmp_path / "durable")

    def output(self) -> str:
        return _read(os.path.join(self.run_dir, "output.log"))

    def slurm_out(self) -> str:
        return _read(str(self.tmp / "slurm.out"))

    def events(self):
        return [json.loads(line) for line in _read(os.path.join(self.run_dir, "events.jsonl")).splitlines()
                if line.strip()]

    def state(self):
        return json.loads(_read(os.path.join(self.run_dir, "state.json")) or "{}")

    def steps(self):
        return [int(m) for m in re.findall(r"^step (\d+)$", self.output(), re.M)]

    def manifests(self):
        out = []
        for p in glob.glob(os.path.join(self.durable, self.run, "checkpoints", "*", "MANIFEST.json")):
            with open(p) as f:
                out.append(json.load(f))
        return sorted(out, key=lambda m: m.get("step") or -1)

    def wait_output(self, pattern, timeout=30.0):
        return wait_for(lambda: re.search(pattern, self.output(), re.M), timeout,
                        "%r in the run's output:\n%s\n--- slurm output:\n%s" % (pattern, self.output()[-2000:],
                                                                               self.slurm_out()[-3000:]))


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""




def submit(cluster, tmp_path, trainer_args, sbatch_args=(), run_args=("--restart", "never"), extra_env=None):
    env = subprocess_env({"SLURM_CONF": cluster.conf, "ONBOX_HOME": str(tmp_path / "home"),
                          "ONBOX_SETTLE_SECONDS": "0.5", "ONBOX_SYNC_INTERVAL": "1", "ONBOX_HEARTBEAT_INTERVAL": "1",
                          # KillWait is 5 s here, shorter than the default 10 s sync reserve: the supervisor keeps
                          # half the grace for the trainer's save (the default reserve is left as users have it).
                          **(extra_env or {})})
    cp = subprocess.run([sys.executable, "-m", "onbox", "sbatch", "--json", "--agent", "%s -m onbox" % sys.executable,
                         "--output", str(tmp_path / "slurm.out"), *sbatch_args, "--durable", str(tmp_path / "durable"),
                         *run_args, "--", sys.executable, TRAINER, *trainer_args],
                        env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert cp.returncode == 0, cp.stderr
    return Job(cluster, tmp_path, json.loads(cp.stdout)["job_id"])


def assert_resumed_without_gap(job, committed_step):
    steps = job.steps()
    out = job.output()
    assert "SLURM_RESTART_COUNT=<absent>" in out and "SLURM_RESTART_COUNT=1" in out, out
    assert re.search(r"^resumed from step %d " % committed_step, out, re.M), out
    first_run = steps[:steps.index(committed_step) + 1]
    assert first_run == list(range(1, committed_step + 1)), steps
    rest = steps[len(first_run):]
    assert rest[:1] == [committed_step + 1], "resumed at %s, committed %d" % (rest[:1], committed_step)
    assert rest == list(range(committed_step + 1, committed_step + 1 + len(rest))), steps


@pytest.mark.slow
def test_usr1_commits_requeues_and_resumes_from_the_committed_step(slurm_cluster, tmp_path):
    # keep every checkpoint: with the default keep-last 3, the resumed attempt's commits retire the on-signal one
    job = submit(slurm_cluster, tmp_path, ["--steps", "30", "--interval", "0.1"],
                 run_args=("--restart", "never", "--keep-last", "100"))
    job.wait_output(r"^step 5$")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job.id])
    info = slurm_cluster.wait_job(job.id, ("COMPLETED",), timeout=60, restarts=1)
    assert info["Restarts"] == "1"
    manifests = job.manifests()
    assert manifests, "nothing committed to %s" % job.durable
    out = job.output()
    committed = int(re.search(r"^checkpoint signal: saved step (\d+), exiting$", out, re.M).group(1))
    assert committed in [m.get("step") for m in manifests]
    assert_resumed_without_gap(job, committed)
    assert job.steps()[-1] == 30 and job.state().get("state") == "done"
    kinds = [e.get("type") or e.get("event") for e in job.events()]
    assert "requeue" in kinds, kinds
    assert job.slurm_out().count("onbox: job %s run %s" % (job.id, job.run)) == 2


@pytest.mark.slow
def test_time_limit_with_signal_commits_requeues_and_resumes(slurm_cluster, tmp_path):
    """--time=1 with the signal 50 s before the end: Slurm sends USR1 within the first ~10 s."""
    job = submit(slurm_cluster, tmp_path, ["--steps", "100000", "--interval", "0.1"],
                 sbatch_args=("--time", "1", "--signal-lead", "50"),
                 run_args=("--restart", "never", "--keep-last", "100"))  # the on-signal checkpoint stays
    slurm_cluster.wait_job(job.id, ("RUNNING",), timeout=90, restarts=1)
    resumed = int(job.wait_output(r"^resumed from step (\d+) ", timeout=60).group(1))
    job.wait_output(r"^step %d$" % (resumed + 2))
    out = job.output()
    committed = int(re.search(r"^checkpoint signal: saved step (\d+), exiting$", out, re.M).group(1))
    assert resumed == committed
    assert committed in [m.get("step") for m in job.manifests()]
    assert_resumed_without_gap(job, committed)
    # A SIGTERM (scancel; the time limit itself looks the same) is not a reason to requeue, but what can be
    # committed within KillWait is committed.
    slurm_cluster.run(["scancel", job.id])
    slurm_cluster.wait_job(job.id, ("CANCELLED",), timeout=30)
    last = int(wait_for(lambda: re.findall(r"^checkpoint signal: saved step (\d+), exiting$", job.output(), re.M)[1:],
                        30, "the trainer's checkpoint on SIGTERM")[0])
    wait_for(lambda: last in [m.get("step") for m in job.manifests()], 30, "step %d committed" % last)
    assert re.search(r"not by the Slurm signal SIGUSR1.*not requeued", job.slurm_out()), job.slurm_out()
    assert slurm_cluster.job(job.id)["Restarts"] == "1"


@pytest.mark.slow
def test_the_job_end_time_is_the_run_deadline_it_stops_in_time_and_is_not_requeued_unless_asked(slurm_cluster,
                                                                                                  tmp_path):
    """A job with --time=1 and no --signal (Slurm may send its warning signal up to a minute early: here nothing
    but the deadline may stop the run) and no --deadline: the agent reads the job's EndTime (scontrol show job) as
    the run's deadline, asks for the checkpoint at EndTime - (grace 5 + commit + margin 5), before Slurm's time
    limit, commits, and exits 75 session_limit; with --no-requeue the job stays ended and the hint says to submit
    it again."""
    import time

    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nexec %s -m onbox run --foreground --restart never --no-requeue --grace 5 "
                      "--durable %s -- %s %s --steps 100000 --interval 0.1\n"
                      % (sys.executable, tmp_path / "durable", sys.executable, TRAINER))
    env = subprocess_env({"SLURM_CONF": slurm_cluster.conf, "ONBOX_HOME": str(tmp_path / "home"),
                          "ONBOX_SETTLE_SECONDS": "0.5", "ONBOX_SYNC_INTERVAL": "1", "ONBOX_DEADLINE_MARGIN": "5"})
    cp = subprocess.run(["sbatch", "--parsable", "--time", "1", "--output", str(tmp_path / "slurm.out"),
                         "--chdir", str(tmp_path), str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    job = Job(slurm_cluster, tmp_path, cp.stdout.strip().split(";")[0])
    info = slurm_cluster.wait_job(job.id, ("FAILED", "COMPLETED", "TIMEOUT", "CANCELLED"), timeout=150)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "75:0", (info, job.slurm_out()[-3000:])
    with open(os.path.join(job.run_dir, "config.json")) as f:
        cfg = json.load(f)
    start = time.mktime(time.strptime(info["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    assert cfg["deadline_source"] == "slurm" and cfg["deadline_at"] == start + 60.0
    st = job.state()
    assert st["state"] == "preempted" and st["last_exit"]["classification"] == "session_limit", st
    assert "submit the job again" in st["last_exit"]["hint"]
    notice = [e for e in job.events() if e.get("type") == "preemption_notice"]
    assert notice and notice[0]["source"] == "session_limit"
    assert notice[0]["time"] <= cfg["deadline_at"] - 10.0  # grace + margin before the end, at least
    committed = int(re.search(r"^checkpoint signal: saved step (\d+), exiting$", job.output(), re.M).group(1))
    assert committed in [m.get("step") for m in job.manifests()]
    assert info["Restarts"] == "0" and "requeue disabled" in job.slurm_out()


def test_a_crash_of_its_own_is_not_requeued_and_the_log_says_why(slurm_cluster, tmp_path):
    job = submit(slurm_cluster, tmp_path, ["--steps", "50", "--interval", "0.05", "--crash-at", "3"])
    info = slurm_cluster.wait_job(job.id, ("FAILED",), timeout=60)
    assert info["Restarts"] == "0" and info["ExitCode"] == "1:0"
    assert "the trainer's own bug" in job.output()
    assert re.search(r"not requeued", job.slurm_out()), job.slurm_out()
    assert job.state().get("state") == "failed"


def test_scancel_leaves_no_process_of_the_job_even_reparented_workers(slurm_cluster, tmp_path):
    pids_file = str(tmp_path / "workers.pids")
    job = submit(slurm_cluster, tmp_path, ["--steps", "100000", "--interval", "0.1", "--workers", "2"],
                 extra_env={"TRAINER_WORKER_PIDS": pids_file})
    job.wait_output(r"^workers started: ")
    workers = [int(x) for x in _read(pids_file).split()]
    trainer = int(re.search(r"^trainer pid (\d+)", job.output(), re.M).group(1))
    assert len(workers) == 2 and all(pid_alive(p) for p in workers)
    # Reparented away from the trainer: to the agent, which makes itself a child subreaper so that linuxproc (which
    # follows parent links) still sees them and the agent can kill the attempt's session; without a subreaper they
    # would go to init and escape `scancel`.
    for p in workers:
        with open("/proc/%d/stat" % p) as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) != trainer
    slurm_cluster.run(["scancel", job.id])
    slurm_cluster.wait_job(job.id, ("CANCELLED",), timeout=30)
    wait_for(lambda: not any(pid_alive(p) for p in [trainer, *workers]), 30,
             "every process of the job to be gone: %s" % [p for p in [trainer, *workers] if pid_alive(p)])
    info = slurm_cluster.job(job.id)
    assert info["Restarts"] == "0"  # a scancel is not a preemption: not requeued


@pytest.fixture(scope="module")
def built_pyz(tmp_path_factory):
    out = tmp_path_factory.mktemp("pyz")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "build", "zipapp.py"), "--out", str(out), "--cache",
                        os.path.join(REPO_ROOT, "build", "out")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return str(out / "onbox.pyz")


def test_the_pyz_submits_itself_as_the_agent(slurm_cluster, tmp_path, built_pyz):
    """`python3 onbox.pyz sbatch` (no --agent) writes `exec python3 <abs pyz> run --foreground`, and that runs."""
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}  # the pyz's own code, not the checkout
    env.update(SLURM_CONF=slurm_cluster.conf, ONBOX_HOME=str(tmp_path / "home"), SHIV_ROOT=str(tmp_path / "shiv"))
    cp = subprocess.run(["python3", built_pyz, "sbatch", "--json", "--output", str(tmp_path / "slurm.out"), "--",
                         sys.executable, TRAINER, "--steps", "3", "--interval", "0.01"],
                        env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert "\nexec python3 %s run --foreground --name " % built_pyz in doc["script"]
    job = Job(slurm_cluster, tmp_path, doc["job_id"])
    info = slurm_cluster.wait_job(job.id, ("COMPLETED", "FAILED"), timeout=60)
    assert info["JobState"] == "COMPLETED", job.slurm_out()
    assert job.steps() == [1, 2, 3] and job.state().get("state") == "done"


def test_heartbeats_carry_the_slurm_job(slurm_cluster, tmp_path):
    beats_file = str(tmp_path / "beats.jsonl")
    job = submit(slurm_cluster, tmp_path, ["--steps", "5", "--interval", "0.1"],
                 extra_env={"ONBOX_HEARTBEAT_FILE": beats_file, "ONBOX_HEARTBEAT_INTERVAL": "0.2"})
    slurm_cluster.wait_job(job.id, ("COMPLETED",), timeout=60)
    beats = [json.loads(line) for line in _read(beats_file).splitlines() if line.strip()]
    assert beats, "no heartbeat in %s" % beats_file
    assert all(b["run"] == job.run for b in beats)
    slurm = beats[-1]["slurm"]
    assert (slurm["job_id"], slurm["node_list"], slurm["restart_count"], slurm["array_task_id"]) == (
        job.id, slurm_cluster.host, 0, None)
