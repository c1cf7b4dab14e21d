"""Container jobs against a real Docker daemon: Debian's dockerd, private to the test session
(tests/hosts/docker.py), running a local image of Debian's Python (build/python_image.py; no registry), every
container with `--network none`. The agent runs the docker CLI first on PATH, as a user's box would.

- TERM reaches the trainer through `--init` (the trainer is not PID 1), the stop-step checkpoint is committed, the
  agent exits 75, and the relaunch resumes from it in a NEW container;
- a trainer that ignores TERM is killed through the daemon (`docker kill --signal KILL`) at the deadline, with
  `--docker IMAGE` and with the user's own `docker run` line (the agent's cidfile);
- a docker client that dies under its attempt leaves its container running: the agent's `docker stop` ends it as
  soon as it sees the client exit (one TERM, as the daemon's events show), with reap_orphans on or off;
- a relaunch after the agent and the client were both killed stops the container they left before it creates the
  next one (never two trainers on one checkpoint dir), with reap_orphans on or off;
- `--gpus` on a daemon without the NVIDIA runtime (this one): the run fails at once with the cause and the fix;
- GPU holders inside a container are attributed by their cgroup to the container, and by its cidfile to the run
  and attempt that started it; the (fake) NVML process list names the holder's host PID.
What the daemon saw is read back from it: `docker inspect`, `docker ps`, `docker events`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from onbox.gpu.holders import HolderScan
from onbox.gpu.nvml import NvmlSeam
from onbox.gpu.ownership import AttemptIndex, classify
from onbox.gpu.reaper import decide
from tests.conftest import REPO_ROOT, subprocess_env
from tests.fakes.nvml import FakeGpu, FakeNvml, FakeProcess
from tests.integration.test_container_job import committed, output
from tests.polling import wait_for
from tests.processes import Started, signal_own

pytestmark = pytest.mark.integration

TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "container_trainer.py")


@pytest.fixture
def job(tmp_path, onbox_home, docker_env):
    """The agent's environment and a workdir holding the trainer (mounted into the container at the same path)."""
    shutil.copy(TRAINER, tmp_path / "t.py")
    return subprocess_env({"ONBOX_HOME": str(onbox_home), "ONBOX_NOTICE_SOURCE": "none", "ONBOX_TICK_INTERVAL": "0.05",
                           "ONBOX_SYNC_INTERVAL": "0.2", "ONBOX_SETTLE_SECONDS": "0.2", "ONBOX_TERM_TIMEOUT": "2",
                           # no --gpus: the private daemon has no NVIDIA runtime (it would refuse the container)
                           "CUDA_VISIBLE_DEVICES": ""})


def docker_job(daemon, tmp_path, name, *trainer_args, extra=()):
    """`onbox run --foreground` of the test trainer in a container of the local image."""
    return [sys.executable, "-m", "onbox", "run", "--foreground", "--name", name, "--docker", daemon.image,
            "--docker-arg=--network=none", "--shm-size", "64m", "--workdir", str(tmp_path), "--restart", "never",
            *extra, "--", "python3", str(tmp_path / "t.py"), *trainer_args]


def cid_of(home, run, attempt):
    """The container id docker wrote into the attempt's cidfile."""
    path = os.path.join(str(home), "runs", run, "containers", "%d.cid" % attempt)
    with open(path) as f:
        return f.read().strip()


def started_line(home, run, attempt=-1):
    return [x for x in output(home, run) if x.get("event") == "start"][attempt]


