"""Durable storage and its leases as hostile input, against real `onbox` processes (the sweep of the surfaces the
lease work added): a committer that is not the agent writes only under the lease it holds ON the target it
writes; a manifest naming onbox's own entries is refused and the restore falls back; a good checkpoint is never
quarantined for a local reason; symlinks planted in a mounted durable dir never redirect a write; a leftover of
a killed cleanup never blocks a commit for good.

Each test signals only the processes it started (agents and trainers, by pid AND start time) and stops them all.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.checkpoint_files import write_torch_zip
from tests.integration.supervisor_helpers import env_for
from tests.integration.test_fencing import Box, leases, manifests
from tests.polling import wait_for
from tests.processes import Started

pytestmark = pytest.mark.integration


@pytest.fixture
def started():
    with Started() as s:
        yield s


def _sync(box: Box, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onbox", "sync", "fx", "--now", *args], env=env_for(box.home),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def _index(run_root: str) -> dict:
    with open(os.path.join(run_root, "checkpoints_index.json")) as f:
        return json.load(f)


def test_sync_from_another_box_never_writes_into_a_run_it_holds_no_lease_of_there(tmp_path, started):
    """Issue 30.1: box B's run took its lease on D2; `onbox sync fx --durable D` on B must not commit into A's run
    on D (its retention removed A's checkpoints, and a replacement box trained from step 0)."""
    d, d2 = str(tmp_path / "D"), str(tmp_path / "D2")
    a, b = Box(tmp_path, "a", d, started), Box(tmp_path, "b", d2, started)
    assert a.run().returncode == 0
    wait_for(lambda: len(a.events("checkpoint_committed")) >= 3, timeout=60, what="3 commits of box a")
    a.stop()
    for n in (1, 2):  # B's lease on D2 is of epoch 2: newer than A's on D (epoch 1)
        assert b.run().returncode == 0
        wait_for(lambda n=n: len(b.events("checkpoint_committed")) >= n, timeout=60, what="a commit of box b on D2")
        b.stop()
    root = os.path.join(d, "fx")
    before, index_before, leases_before = manifests(root), _index(root), leases(root)
    write_torch_zip(os.path.join(str(b.disk), "b-step_99999.pt"), obj={"step": 99999})

    r = _sync(b, "--durable", d, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no such lease is on %s" % root in r.stderr and "Traceback" not in r.stderr
    assert "lease (epoch 2, %s)" % leases(os.path.join(d2, "fx"))[-1]["holder"] in r.stderr
    assert manifests(root) == before and _index(root) == index_before and leases(root) == leases_before
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == sorted(before)  # not even a staging dir

    # the false-positive side: the same box syncs to its own run's target, under its own lease there
    ok = _sync(b, "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout)["name"] == "b-step_99999.pt"
    assert "b-step_99999.pt" in manifests(os.path.join(d2, "fx"))


def _tree(root: str) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, n), root)] = f.read()
        out.update({os.path.relpath(os.path.join(dirpath, d), root): "dir" for d in dirnames})
    return out


@pytest.mark.parametrize("planted", ["leases", "checkpoints", "logs"])
def test_a_symlink_planted_in_the_durable_dir_never_redirects_a_real_agents_writes(tmp_path, started, planted):
    """Issue 30.5: `<durable>/<run>/leases|checkpoints|logs` a symlink to outside/ made the root agent write its
    lease files, commits and logs there."""
    d = str(tmp_path / "D")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs").write_text("not onbox's\n")
    os.makedirs(os.path.join(d, "fx"))
    os.symlink(str(outside), os.path.join(d, "fx", planted))
    before = _tree(str(outside))
    a = Box(tmp_path, "a", d, started)
    r = a.run()
    if planted == "leases":  # the lease cannot be taken: the launch is refused at once, naming the link
        assert r.returncode == 3, r.stdout + r.stderr
        assert "%s is a symlink (to %s)" % (os.path.join(d, "fx", "leases"), outside) in r.stderr
        assert "Traceback" not in r.stderr and not a.trainers()
    else:
        assert r.returncode == 0, r.stderr
        event = "sync_failed" if planted == "checkpoints" else "log_sync_failed"
        wait_for(lambda: a.events(event), timeout=60, what="a %s event" % event)
        assert "is a symlink (to %s)" % outside in a.events(event)[0]["error"]
        a.stop()
    assert _tree(str(outside)) == before  # not one byte written, moved or deleted there


def test_one_bad_manifest_and_a_link_in_the_trainers_dir_never_make_a_replacement_box_train_from_scratch(
        tmp_path, started):
    """Issues 30.3 and 30.4 with real agents: box a committed steps; the newest manifest names `.onbox-aside`, and
    the replacement box's own checkpoint dir holds a symlink where the second newest goes. The replacement box
    resumes from the third newest, quarantines only the refused one, and says what to remove for the other."""
    d = str(tmp_path / "D")
    root = os.path.join(d, "fx")
    a = Box(tmp_path, "a", d, started)
    assert a.run().returncode == 0
    wait_for(lambda: len(a.events("checkpoint_committed")) >= 3, timeout=60, what="3 commits of box a")
    a.stop()
    names = sorted(manifests(root), key=lambda n: manifests(root)[n]["step"])
    newest, second, third = names[-1], names[-2], names[-3]
    path = os.path.join(root, "checkpoints", newest, "MANIFEST.json")
    with open(path) as f:
        doc = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(doc, local_name=".onbox-aside"), f)
    b = Box(tmp_path, "b", d, started)
    os.makedirs(str(b.disk))
    (tmp_path / "elsewhere").mkdir()
    link = os.path.join(str(b.disk), manifests(root)[second]["local_name"])
    os.symlink(str(tmp_path / "elsewhere" / "x.pt"), link)
    assert b.run().returncode == 0
    wait_for(lambda: b.trainers(), timeout=60, what="box b's trainer")
    assert os.path.basename(b.trainers()[0]["resume"]) == manifests(root)[third]["local_name"]
    [blocked] = b.events("restore_blocked_locally")
    assert blocked["checkpoint"] == second and "`rm %s`" % link in blocked["hint"]
    assert [e["checkpoint"] for e in b.events("checkpoint_quarantined")] == [newest]
    assert second in manifests(root) and not b.events("resume_from_scratch")
    assert os.listdir(tmp_path / "elsewhere") == []
    b.stop()
