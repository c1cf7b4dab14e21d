"""A mounted durable dir is written by others too (the fleet's boxes, anyone with the volume): a symlink planted
where onbox writes must never redirect a write (issue 30.5), a file where onbox keeps a directory is named (30.14),
and a leftover of an interrupted commit is removed so that a kill at any step of its removal never leaves a dir
that blocks the next commit of that name for good (30.15).

Real files on a mounted-path target in a temp dir; the kills are real SIGKILLs of a forked committer."""
from __future__ import annotations

import hashlib
import os
import signal

import pytest

from onbox.checkpoints import NotARealDir, SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import PARTIAL_MARKER, STAGING_PREFIX
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.leases import LeaseFile, document, lease_name
from onbox.checkpoints.leases.fencing import LeaseStore
from onbox.clock import SystemClock
from tests.checkpoint_files import complete_cands, write_torch_zip


def _noop(*_a, **_k):
    return None


def tree(root) -> dict:
    """Every file under root with its content digest, every dir: what must not change."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, n), root)] = hashlib.sha256(f.read()).hexdigest()
        out.update({os.path.relpath(os.path.join(dirpath, d), root): "dir" for d in dirnames})
    return out


@pytest.fixture
def setup(tmp_path):
    """A run with one committed checkpoint, a local checkpoint dir holding a newer one, and a dir `outside` that
    an attacker would like onbox to write into (holding a file of its own)."""
    target = LocalPathTarget(str(tmp_path / "durable"), "fx")
    ck = tmp_path / "ck"
    write_torch_zip(str(ck / "step_00010.pt"), payload=b"\x10" * 4096)
    com = CheckpointCommitter(target, "fx", SystemClock(), _noop)
    com.commit(complete_cands(str(ck))[0])
    write_torch_zip(str(ck / "step_00020.pt"), payload=b"\x20" * 4096)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs").write_text("not onbox's\n")
    return target, ck, outside


def plant(target: LocalPathTarget, rel: str, outside) -> None:
    """Replace <run>/<rel> (moving what was there aside) with a symlink to `outside`."""
    path = os.path.join(target.run_root, rel)
    if os.path.lexists(path):
        os.rename(path, path + ".moved")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(str(outside), path)


def _commit_newest(target, ck):
    cand = next(c for c in complete_cands(str(ck)) if c.name == "step_00020.pt")
    return CheckpointCommitter(target, "fx", SystemClock(), _noop).commit(cand)


@pytest.mark.parametrize("rel", ["checkpoints", "logs", "logs/box1", "quarantine", "leases", "."])
def test_a_planted_symlink_never_redirects_a_write_of_onbox(setup, rel):
    target, ck, outside = setup
    if rel == ".":  # the run's own dir under the durable root
        os.rename(target.run_root, target.run_root + ".moved")
        os.symlink(str(outside), target.run_root)
    else:
        plant(target, rel, outside)
    before = tree(str(outside))
    link = os.path.normpath(os.path.join(target.run_root, rel))
    doc = document("fx", LeaseFile(lease_name(1, "h-1"), 1, "h-1"), "gpu1", 10, 5, 1.0, 30.0, [])
    writes = {
        "checkpoints": lambda: _commit_newest(target, ck),
        "logs": lambda: target.put_logs(str(ck), ["step_00020.pt"], "box1"),
        "logs/box1": lambda: target.put_logs(str(ck), ["step_00020.pt"], "box1"),
        "quarantine": lambda: target.quarantine("step_00010.pt", "t1"),
        "leases": lambda: LeaseStore(target, "fx").write(LeaseFile(lease_name(1, "h-1"), 1, "h-1"), doc),
        ".": lambda: target.write_index({"schema": "x", "checkpoints": []}),
    }
    with pytest.raises(NotARealDir, match="%s is a symlink \\(to %s\\)" % (link, outside)) as e:
        writes[rel]()
    assert "redirecting" in e.value.hint
    assert tree(str(outside)) == before  # not one byte written, moved or deleted there
    if rel == "leases":  # fail closed: a redirected leases dir does not read as "no leases" (nothing fenced)
        with pytest.raises(NotARealDir):
            target.list_leases()
    if rel == "checkpoints":  # nor a cleanup or a removal of what lies there
        with pytest.raises(NotARealDir):
            target.clean_leftovers()
        (outside / "step_00010.pt").mkdir()
        with pytest.raises(NotARealDir):
            target.remove("step_00010.pt")
        assert (outside / "step_00010.pt").is_dir()


def test_the_false_positive_side_a_durable_root_reached_through_a_link_is_the_users_choice(tmp_path):
    """`--durable /workspace/durable` where /workspace is a link to the volume: the root may be a link (the user
    chose it); only what lies below it must be real directories."""
    (tmp_path / "volume").mkdir()
    os.symlink(str(tmp_path / "volume"), str(tmp_path / "workspace"))
    target = LocalPathTarget(str(tmp_path / "workspace"), "fx")
    write_torch_zip(str(tmp_path / "ck" / "step_00010.pt"))
    r = CheckpointCommitter(target, "fx", SystemClock(), _noop).commit(complete_cands(str(tmp_path / "ck"))[0])
    assert r.status == "committed"
    target.put_logs(str(tmp_path / "ck"), ["step_00010.pt"], "box1")
    target.quarantine("step_00010.pt", "t1")
    assert os.path.isdir(tmp_path / "volume" / "fx" / "quarantine" / "step_00010.pt.t1")
    assert os.path.isfile(tmp_path / "volume" / "fx" / "logs" / "box1" / "step_00010.pt")


def test_a_file_where_onbox_keeps_the_leases_dir_is_named_not_file_exists(setup):
    target, _ck, _outside = setup
    with open(os.path.join(target.run_root, "leases"), "w") as f:
        f.write("junk\n")
    doc = document("fx", LeaseFile(lease_name(1, "h-1"), 1, "h-1"), "gpu1", 10, 5, 1.0, 30.0, [])
    with pytest.raises(NotARealDir, match=r"leases is a regular file, where onbox keeps a directory") as e:
        LeaseStore(target, "fx").write(LeaseFile(lease_name(1, "h-1"), 1, "h-1"), doc)
    assert "move it aside" in e.value.hint and "File exists" not in str(e.value)
    with pytest.raises(NotARealDir):  # and it is never read as "the run has no leases"
        target.list_leases()


# -- a leftover of an interrupted commit, removed with a kill at every step -------------------------------------------
def leftover(target: LocalPathTarget, name: str, files: int = 6) -> None:
    """What a commit killed after its staging rename and before its manifest leaves: <name>/ with the marker and
    the payload, no MANIFEST.json."""
    d = os.path.join(target.ckpts, name)
    os.makedirs(os.path.join(d, "sub"))
    open(os.path.join(d, PARTIAL_MARKER), "wb").close()
    for i in range(files):
        with open(os.path.join(d, "sub" if i % 2 else "", "part%d" % i), "wb") as f:
            f.write(os.urandom(512))


def _killed_at(target: LocalPathTarget, ck, step: int) -> int:
    """Fork a committer of ck's checkpoint (the same name as the leftover), SIGKILLed at its `step`-th unlink,
    rmdir or rename (the cleanup's steps); its exit status."""
    pid = os.fork()
    if pid == 0:
        try:
            seen = [0]

            def counting(real):
                def call(*a, **k):
                    seen[0] += 1
                    if seen[0] == step:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*a, **k)
                return call
            os.unlink, os.rmdir, os.rename = (counting(f) for f in (os.unlink, os.rmdir, os.rename))
            com = CheckpointCommitter(target, "fx", SystemClock(), _noop)
            com.commit(complete_cands(str(ck))[0])
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def test_a_kill_at_every_step_of_a_leftovers_removal_never_blocks_the_next_commit(tmp_path):
    """Issue 30.15: the leftover was removed in place, its marker possibly first; killed right after, the dir
    without marker read as "not written by onbox", was never removed, and every later commit of the name failed."""
    ck = tmp_path / "ck"
    write_torch_zip(str(ck / "step_00020.pt"), payload=b"\x20" * 4096)
    killed = 0
    for step in range(1, 24):
        target = LocalPathTarget(str(tmp_path / ("durable%d" % step)), "fx")
        leftover(target, "step_00020.pt")
        status = _killed_at(target, ck, step)
        killed += os.WIFSIGNALED(status)
        if not os.WIFSIGNALED(status):
            break  # the commit ran to its end before the step-th call: every step was covered
        # what any reader sees: no half-removed dir that is not onbox's
        for n in os.listdir(target.ckpts):
            p = os.path.join(target.ckpts, n)
            assert n.startswith(STAGING_PREFIX) or os.path.lexists(os.path.join(p, PARTIAL_MARKER)) or \
                target.has_manifest(n), "step %d left %s: neither a staging name, nor marked, nor committed" % (
                    step, sorted(os.listdir(p)))
        r = CheckpointCommitter(target, "fx", SystemClock(), _noop).commit(complete_cands(str(ck))[0])
        assert r.status in ("committed", "already"), step  # a kill after its manifest: already committed
        assert os.listdir(target.ckpts) == ["step_00020.pt"], step  # the start cleaned every leftover
        assert target.read_manifest("step_00020.pt") is not None
    assert killed >= 10  # the cleanup's steps were there to kill: every unlink, rmdir and rename of it


def test_the_false_positive_side_a_dir_without_marker_stays_and_says_whose_it_may_be(tmp_path):
    target = LocalPathTarget(str(tmp_path / "durable"), "fx")
    os.makedirs(os.path.join(target.ckpts, "step_00020.pt"))
    with open(os.path.join(target.ckpts, "step_00020.pt", "mine.pt"), "w") as f:
        f.write("the user's own\n")
    write_torch_zip(str(tmp_path / "ck" / "step_00020.pt"))
    com = CheckpointCommitter(target, "fx", SystemClock(), _noop)
    with pytest.raises(SyncFailed, match="not written by onbox: not replacing it"):
        com.commit(complete_cands(str(tmp_path / "ck"))[0])
    assert os.listdir(os.path.join(target.ckpts, "step_00020.pt")) == ["mine.pt"]
