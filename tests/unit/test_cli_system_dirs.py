"""Where a checkpoint dir and a durable dir may be (issue 30.14): never the root, a system directory or anything in
one (`--ckpt-dir /usr/share` had the first attempt resume from /usr/share/glib-2.0, `--durable /usr/share` wrote
leases there), but every place a platform keeps its disks (profiles/), the temp dirs tests and Slurm sites use,
the user's home even where it lies in a system tree, and a data disk mounted inside /opt, /var or /run."""
from __future__ import annotations

import glob
import os
import subprocess
import uuid

import pytest

from onbox.launch import checks
from onbox.launch.checks import ckpt_dir_problem, durable_problem, system_dir_problem
from onbox.tomlread import load_toml
from tests.conftest import REPO_ROOT


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    monkeypatch.setenv("ONBOX_HOME", str(tmp_path / "onbox-home"))
    return str(tmp_path / "onbox-home" / "runs" / "x")


INSIDE = ["/usr/share", "/usr/share/glib-2.0", "/usr/local/ckpt", "/etc/onbox-ckpt", "/var/lib/onbox", "/var/log/x",
          "/var/cache/ckpt", "/opt/conda", "/opt/ml-not-mounted/ckpt", "/boot/x", "/proc/self/fd-x", "/sys/kernel/x",
          "/dev/onbox-x", "/run/lock/x", "/lib/x", "/sbin/x", "/bin/x"]


@pytest.mark.parametrize("path", INSIDE)
def test_anything_in_a_system_tree_is_refused_for_both(path, run_dir):
    assert "system directory" in ckpt_dir_problem(path, run_dir)
    assert "system directory" in durable_problem(path)


@pytest.mark.parametrize("path", ["/opt", "/var", "/usr", "/etc"])
def test_a_system_tree_itself_is_refused_for_both(path, run_dir):
    assert "is a system directory" in ckpt_dir_problem(path, run_dir)
    assert durable_problem(path).startswith("is a system directory")


def test_the_root_is_refused_as_a_durable_dir_also_through_a_symlink(tmp_path):
    (tmp_path / "d").symlink_to("/")
    assert durable_problem("/").startswith("is the root of the filesystem")
    assert durable_problem(str(tmp_path / "d")).startswith("is the root of the filesystem (/, symlinks resolved)")


def test_a_symlink_into_a_system_tree_is_refused_naming_where_it_leads(tmp_path, run_dir):
    (tmp_path / "out").symlink_to("/usr/share")
    assert ckpt_dir_problem(str(tmp_path / "out"), run_dir).startswith(
        "is inside the system directory /usr (/usr/share, symlinks resolved)")


def _profile_paths():
    """Every fast and durable path the platform profiles name, and their [run] defaults' dirs."""
    out = set()
    for path in glob.glob(os.path.join(REPO_ROOT, "profiles", "*.toml")):
        doc = load_toml(path, "profile")
        tables = [doc.get("paths") or {}] + [p.get("paths") or {} for p in (doc.get("platforms") or {}).values()]
        out |= {t.get(k) for t in tables for k in ("fast", "durable")}
        out |= {(doc.get("run") or {}).get(k) for k in ("ckpt_dir", "durable")}
    return sorted(p.replace("<name>", "fs1").replace("$TMPDIR", "/tmp") for p in out if isinstance(p, str) and p)


PLATFORM_PLACES = ["/root/autodl-tmp", "/workspace", "/lambda/nfs/fs1", "/storage", "/home/user/datadisk",
                   "/hy-tmp", "/kaggle/working", "/content/drive/MyDrive", "/mnt/disks/local-ssd", "/mnt"]


def test_the_profiles_name_the_places_checked_here():
    assert set(PLATFORM_PLACES) <= set(_profile_paths())
    assert "/opt/dlami/nvme" in _profile_paths()  # a mount inside /opt: test_a_data_disk_mounted_in_opt_...


@pytest.mark.parametrize("place", [p for p in _profile_paths() if not p.startswith("/opt/")])
def test_every_place_a_platform_keeps_its_disks_is_accepted(place, run_dir):
    place = os.path.expanduser(place)
    assert durable_problem(place) is None
    assert ckpt_dir_problem(os.path.join(place, "ckpt"), run_dir) is None


@pytest.mark.parametrize("place", ["/tmp/pytest-of-root/x", "/var/tmp/onbox-ckpt", "/var/tmp", "/dev/shm/ck",
                                   "/scratch/u/ck", "/data/ck", "/srv/data/ck", "/mnt/nvme0/ck", "/nfs/team/ck"])
def test_temp_dirs_and_data_places_are_accepted(place, run_dir):
    assert durable_problem(place) is None
    assert ckpt_dir_problem(place, run_dir) is None


def test_a_service_accounts_home_in_a_system_tree_is_its_own(monkeypatch, tmp_path):
    """HOME=/var/lib/jenkins: its checkpoint dirs are the user's, not the system's; the rest of /var/lib is not."""
    monkeypatch.setenv("HOME", "/var/lib/jenkins")
    assert system_dir_problem("/var/lib/jenkins/ckpt") is None
    assert "inside the system directory /var" in system_dir_problem("/var/lib/dpkg/x")
    monkeypatch.setenv("HOME", "/")  # a daemon's HOME=/ lends nothing
    assert "inside the system directory /usr" in system_dir_problem("/usr/share")


def test_the_runs_own_default_checkpoint_dir_is_fine_wherever_onbox_home_is(monkeypatch):
    monkeypatch.setenv("ONBOX_HOME", "/var/lib/onbox")
    assert ckpt_dir_problem("/var/lib/onbox/runs/x/checkpoints", "/var/lib/onbox/runs/x") is None
    assert "inside ONBOX_HOME" in ckpt_dir_problem("/var/lib/onbox/runs/y/checkpoints", "/var/lib/onbox/runs/x")


@pytest.fixture
def disk_in(request):
    """A real tmpfs mounted at <tree>/onbox-test-<uuid>/disk (root only); the tree is the test's parameter."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    tree = request.param
    top = os.path.join(tree, "onbox-test-" + uuid.uuid4().hex[:8])
    disk = os.path.join(top, "disk")
    os.makedirs(disk)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk], capture_output=True, text=True,
                          timeout=30)
    try:
        if proc.returncode != 0:
            pytest.skip("cannot mount a tmpfs here: %s" % proc.stderr.strip())
        yield top, disk
    finally:
        subprocess.run(["umount", "-l", disk], timeout=30, check=False, capture_output=True)
        os.rmdir(disk)
        os.rmdir(top)


@pytest.mark.root
@pytest.mark.parametrize("disk_in", ["/opt", "/run"], indirect=True)
def test_a_data_disk_mounted_in_opt_or_run_is_accepted_and_the_dir_above_it_is_not(disk_in, run_dir):
    """AWS's Deep Learning AMI mounts the instance NVMe at /opt/dlami/nvme: a disk of its own, the place to train."""
    top, disk = disk_in
    for path in (disk, os.path.join(disk, "ckpt"), os.path.join(disk, "a", "b")):
        assert checks.durable_problem(path) is None, path
        assert checks.ckpt_dir_problem(path, run_dir) is None, path
    assert "inside the system directory" in checks.durable_problem(top)
    assert "inside the system directory" in checks.ckpt_dir_problem(os.path.join(top, "other"), run_dir)
