"""Container jobs: the `docker run` line `--docker IMAGE` builds (golden), what a user's own `docker run` may be,
and how the GPU holder scan and the reaper see a container's processes (by cgroup, owned through the cidfile)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from onbox.config import RunConfig
from onbox.errors import UsageError
from onbox.gpu.holders import Holder, container_id
from onbox.gpu.ownership import AttemptIndex, classify
from onbox.gpu.reaper import decide
from onbox.launch import container as ct
from onbox.supervisor.childenv import child_env
from tests.golden import check_golden

AGENT_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "HF_HOME": "/cache/hf", "LANG": "C.UTF-8"}
CID = "5e" * 32


def _line(argv):
    return "".join(a + "\n" for a in argv)


def test_the_docker_run_line_mounts_passes_names_only_and_picks_gpus():
    cfg = RunConfig(name="gpt", command=["python", "train.py"], docker_image="pytorch/pytorch@sha256:" + "ab" * 32,
                    durable="/mnt/durable", workdir="/work/code", ckpt_dir="/work/out",
                    docker_args=["-v", "/data:/data"], env={"WANDB_PROJECT": "x"}).validate()
    env = child_env(AGENT_ENV, "gpt", "/work/out", "/work/out/ckpt.pt", 2, "/root/.onbox/runs/gpt/metrics.jsonl",
                    "/root/.onbox/runs/gpt/PREEMPTED", {**cfg.env, "HF_TOKEN": "hf_secret_value"}, 4.0)
    argv = ct.docker_argv(cfg, ["python", "train.py", "--init_from=resume"], env, AGENT_ENV, "gpt",
                          "/root/.onbox/runs/gpt", "/work/out", 2)
    assert "hf_secret_value" not in " ".join(argv) and "-e" in argv and "HF_TOKEN" in argv  # U34: names only
    assert "HF_HOME" not in argv and "PATH" not in argv  # the agent's own environment stays outside
    text = "# --docker, all GPUs (U31), a mounted durable dir, a --docker-arg\n" + _line(argv)
    cfg2 = RunConfig(name="big.node1", command=["torchrun", "train.py"], docker_image="img:1", durable="r2:bucket",
                     workdir="/w", node_group="/root/.onbox/nodes/big.node1.json", docker_shm_size="32g").validate()
    env2 = child_env(dict(AGENT_ENV, CUDA_VISIBLE_DEVICES="0,2"), "big.node1", "/root/.onbox/runs/big.node1/checkpoints",
                     None, 0, "/m", "/p", {"MASTER_ADDR": "10.0.0.2", "NODE_RANK": "1"})
    argv2 = ct.docker_argv(cfg2, ["torchrun", "train.py"], env2, dict(AGENT_ENV, CUDA_VISIBLE_DEVICES="0,2"),
                           "big.node1", "/root/.onbox/runs/big.node1", "/root/.onbox/runs/big.node1/checkpoints", 0)
    text += "# a node of a multi-node group, two GPUs by CUDA_VISIBLE_DEVICES, an rclone durable (not mounted)\n"
    check_golden("container/docker_run.txt", text + _line(argv2))
    assert argv2[argv2.index("--gpus") + 1] == '"device=0,2"' and "CUDA_VISIBLE_DEVICES" not in argv2
    assert ct.gpu_option({"CUDA_VISIBLE_DEVICES": ""}) == [] and ct.gpu_option({}) == ["--gpus", "all"]


def test_a_users_own_docker_run_gets_a_cidfile_and_must_stay_attached():
    line = ["docker", "run", "--rm", "-v", "/d:/d", "--name", "t", "img", "python", "x.py", "-d"]
    assert ct.split_run_options(line[2:]) == 5 and ct.is_client_command(line)
    assert ct.client_argv(line, "/r/containers/0.cid") == ["docker", "run", "--cidfile", "/r/containers/0.cid",
                                                            *line[2:]]
    ct.check_client_command(line)  # `-d` after the image belongs to the command, not to docker
    named = ["docker", "run", "--cidfile=/x.cid", "img"]
    assert ct.client_argv(named, "/r/c.cid") == named
    for bad in (["docker", "run", "-d", "img"], ["docker", "run", "-itd", "img"], ["docker", "run", "--detach", "img"]):
        with pytest.raises(UsageError, match="detaches"):
            ct.check_client_command(bad)
    assert ct.split_run_options(["-it", "-e", "A", "--gpus=all", "img", "cmd"]) == 4
    assert ct.container_name("a/b c", 3) == "onbox-a-b-c-3"
    assert not ct.is_client_command(["python", "docker", "run"])


def test_docker_options_are_checked_with_the_run():
    with pytest.raises(UsageError, match="image name"):
        RunConfig(docker_image="-v=/:/host").validate()
    with pytest.raises(UsageError, match="shm-size"):
        RunConfig(docker_image="img", docker_shm_size="lots").validate()


@pytest.mark.parametrize("text, want", [
    ("0::/system.slice/docker-%s.scope\n" % CID, CID),
    ("12:memory:/docker/%s\n11:cpu:/docker/%s\n" % (CID, CID), CID),
    ("0::/kubepods/burstable/pod1234/cri-containerd-%s.scope\n" % CID, CID),
    ("0::/user.slice/libpod-%s.scope/container\n" % CID, CID),
    ("0::/\n", None),
    ("0::/user.slice/user-0.slice/session-4.scope\n", None),
])
def test_the_container_of_a_process_comes_from_its_cgroup(text, want):
    assert container_id(text) == want


def _holder(**kw):
    base = dict(pid=900, ppid=1, uid=0, user="root", command="python train.py", state="S", age_s=600.0,
                start_time=1000.0, start_ticks=5000, sid=1, pgid=1, devices=["/dev/nvidia0"], gpus=[0],
                other_pid_ns=True, ns_pids=[900, 1], container=CID)
    base.update(kw)
    return Holder(**base)


def test_a_containers_holders_belong_to_the_attempt_that_started_it(tmp_path):
    run = tmp_path / "runs" / "img"
    (run / "containers").mkdir(parents=True)
    (run / "containers" / "0.cid").write_text(CID)
    (run / "containers" / "1.cid").write_text("6f" * 32)
    (run / "state.json").write_text(json.dumps({
        "run": "img", "state": "running", "current_sid": 4000,
        "attempts": [{"n": 0, "pid": 3000, "sid": 3000, "start_time": 100, "started_at": 900.0, "ended_at": 950.0},
                     {"n": 1, "pid": os.getpid(), "sid": 4000, "start_time": None, "started_at": 960.0}]}))
    index = AttemptIndex.load(str(tmp_path / "runs"))
    assert index.by_container[CID].n == 0

    class Scan:
        holders = [_holder(), _holder(pid=901, container="6f" * 32), _holder(pid=902, container="7a" * 32)]

    classify(Scan, index, my_pid=1)  # type: ignore[arg-type]
    old, live, foreign = Scan.holders
    assert (old.owner, old.run, old.attempt) == ("earlier", "img", 0)  # the container outlived attempt 0
    assert (live.owner, live.attempt) == ("current", 1)
    assert foreign.owner == "foreign"
    kw = dict(min_age_s=60, all_users=False, is_root=True, my_uid=0)
    d = decide(old, **kw)
    assert d.verdict == "reap" and "container %s" % CID[:12] in d.reason
    assert decide(live, **kw).verdict == "keep"
    d = decide(foreign, **kw)
    assert d.verdict == "keep" and "container %s" % ("7a" * 6) in d.reason


class _Inner:
    """The plain process seam under a ContainerSeam, scripted: poll answers `exits` in turn; calls are recorded."""

    def __init__(self, calls, exits):
        self.calls, self.exits = calls, list(exits)

    def spawn(self, argv, env, cwd, log_path):
        self.calls.append(("spawn", argv[:2]))
        return "child"

    def poll(self, child):
        return self.exits.pop(0)

    def kill_session(self, sid, timeout, **kw):
        self.calls.append(("kill_session", sid))
        return "stopped"


def _seam(tmp_path, exits, rcs):
    calls = []
    answers = list(rcs)

    def runner(argv, **kw):
        calls.append(("docker", argv[1:]))
        rc = answers.pop(0)
        return subprocess.CompletedProcess(argv, rc, "", "" if rc == 0 else "Error response from daemon: busy")

    cfg = RunConfig(name="img", command=["python", "t.py"], docker_image="img:1", term_timeout=3).validate()
    seam = ct.ContainerSeam(_Inner(calls, exits), cfg, "img", str(tmp_path), str(tmp_path / "ck"), AGENT_ENV,
                            runner=runner)
    seam.spawn(["python", "t.py"], {"ONBOX_RESTART_COUNT": "1"}, None, str(tmp_path / "out.log"))
    return seam, calls


def test_the_container_is_stopped_when_its_clients_exit_is_seen_once_and_before_the_host_side_sweep(tmp_path):
    seam, calls = _seam(tmp_path, [None, "exit 137"], rcs=[0])
    assert seam.poll("child") is None and calls == [("spawn", ["docker", "run"])]
    assert seam.poll("child") == "exit 137"  # the client died: its container must not train on unsupervised
    assert calls[-1] == ("docker", ["stop", "--time", "3", "onbox-img-1"])
    seam.kill_session(42, 3.0)
    assert calls[-1] == ("kill_session", 42) and len([c for c in calls if c[0] == "docker"]) == 1


def test_a_failed_stop_is_tried_again_first_when_the_attempts_leftovers_are_cleared(tmp_path):
    seam, calls = _seam(tmp_path, ["exit 0"], rcs=[1, 0])
    seam.poll("child")
    seam.kill_session(42, 3.0)
    stop = ("docker", ["stop", "--time", "3", "onbox-img-1"])
    assert calls[1:] == [stop, stop, ("kill_session", 42)]  # the daemon first: one TERM through the init


def test_a_new_agent_stops_the_container_an_earlier_attempt_left_before_it_starts_the_next(tmp_path):
    (tmp_path / "containers").mkdir()
    (tmp_path / "containers" / "0.cid").write_text(CID)  # attempt 0's container, its agent and client killed
    _, calls = _seam(tmp_path, [], rcs=[0])
    assert calls == [("docker", ["stop", "--time", "3", CID]), ("spawn", ["docker", "run"])]
