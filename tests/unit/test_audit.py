"""`onbox audit`: verdicts from real disks, fixture cgroup trees, the fake NVML and a torch version.py on disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from onbox.commands.audit import audit
from onbox.gpu.nvml import NvmlSeam
from onbox.platform.audit import AuditOptions, Seams, check_torch, run_audit
from tests.conftest import subprocess_env
from tests.fakes.nvml import FakeGpu, FakeNvml

CGROUPS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "cgroup")


def seams(tmp_path, cgroup="v2", environ=None, gpus=None, torch_cuda=None, tools=("tmux", "rsync")):
    torch_dir = tmp_path / "site" / "torch"
    torch_dir.mkdir(parents=True, exist_ok=True)
    (torch_dir / "version.py").write_text(
        "from typing import Optional\n\n__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']\n"
        "__version__ = '2.5.1%s'\ndebug = False\ncuda: Optional[str] = %s\n"
        % ("+cu" + torch_cuda.replace(".", "") if torch_cuda else "+cpu", repr(torch_cuda)))
    nv = FakeNvml(gpus=gpus or [], driver=gpus is not None, cuda_version=12040)
    return Seams(environ=environ or {}, cgroup_root=os.path.join(CGROUPS, cgroup), nvml=NvmlSeam(module=nv),
                 which=lambda t: "/usr/bin/" + t if t in tools else None, torch_dir=str(torch_dir))


def by_name(report):
    return {c.name: c for c in report.checks}


def test_healthy_box_is_fit_and_reports_every_area(tmp_path, onbox_home):
    durable = tmp_path / "durable"
    durable.mkdir()
    r = run_audit(AuditOptions(ckpt_dir=str(tmp_path / "ckpt"), durable=str(durable), min_free_gb=0.001,
                               min_free_inodes=10, profile="runpod"),
                  seams(tmp_path, gpus=[FakeGpu()], torch_cuda="12.4"))
    c = by_name(r)
    assert r.fit
    assert {"python", "profile", "disk.ckpt", "disk.durable", "disk.home", "disk.extract", "cgroup.memory",
            "cpu.threads", "gpu", "torch", "tool.tmux", "tool.rsync", "tool.rclone"} <= set(c)
    assert c["disk.ckpt"].verdict == "ok" and c["disk.ckpt"].data["free_inodes"] != 0
    assert c["cgroup.memory"].data["memory_limit_bytes"] == 32 * 1024 ** 3
    assert c["gpu"].verdict == "ok" and "H100" in c["gpu"].summary and "CUDA 12.4" in c["gpu"].summary
    assert c["torch"].verdict == "ok"
    assert c["tool.rclone"].verdict == "info"
    assert "terminate" in c["profile"].summary and "IRREVERSIBLE" in c["profile"].summary


def test_oom_kills_and_too_many_threads_warn(tmp_path, onbox_home):
    r = run_audit(AuditOptions(min_free_gb=0, min_free_inodes=0, profile="local"),
                  seams(tmp_path, cgroup="v1", environ={"OMP_NUM_THREADS": "64"}))
    c = by_name(r)
    assert c["cgroup.memory"].verdict == "warn" and "U9" in c["cgroup.memory"].hint
    assert c["cgroup.memory"].data["oom_kill"] == 2
    cpus = c["cpu.threads"]
    assert cpus.data["effective_cpus"] <= 4  # quota of 4 cores on the v1 fixture
    assert cpus.verdict == "warn" and "U40" in cpus.hint
    assert r.fit  # warnings do not make the box unfit


def test_no_driver_is_info_not_an_error(tmp_path, onbox_home):
    c = by_name(run_audit(AuditOptions(min_free_gb=0, profile="local"), seams(tmp_path, gpus=None)))
    assert c["gpu"].verdict == "info" and "no NVIDIA driver" in c["gpu"].summary
    assert c["torch"].verdict == "info"


@pytest.mark.parametrize("torch_cuda,verdict", [("12.4", "ok"), ("11.8", "ok"), ("12.8", "warn"), ("13.0", "fail"),
                                                (None, "warn")])
def test_torch_cuda_build_against_driver(tmp_path, torch_cuda, verdict):
    s = seams(tmp_path, gpus=[FakeGpu()], torch_cuda=torch_cuda)
    from onbox.platform.audit import check_gpus

    assert check_torch(s, check_gpus(s)).verdict == verdict


def test_rclone_remote_without_rclone_is_unfit(tmp_path, onbox_home):
    r = run_audit(AuditOptions(durable="s3:bucket/runs", min_free_gb=0, profile="local"), seams(tmp_path))
    assert not r.fit and by_name(r)["tool.rclone"].verdict == "fail"


def test_cli_json_and_thresholds(tmp_path, onbox_home, monkeypatch):
    runner = CliRunner()
    res = runner.invoke(audit, ["--json", "--ckpt-dir", str(tmp_path), "--min-free-gb", "0", "--profile", "local"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["schema"] == "onbox.audit/1" and doc["fit"] is True
    assert all(c["verdict"] in ("ok", "warn", "fail", "info") for c in doc["checks"])
    res = runner.invoke(audit, ["--ckpt-dir", str(tmp_path), "--min-free-gb", "100000000", "--profile", "local"])
    assert res.exit_code != 0
    assert "FAIL  disk.ckpt" in res.output


def _cli(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "onbox", "audit", *args], capture_output=True, text=True,
                          env=subprocess_env({"ONBOX_HOME": str(tmp_path / "home")}), timeout=60)


def test_unwritable_ckpt_dir_exits_3_with_one_clean_line(tmp_path):
    # /proc refuses file creation even for root (access(2) would lie); a real check, not a mock.
    r = _cli(["--ckpt-dir", "/proc/onbox-ckpt", "--profile", "local"], tmp_path)
    assert r.returncode == 3
    lines = r.stderr.splitlines()
    assert lines[0].startswith("onbox: box unfit: checkpoint dir /proc/onbox-ckpt is not writable")
    assert lines[1].startswith("hint: ")
    assert "Traceback" not in r.stderr
    assert "FAIL  disk.ckpt" in r.stdout


def test_low_disk_exits_3_and_json_still_prints(tmp_path):
    r = _cli(["--json", "--ckpt-dir", str(tmp_path), "--min-free-gb", "100000000", "--profile", "local"], tmp_path)
    assert r.returncode == 3
    assert json.loads(r.stdout)["fit"] is False
    assert r.stderr.startswith("onbox: box unfit: checkpoint dir")


def test_unknown_profile_is_usage_error(tmp_path):
    r = _cli(["--profile", "nope"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("onbox: unknown profile 'nope'")