def test_term_reaches_the_trainer_through_init_commits_exits_75_and_resumes_in_a_new_container(
        docker_daemon, job, tmp_path, onbox_home):
    durable, ck = str(tmp_path / "durable"), str(tmp_path / "ck")
    argv = docker_job(docker_daemon, tmp_path, "d1", "--steps", "10",
                      extra=["--ckpt-dir", ck, "--durable", durable, "--grace", "20"])
    with Started(onbox_home) as started:
        agent = started.popen(argv, env=job, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: any(x.get("step", -1) >= 2 for x in output(onbox_home, "d1")), 60, "the trainer to run")
        wait_for(lambda: committed(durable, "d1"), 20, "a commit")
        first = cid_of(onbox_home, "d1", 0)
        seen = docker_daemon.inspect(first)
        assert seen is not None and seen["State"]["Running"] and seen["Name"] == "/onbox-d1-0"
        assert seen["HostConfig"]["Init"] and seen["HostConfig"]["AutoRemove"]
        assert seen["HostConfig"]["NetworkMode"] == "none" and seen["HostConfig"]["ShmSize"] == 64 << 20
        assert seen["Config"]["Labels"] == {"onbox.run": "d1", "onbox.attempt": "0"}
        with open("/proc/%d/cmdline" % seen["State"]["Pid"], "rb") as f:  # the container's PID 1, seen from here
            assert os.path.basename(f.read().split(b"\0")[0]) == b"docker-init"
        assert started_line(onbox_home, "d1")["pid"] != 1  # the trainer is init's child, so TERM reaches it
        since = time.time() - 1
        agent.send_signal(signal.SIGTERM)  # the preemption
        _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 75, err.decode()[-2000:]
    stopped = [x for x in output(onbox_home, "d1") if x.get("event") == "stopped"]
    assert stopped, "TERM never reached the trainer's handler"
    assert committed(durable, "d1")[-1] == stopped[0]["step"]
    assert docker_daemon.containers("label=onbox.run=d1") == []  # exited and removed (--rm)
    died = [e for e in docker_daemon.events(since, first) if e.get("Action") == "die"]
    assert died and died[0]["Actor"]["Attributes"]["exitCode"] == "0"  # the trainer's own clean exit

    r = subprocess.run([sys.executable, "-m", "onbox", "run", "--foreground", "--name", "d1"], env=job,
                       cwd=str(tmp_path), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    second = cid_of(onbox_home, "d1", 1)
    assert second != first  # a new container
    assert started_line(onbox_home, "d1")["start"] == stopped[0]["step"] + 1  # from the committed checkpoint
    assert committed(durable, "d1")[-1] == 9
    assert docker_daemon.containers("label=onbox.run=d1") == []


@pytest.mark.parametrize("mode", ["--docker", "own docker run"])
def test_a_trainer_that_ignores_term_is_killed_through_the_daemon_at_the_deadline(docker_daemon, job, tmp_path,
                                                                                   onbox_home, mode):
    if mode == "--docker":
        argv = docker_job(docker_daemon, tmp_path, "d2", "--steps", "400", "--ignore-term", extra=["--grace", "1.5"])
    else:  # the user's own line: the agent adds a cidfile and kills the container by its id
        argv = [sys.executable, "-m", "onbox", "run", "--foreground", "--name", "d2", "--grace", "1.5", "--restart",
                "never", "--", "docker", "run", "--rm", "--init", "--network", "none", "-e", "ONBOX_CKPT_DIR",
                "-v", "%s:%s" % (tmp_path, tmp_path), docker_daemon.image, "python3", str(tmp_path / "t.py"),
                "--steps", "400", "--ignore-term"]
    with Started(onbox_home) as started:
        agent = started.popen(argv, env=dict(job, ONBOX_SYNC_RESERVE="0.3"), cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: any(x.get("step", -1) >= 1 for x in output(onbox_home, "d2")), 60, "the trainer to run")
        cid = cid_of(onbox_home, "d2", 0)
        assert docker_daemon.inspect(cid)["State"]["Running"]
        since = time.time() - 1
        agent.send_signal(signal.SIGTERM)
        _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 75, err.decode()[-2000:]
    assert not [x for x in output(onbox_home, "d2") if x.get("event") == "stopped"]  # it never reacted to TERM
    wait_for(lambda: not docker_daemon.containers("id=" + cid), 20, "the container to be removed")
    events = docker_daemon.events(since, cid)
    kills = [e["Actor"]["Attributes"].get("signal") for e in events if e.get("Action") == "kill"]
    assert "15" in kills and "9" in kills, events  # TERM proxied by the client, then KILL through the daemon
    died = [e for e in events if e.get("Action") == "die"]
    assert died and died[0]["Actor"]["Attributes"]["exitCode"] == "137"


@pytest.mark.parametrize("reap_orphans", ["true", "false"])
def test_a_container_whose_client_died_is_stopped_after_the_attempt(docker_daemon, job, tmp_path, onbox_home,
                                                                    reap_orphans):
    argv = docker_job(docker_daemon, tmp_path, "d3", "--steps", "400")
    with Started(onbox_home) as started:  # with reap_orphans off the agent leaves stray processes be, not containers
        agent = started.popen(argv, env=dict(job, ONBOX_REAP_ORPHANS=reap_orphans), cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: any(x.get("step", -1) >= 1 for x in output(onbox_home, "d3")), 60, "the trainer to run")
        cid = cid_of(onbox_home, "d3", 0)
        with open(os.path.join(str(onbox_home), "runs", "d3", "state.json")) as f:
            client = json.load(f)["attempts"][-1]
        since = time.time() - 1
        # the client dies (the OOM killer, a stray kill): a client cannot pass KILL on, its container runs on
        signal_own(onbox_home, client["pid"], signal.SIGKILL, client["start_time"])
        _out, err = agent.communicate(timeout=60)
    assert agent.returncode != 0, err.decode()[-2000:]
    assert docker_daemon.containers("label=onbox.run=d3", running_only=True) == []  # none left running
    actions = [(e.get("Action"), e["Actor"]["Attributes"].get("signal")) for e in docker_daemon.events(since, cid)]
    assert ("kill", "15") in actions and ("stop", None) in actions, actions  # `docker stop` ended it with TERM
    assert actions.count(("kill", "15")) == 1  # one TERM, through the container's init
    died = [e for e in docker_daemon.events(since, cid) if e.get("Action") == "die"]
    assert died[0]["Actor"]["Attributes"]["exitCode"] == "0"  # the trainer's TERM handler saved and ended it
    assert [x for x in output(onbox_home, "d3") if x.get("event") == "stopped"] == []  # its output went with the client


@pytest.mark.parametrize("reap_orphans", ["true", "false"])
def test_a_relaunch_stops_the_container_that_outlived_a_killed_agent_before_its_own_starts(
        docker_daemon, job, tmp_path, onbox_home, reap_orphans):
    env = dict(job, ONBOX_REAP_ORPHANS=reap_orphans)
    # restarts allowed: the relaunch first records how the killed client ended (its keeper kept it: signal 9), and
    # the restart policy then starts the next attempt, as the killed agent would have
    argv = docker_job(docker_daemon, tmp_path, "d5", "--steps", "400",
                      extra=["--ckpt-dir", str(tmp_path / "ck"), "--restart", "on-failure"])
    with Started(onbox_home) as started:
        agent = started.popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: any(x.get("step", -1) >= 1 for x in output(onbox_home, "d5")), 60, "the trainer to run")
        with open(os.path.join(str(onbox_home), "runs", "d5", "state.json")) as f:
            client = json.load(f)["attempts"][-1]
        agent.kill()  # the box's OOM killer takes the agent and the client; the daemon's container runs on
        agent.communicate(timeout=30)
        signal_own(onbox_home, client["pid"], signal.SIGKILL, client["start_time"])
        first = cid_of(onbox_home, "d5", 0)
        since = time.time() - 5
        assert docker_daemon.inspect(first)["State"]["Running"]
        again = started.popen([sys.executable, "-m", "onbox", "run", "--foreground", "--name", "d5"], env=env,
                              cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: started_line(onbox_home, "d5")["start"] > 0, 60, "the relaunched attempt to resume")
        again.send_signal(signal.SIGTERM)
        _out, err = again.communicate(timeout=60)
    assert again.returncode == 75, err.decode()[-2000:]
    old = {e["Action"]: e["timeNano"] for e in docker_daemon.events(since, first)}
    new = {e["Action"]: e["timeNano"] for e in docker_daemon.events(since, cid_of(onbox_home, "d5", 1))}
    assert "stop" in old and old["die"] < new["create"]  # never two trainers on one checkpoint dir
    assert docker_daemon.containers("label=onbox.run=d5") == []


