"""onbox.telemetry.host against fixture trees of real cgroup v1, v2 and hybrid files (tests/fixtures/cgroup)."""
from __future__ import annotations

import os
import shutil

import pytest

from onbox.telemetry import host

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "cgroup")
GiB = 1024 ** 3


def tree(name):
    return os.path.join(FIX, name)


def test_hybrid_reads_the_nested_own_memory_cgroup():
    r = host.read_cgroup(tree("hybrid"))
    assert r.version == "hybrid"
    assert r.path == "/process_api/38722cc3311632335988948d2cd49248"
    assert r.memory_limit_bytes == 8 * GiB  # the own cgroup's, not the root's (unlimited)
    assert r.memory_current_bytes == 2748416
    assert r.oom_kill == 1
    assert r.cpu_quota_cores is None  # cfs_quota_us = -1


def test_v1_container_without_cgroupns_falls_back_to_the_mount_root():
    r = host.read_cgroup(tree("v1"))
    assert r.version == "v1"
    assert r.path.startswith("/docker/")
    assert r.memory_limit_bytes == 16 * GiB
    assert r.memory_current_bytes == 5 * GiB
    assert r.oom_kill == 2
    assert r.cpu_quota_cores == 4.0  # cpu,cpuacct mount: 400000 / 100000


def test_v2_nested_container_is_bound_by_its_pods_limits():
    r = host.read_cgroup(tree("v2"))
    assert r.version == "v2"
    assert r.path.endswith(".scope")
    assert r.memory_limit_bytes == 32 * GiB  # container memory.max is "max"; the pod's 32 GiB binds
    assert r.memory_current_bytes == 20 * GiB
    assert r.oom_kill == 3
    assert r.cpu_quota_cores == 2.5
    assert host.effective_cpus(r, affinity=64) == 3  # U40: ceil(2.5), not the 64 host cores
    assert host.effective_cpus(r, affinity={0, 1}) == 2  # the affinity mask is tighter


def test_v2_with_cgroup_namespace_reads_root_files():
    r = host.read_cgroup(tree("v2-ns"))
    assert (r.version, r.path) == ("v2", "/")
    assert r.memory_limit_bytes == 12 * GiB
    assert r.memory_current_bytes == GiB
    assert r.oom_kill == 0
    assert r.cpu_quota_cores == 12.0


def test_no_cgroup_filesystem_is_none_not_an_error():
    r = host.read_cgroup(tree("none"))
    assert r == host.CgroupReading("none", "", None, None, None, None)
    assert host.effective_cpus(r, affinity=8) == 8


def test_v1_unlimited_sentinel_and_unreadable_files(tmp_path):
    root = tmp_path / "box"
    shutil.copytree(tree("hybrid"), str(root), symlinks=True)
    own = root / "sys/fs/cgroup/memory/process_api/38722cc3311632335988948d2cd49248"
    (own / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (own / "memory.oom_control").unlink()  # kernels before 4.13 have no oom_kill line
    r = host.read_cgroup(str(root))
    assert r.memory_limit_bytes is None
    assert r.oom_kill is None
    assert r.memory_current_bytes == 2748416


def test_effective_cpus_never_below_one():
    r = host.CgroupReading("v2", "/", None, None, None, 0.1)
    assert host.effective_cpus(r, affinity=16) == 1


def test_parse_proc_cgroup_keeps_joined_and_single_names():
    paths = host.parse_proc_cgroup("3:cpu,cpuacct:/a\n1:name=systemd:/b\n0::/c\n")
    assert paths["cpu"] == paths["cpuacct"] == paths["cpu,cpuacct"] == "/a"
    assert paths["name=systemd"] == "/b"
    assert paths[""] == "/c"


@pytest.mark.skipif(not os.path.exists("/proc/self/cgroup"), reason="no /proc/self/cgroup on this box")
def test_this_box_reads_without_error():
    r = host.read_cgroup()
    assert r.version in ("v1", "v2", "hybrid")
    assert r.path.startswith("/")
