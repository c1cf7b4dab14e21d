"""Choosing the pyz extraction root and cleaning old extractions (onbox/platform/extractroot.py), on real directories."""
from __future__ import annotations

import fcntl
import os

import pytest

from onbox.platform import extractroot


def test_candidates_in_order():
    env = {"SHIV_ROOT": "/x/root", "HOME": "/h", "XDG_RUNTIME_DIR": "/run/user/7"}
    assert [p for p, _ in extractroot.candidate_roots(env, uid=7)] == [
        "/x/root", "/h/.shiv", "/run/user/7/onbox-shiv", "/tmp/onbox-shiv-7", "/dev/shm/onbox-shiv-7"]
    assert extractroot.candidate_roots({"HOME": "/h"}, uid=7)[0] == ("/h/.shiv", False)


def test_unusable_reasons(tmp_path):
    assert extractroot.unusable_reason(str(tmp_path / "new")) is None
    assert (tmp_path / "new").is_dir()
    assert extractroot.unusable_reason("/proc/onbox-shiv") is not None  # cannot create dirs in /proc, even root


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_private_dir_owned_by_someone_else_is_refused(tmp_path):
    d = tmp_path / "onbox-shiv-0"
    d.mkdir()
    os.chown(str(d), 65534, 65534)
    assert "owned by uid" in extractroot.unusable_reason(str(d), private=True)


def test_choose_root_skips_unusable_and_reports_why(tmp_path):
    env = {"SHIV_ROOT": "/proc/nope", "HOME": str(tmp_path)}
    root, rejected = extractroot.choose_root(env)
    assert root == str(tmp_path / ".shiv")
    assert rejected and rejected[0][0] == "/proc/nope"


def _extraction(root, name, onbox=True):
    pkg = root / name / "site-packages" / ("onbox" if onbox else "x")
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return root / name


def test_hold_and_clean(tmp_path):
    cur = _extraction(tmp_path, "onbox.pyz_" + "0" * 64)
    old = _extraction(tmp_path, "onbox.pyz_" + "1" * 64)
    (tmp_path / (".onbox.pyz_" + "1" * 64 + "_lock")).write_text("")
    stale = _extraction(tmp_path, "onbox.pyz_" + "2" * 64 + ".tmp")
    extracting = _extraction(tmp_path, "onbox.pyz_" + "3" * 64 + ".tmp")
    other = _extraction(tmp_path, "tool.pyz_" + "4" * 64, onbox=False)
    lock = os.open(str(tmp_path / (".onbox.pyz_" + "3" * 64 + "_lock")), os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # shiv is extracting that build right now
    try:
        removed = extractroot.hold_and_clean(str(cur))
    finally:
        os.close(lock)
    assert sorted(removed) == sorted([str(old), str(stale)])
    assert cur.exists() and extracting.exists() and other.exists()
    assert not (tmp_path / (".onbox.pyz_" + "1" * 64 + "_lock")).exists()
    # this process now holds its own extraction: another cleaner cannot take it
    fd = os.open(str(cur / extractroot.INUSE_FILE), os.O_RDWR)
    try:
        with pytest.raises(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        while extractroot._held_fds:
            os.close(extractroot._held_fds.pop())
    assert not [p for p in os.listdir(str(tmp_path)) if p.startswith(".onbox-deleting-")]


def test_current_root_is_none_in_a_checkout():
    assert extractroot.current_root() is None