def test_gpus_on_a_daemon_without_the_nvidia_runtime_fail_with_the_cause_and_the_fix(docker_daemon, job, tmp_path,
                                                                                      onbox_home):
    env = {k: v for k, v in job.items() if k != "CUDA_VISIBLE_DEVICES"}  # the default line: --gpus all (U31)
    # restarts allowed: a restart cannot give the container GPUs, so none is tried
    argv = docker_job(docker_daemon, tmp_path, "d6", "--steps", "3",
                      extra=["--restart", "on-failure", "--max-restarts", "5"])
    r = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    with open(os.path.join(str(onbox_home), "runs", "d6", "state.json")) as f:
        doc = json.load(f)
    last = doc["last_exit"]
    assert len(doc["attempts"]) == 1 and doc["message"].startswith("not restarting: docker cannot give"), doc
    assert (last["classification"], last["code"]) == ("no_gpu_runtime", 125), last  # docker's own error
    assert "NVIDIA Container Toolkit" in last["hint"] and "CUDA_VISIBLE_DEVICES=" in last["hint"]
    assert docker_daemon.containers("label=onbox.run=d6") == []  # created, never started, removed


def test_gpu_holders_in_a_container_belong_to_its_run_and_attempt(docker_daemon, job, tmp_path, onbox_home,
                                                                   gpu_devices):
    dev = os.path.dirname(gpu_devices)
    argv = docker_job(docker_daemon, tmp_path, "d4", "--steps", "400", "--hold", dev,
                      extra=["--docker-arg=--volume=%s:%s:ro" % (dev, dev), "--grace", "10"])
    with Started(onbox_home) as started:
        agent = started.popen(argv, env=job, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: any(x.get("step", -1) >= 1 for x in output(onbox_home, "d4")), 60, "the trainer to run")
        assert started_line(onbox_home, "d4")["held"] == 3
        cid = cid_of(onbox_home, "d4", 0)
        init = docker_daemon.inspect(cid)["State"]["Pid"]  # the container's init, as this PID namespace sees it
        with open("/proc/%d/task/%d/children" % (init, init)) as f:
            trainer = int(f.read().split()[0])  # its one child: the trainer, by its host PID
        nvml = FakeNvml([FakeGpu(minor=0, memory_used=3 << 30, processes=[FakeProcess(trainer, 3 << 30)]),
                         FakeGpu(minor=1)])
        scan = HolderScan(gpu_devices, seam=NvmlSeam(nvml)).scan()
        classify(scan, AttemptIndex.load(os.path.join(str(onbox_home), "runs")))
        agent.send_signal(signal.SIGTERM)
        _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 75, err.decode()[-2000:]
    held = [h for h in scan.holders if h.container == cid]
    assert [h.pid for h in held] == [trainer]  # by its cgroup (/docker/<id>): the trainer, not docker-init
    h = held[0]
    assert h.other_pid_ns and h.ns_pids == [trainer, started_line(onbox_home, "d4")["pid"]]
    assert (h.owner, h.run, h.attempt) == ("current", "d4", 0)  # the cidfile of attempt 0 names the container
    assert h.gpus == [0] and h.nvml_visible is True and h.gpu_memory_bytes == 3 << 30
    d = decide(h, min_age_s=0, all_users=True, is_root=True, my_uid=os.geteuid())
    assert d.verdict == "keep" and "current attempt 0 of run d4" in d.reason
