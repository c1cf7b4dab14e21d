"""Container jobs under a real agent with real processes: `onbox run --docker IMAGE` with a stand-in `docker` CLI
on PATH (tests/fakes/docker_cli.py: this machine has the docker CLI but no daemon) whose "container" is a process
in its own session, like a real one outside the client's process group.

- preemption (SIGTERM to the agent) -> TERM to the client -> proxied into the container -> the trainer saves and
  exits -> node commits the stop-step checkpoint -> exit 75; the container is gone and `docker stop` was asked;
  a relaunch resumes inside a new container from ONBOX_RESUME_FROM;
- a trainer that ignores TERM: at the deadline the agent KILLs the client, and `docker kill` the container (a
  client cannot proxy KILL; without it the container would run on).
The same lifecycle against a real Docker daemon: test_container_daemon.py. These stay: they record the exact CLI
calls the agent makes, which a daemon does not show."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env
from tests.polling import wait_for
from tests.processes import Started, pid_alive

pytestmark = pytest.mark.integration

TRAINER = os.path.join(REPO_ROOT, "tests", "integration", "container_trainer.py")
IMAGE = "trainer@sha256:" + "c0" * 32
SECRET = "hf_not_in_any_argv_0123"


@pytest.fixture
def fake_docker(tmp_path, onbox_home):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "docker"
    exe.write_text('#!/bin/sh\nexec "%s" "%s" "$@"\n' % (sys.executable,
                                                          os.path.join(REPO_ROOT, "tests", "fakes", "docker_cli.py")))
    exe.chmod(0o755)
    (onbox_home / "secrets").mkdir(mode=0o700)
    (onbox_home / "secrets" / "HF_TOKEN").write_text(SECRET + "\n")
    os.chmod(onbox_home / "secrets" / "HF_TOKEN", 0o600)
    env = subprocess_env({"ONBOX_HOME": str(onbox_home), "PATH": "%s:%s" % (bindir, os.environ["PATH"]),
                          "FAKE_DOCKER_STATE": str(tmp_path / "docker-state"),
                          "FAKE_DOCKER_LOG": str(tmp_path / "docker.log"), "ONBOX_TICK_INTERVAL": "0.05",
                          "ONBOX_SYNC_INTERVAL": "0.2", "ONBOX_SETTLE_SECONDS": "0.2",
                          "ONBOX_NOTICE_SOURCE": "none", "ONBOX_TERM_TIMEOUT": "2"})
    return env


def calls(tmp_path):
    try:
        with open(tmp_path / "docker.log") as f:
            return [json.loads(x)["argv"] for x in f if x.strip()]
    except FileNotFoundError:
        return []


def output(home, run):
    out = []
    try:
        with open(os.path.join(home, "runs", run, "output.log")) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def committed(durable, run):
    d = os.path.join(durable, run, "checkpoints")
    out = []
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if os.path.isfile(os.path.join(d, name, "MANIFEST.json")):
            with open(os.path.join(d, name, "MANIFEST.json")) as f:
                out.append(json.load(f).get("step"))
    return sorted(out)


def test_a_preempted_container_job_stops_inside_commits_exits_75_and_resumes(fake_docker, tmp_path, onbox_home):
    durable = str(tmp_path / "durable")
    ck = str(tmp_path / "ck")
    argv = [sys.executable, "-m", "onbox", "run", "--foreground", "--name", "c1", "--docker", IMAGE, "--ckpt-dir", ck,
            "--durable", durable, "--grace", "20", "--secret", "HF_TOKEN", "--restart", "never",
            "--", sys.executable, TRAINER, "--steps", "10"]
    with Started() as started:
        agent = started.popen(argv, env=fake_docker, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: any(x.get("step", -1) >= 2 for x in output(onbox_home, "c1")), 30, "the trainer to run")
        wait_for(lambda: committed(durable, "c1"), 20, "a commit")
        start = next(x for x in output(onbox_home, "c1") if x.get("event") == "start")
        assert pid_alive(start["pid"])
        agent.send_signal(signal.SIGTERM)  # the preemption
        _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 75, err.decode()[-2000:]
    assert not pid_alive(start["pid"])  # the trainer inside the container is gone
    stopped = [x for x in output(onbox_home, "c1") if x.get("event") == "stopped"]
    assert stopped and committed(durable, "c1")[-1] == stopped[0]["step"]  # TERM reached it; its save committed
    # what the container saw: the contract variables and the secret by name, never the agent's environment
    assert {"ONBOX_RESUME_FROM", "ONBOX_CKPT_DIR", "ONBOX_RUN", "HF_TOKEN"} <= set(start["env"])
    assert "FAKE_DOCKER_LOG" not in start["env"] and "ONBOX_HOME" not in start["env"]  # the agent's own settings
    assert start["hf_token_sha256"] == hashlib.sha256(SECRET.encode()).hexdigest()
    runs = [c for c in calls(tmp_path) if c[0] == "run"]
    assert len(runs) == 1 and all(SECRET not in a for a in runs[0])
    line = runs[0]
    assert line[:2] == ["run", "--rm"] and "--init" in line and line[line.index("--gpus") + 1] == "all"
    assert line[line.index("--name") + 1] == "onbox-c1-0"
    assert "%s:%s" % (tmp_path, tmp_path) in line and "%s:%s" % (ck, ck) not in line  # the workdir holds ck
    assert line[line.index(IMAGE) + 1:] == [sys.executable, TRAINER, "--steps", "10"]
    assert ["stop", "--time", "2", "onbox-c1-0"] in calls(tmp_path)  # the agent made sure the container is gone

    # the relaunch resumes in a new container from the committed step
    r = subprocess.run([sys.executable, "-m", "onbox", "run", "--foreground", "--name", "c1"], env=fake_docker,
                       cwd=str(tmp_path), capture_output=True, timeout=90)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    starts = [x for x in output(onbox_home, "c1") if x.get("event") == "start"]
    assert starts[-1]["start"] == stopped[0]["step"] + 1
    assert [c for c in calls(tmp_path) if c[0] == "run"][-1][4] == "onbox-c1-1"
    assert committed(durable, "c1")[-1] == 9


@pytest.mark.parametrize("mode", ["--docker", "own docker run"])
def test_a_container_that_ignores_term_is_killed_through_the_daemon_at_the_deadline(fake_docker, tmp_path,
                                                                                    onbox_home, mode):
    job = [sys.executable, TRAINER, "--steps", "400", "--ignore-term"]
    if mode == "--docker":
        how = ["--docker", IMAGE, "--", *job]
    else:  # the user's own line: the agent adds a cidfile and stops the container by its id
        how = ["--", "docker", "run", "--rm", "--init", "-e", "ONBOX_CKPT_DIR", IMAGE, *job]
    argv = [sys.executable, "-m", "onbox", "run", "--foreground", "--name", "c2", "--grace", "1.5", "--restart",
            "never", *how]
    with Started() as started:
        agent = started.popen(argv, env=dict(fake_docker, ONBOX_SYNC_RESERVE="0.3"), cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_for(lambda: any(x.get("step", -1) >= 1 for x in output(onbox_home, "c2")), 30, "the trainer to run")
        pid = next(x for x in output(onbox_home, "c2") if x.get("event") == "start")["pid"]
        agent.send_signal(signal.SIGTERM)
        _out, err = agent.communicate(timeout=60)
    assert agent.returncode == 75, err.decode()[-2000:]
    wait_for(lambda: not pid_alive(pid), 10, "the container's process to be gone")
    if mode == "--docker":
        ref = "onbox-c2-0"
    else:
        with open(os.path.join(onbox_home, "runs", "c2", "containers", "0.cid")) as f:
            ref = f.read().strip()
        assert next(c for c in calls(tmp_path) if c[0] == "run")[:3] == ["run", "--cidfile", f.name]
    assert ["kill", "--signal", "KILL", ref] in calls(tmp_path)

