"""Durable storage is untrusted input: whoever can write the bucket must not be able to make a restore write
outside the checkpoint dir, read this box's files into it, or make the run train from scratch without a word.

Each test commits real checkpoints through the real hook to a mounted-path durable dir, then edits what is on
durable storage as an attacker (or a damaged bucket) would, and restores on a replacement box (an empty
checkpoint dir) or runs `onbox verify`.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict

import pytest

from onbox.checkpoints.durable import manifest
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.hook import CheckpointCommitHook
from onbox.checkpoints.local.restore import restore_newest
from onbox.checkpoints.verify import verify_path
from onbox.errors import UsageError
from onbox.paths import CHECKPOINT_STATUS_FILE
from onbox.supervisor.notes import RunNotes
from tests.fakes.recorders import EventRecorder
from tests.unit.test_ckpt_index import commit_steps, ctx_in_home, index_of


def snapshot(root: str, skip: tuple) -> Dict[str, Any]:
    """Every entry under root outside `skip` (relative dirs), with its content digest: what must not change."""
    out: Dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.split(os.sep)[0] in skip:
            continue
        for n in filenames:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.join(rel, n)] = hashlib.sha256(f.read()).hexdigest()
        out.update({os.path.join(rel, d): "dir" for d in dirnames if rel != "." or d not in skip})
    return out


def manifest_path(tmp_path, name: str):
    return tmp_path / "durable" / "r1" / "checkpoints" / name / "MANIFEST.json"


def edit_manifest(tmp_path, ckpt: str, **changes: Any) -> Dict[str, Any]:
    p = manifest_path(tmp_path, ckpt)
    doc = json.loads(p.read_text())
    for k, v in changes.items():
        if k == "files":
            doc["files"] = v(doc["files"]) if callable(v) else v
        else:
            doc[k] = v
    p.write_text(json.dumps(doc))
    return doc


def replacement_box(onbox_home, tmp_path):
    (tmp_path / "box2").mkdir(exist_ok=True)
    box2 = ctx_in_home(onbox_home, tmp_path, ckpt="box2/ckpt")
    return box2, CheckpointCommitHook(box2)


def evil_payload(tmp_path, name: str, rel: str, data: bytes = b"owned\n") -> None:
    """The attacker's file inside the checkpoint dir on durable storage, listed in its manifest under `rel`."""
    src = tmp_path / "durable" / "r1" / "checkpoints" / name / "payload"
    src.write_bytes(data)
    edit_manifest(tmp_path, name, kind="dir", source={}, files=[{"path": rel, "size": len(data),
                                                                 "sha256": hashlib.sha256(data).hexdigest()}])


@pytest.mark.parametrize("rel", ["../../evilsrc/payload", "../payload", "/tmp/onbox-evil-abs/payload",
                                 "a/../../payload", "./payload", "a//payload", "pay\x00load"])
def test_a_manifest_path_that_leads_out_is_refused_quarantined_and_the_restore_falls_back(onbox_home, tmp_path,
                                                                                          rel):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    evil_payload(tmp_path, "step_00020.pt", rel)
    before = snapshot(str(tmp_path), skip=("box2", "durable", "onbox-home"))
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    assert snapshot(str(tmp_path), skip=("box2", "durable", "onbox-home")) == before  # nothing written beside or above
    assert not os.path.exists("/tmp/onbox-evil-abs")
    assert sorted(os.listdir(box2.ckpt_dir)) == ["step_00010.pt"]
    [refused] = box2.emit.of("checkpoint_refused")
    assert refused["checkpoint"] == "step_00020.pt" and "files[0].path" in refused["problem"]
    assert box2.emit.of("checkpoint_restored")[0]["checkpoint"] == "step_00010.pt"
    [q] = box2.emit.of("checkpoint_quarantined")
    assert q["checkpoint"] == "step_00020.pt" and "cannot be restored" in q["reason"]
    assert not (tmp_path / "durable" / "r1" / "checkpoints" / "step_00020.pt").exists()
    [moved] = os.listdir(tmp_path / "durable" / "r1" / "quarantine")  # kept whole, never deleted
    assert moved.startswith("step_00020.pt.")
    assert [e["name"] for e in index_of(tmp_path)["checkpoints"]] == ["step_00010.pt"]


def test_a_local_name_that_leads_out_never_touches_the_file_beside_the_checkpoint_dir(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    edit_manifest(tmp_path, "step_00020.pt", local_name="../victim")
    victim = tmp_path / "box2" / "victim"
    victim.parent.mkdir()
    victim.write_text("the user's file\n")
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    assert victim.read_text() == "the user's file\n"
    assert sorted(os.listdir(tmp_path / "box2")) == ["ckpt", "victim"]  # no .onbox-aside/ beside the ckpt dir
    assert "local_name" in box2.emit.of("checkpoint_refused")[0]["problem"]


def test_a_local_name_through_a_symlink_out_of_the_checkpoint_dir_is_refused(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    edit_manifest(tmp_path, "step_00020.pt", local_name="link")
    (tmp_path / "box2" / "ckpt").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "box2" / "ckpt" / "link").symlink_to(tmp_path / "elsewhere")
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    assert os.listdir(tmp_path / "elsewhere") == []
    assert "outside" in box2.emit.of("restore_blocked_locally")[0]["problem"]


def test_a_good_checkpoint_is_never_quarantined_for_a_symlink_in_the_trainers_own_dir(onbox_home, tmp_path):
    """Issue 30.4: the trainer's own ck/step_00020.pt is a symlink leading outside. The restore does not write
    through it, and the verified durable checkpoint stays where it is (the problem is this box's and removable):
    it is rejected, the next older one is restored, the event says what to remove; once removed, it restores."""
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    (tmp_path / "box2" / "ckpt").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "box2" / "ckpt" / "step_00020.pt"
    link.symlink_to(tmp_path / "elsewhere" / "step_00020.pt")
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    assert os.listdir(tmp_path / "elsewhere") == []  # nothing written through the link
    assert not box2.emit.of("checkpoint_quarantined") and not (tmp_path / "durable" / "r1" / "quarantine").exists()
    assert [e["name"] for e in index_of(tmp_path)["checkpoints"]] == ["step_00010.pt", "step_00020.pt"]
    [blocked] = box2.emit.of("restore_blocked_locally")
    assert blocked["checkpoint"] == "step_00020.pt" and "`rm %s`" % link in blocked["hint"]
    [rejected] = hook.status["restore_rejected"]
    assert rejected["name"] == "step_00020.pt" and "remove it" in rejected["problem"]
    link.unlink()  # what the hint says: the next attempt restores the newest
    assert hook.restore().endswith("step_00020.pt")


def test_a_manifest_naming_onboxs_own_entries_is_refused_and_the_restore_falls_back(onbox_home, tmp_path):
    """Issue 30.3: local_name `.onbox-aside` made every restore fail and train from scratch although two good
    checkpoints were older. A hidden local_name is refused (onbox never commits one), and the restore goes on."""
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20, 30])
    edit_manifest(tmp_path, "step_00030.pt", local_name=".onbox-aside")
    edit_manifest(tmp_path, "step_00020.pt", local_name=".onbox-restore-step_00010.pt.1")
    (tmp_path / "box2" / "ckpt" / ".onbox-aside").mkdir(parents=True)  # an earlier restore kept something aside
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    refused = {e["checkpoint"]: e["problem"] for e in box2.emit.of("checkpoint_refused")}
    assert sorted(refused) == ["step_00020.pt", "step_00030.pt"]
    assert all("a hidden name" in p for p in refused.values())
    assert not box2.emit.of("resume_from_scratch") and not box2.emit.of("restore_failed")


def test_a_payload_symlink_on_durable_storage_never_copies_a_file_of_this_box(onbox_home, tmp_path):
    """A committed dir holding `secret -> /the/box's/file`, listed with that file's size and hash: a restore
    would copy the box's file into the trainer's dir and the next commit would publish it."""
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    secret = tmp_path / "box-secret"
    secret.write_bytes(b"root's ssh key\n")
    ck = tmp_path / "durable" / "r1" / "checkpoints" / "step_00020.pt"
    (ck / "secret").symlink_to(secret)
    edit_manifest(tmp_path, "step_00020.pt", kind="dir", source={}, files=[
        {"path": "secret", "size": secret.stat().st_size, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}])
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    for dirpath, _dirs, files in os.walk(tmp_path / "box2"):
        for n in files:
            with open(os.path.join(dirpath, n), "rb") as f:
                assert f.read() != secret.read_bytes(), n
    [q] = box2.emit.of("checkpoint_quarantined")
    assert q["checkpoint"] == "step_00020.pt" and "outside" in q["reason"]


@pytest.mark.parametrize("change, why", [
    ({"hash": "md7"}, "unknown hash algorithm 'md7'"),
    ({"files": lambda fs: [dict(fs[0], path=5)]}, "files[0].path 5: not a string"),
    ({"files": lambda fs: [dict(fs[0], size="12")]}, "files[0].size '12' is not a byte count"),
    ({"files": lambda fs: [dict(fs[0], size=True)]}, "not a byte count"),
    ({"files": lambda fs: [dict(fs[0], sha256="zz")]}, "is not a sha256 digest"),
    ({"files": lambda fs: fs + fs}, "listed twice"),
    ({"files": []}, "an empty file list"),
    ({"files": "step_00020.pt"}, "no file list"),
    ({"kind": "symlink"}, "kind 'symlink'"),
    ({"step": "20"}, "step '20'"),
    ({"created": "yesterday"}, "created 'yesterday'"),
    ({"name": "step_00010.pt"}, "names checkpoint 'step_00010.pt' but lives in 'step_00020.pt'"),
    ({"source": {"fingerprint": [["../x", 1, 1]]}}, "source.fingerprint[0] names '../x'"),
])
def test_a_manifest_of_the_wrong_shape_is_refused_with_the_field_named_and_the_older_one_is_used(
        onbox_home, tmp_path, change, why):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    edit_manifest(tmp_path, "step_00020.pt", **change)
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    assert why in box2.emit.of("checkpoint_refused")[0]["problem"]
    assert box2.emit.of("resume_from_scratch") == []


@pytest.mark.parametrize("raw", ["[" * 100_000 + "]" * 100_000, "{not json", "", "\xff"])
def test_a_manifest_that_is_not_a_json_object_within_bounds_is_refused(onbox_home, tmp_path, raw):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    manifest_path(tmp_path, "step_00020.pt").write_text(raw, encoding="utf-8", errors="surrogateescape")
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore().endswith("step_00010.pt")
    assert box2.emit.of("checkpoint_refused")[0]["checkpoint"] == "step_00020.pt"


def test_when_every_durable_checkpoint_is_refused_the_start_from_scratch_is_an_alert_and_a_status_line(
        onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    for name in ("step_00010.pt", "step_00020.pt"):
        edit_manifest(tmp_path, name, hash="md7")
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore() is None
    [ev] = box2.emit.of("resume_from_scratch")
    assert "none of the 2 checkpoint(s) on durable storage could be restored" in ev["why"]
    assert [r["name"] for r in ev["rejected"]] == ["step_00020.pt", "step_00010.pt"]
    status = json.loads((onbox_home / "runs" / "r1" / CHECKPOINT_STATUS_FILE).read_text())
    assert status["from_scratch"]["why"] == ev["why"]
    notes = RunNotes()
    notes.on_event(dict(ev, type="resume_from_scratch", time=1.0))
    [warning] = notes.to_state()["warnings"]
    assert warning["severity"] == "critical" and "starts from scratch" in warning["message"]
    notes.on_event({"type": "checkpoint_resume", "time": 2.0})  # a later attempt resumed: the warning goes
    assert notes.to_state()["warnings"] == []


def test_an_empty_durable_dir_is_a_quiet_fresh_start(onbox_home, tmp_path):
    box2, hook = replacement_box(onbox_home, tmp_path)
    assert hook.restore() is None
    assert box2.emit.of("resume_from_scratch") == []


def test_a_long_legal_checkpoint_name_commits_and_restores(onbox_home, tmp_path):
    """248 bytes is a legal file name; the staging, durable (.step-N) and aside names built from it must stay
    legal too."""
    ctx = ctx_in_home(onbox_home, tmp_path)
    name = "c" * 244 + ".pt"
    from tests.checkpoint_files import write_torch_zip

    write_torch_zip(os.path.join(ctx.ckpt_dir, name), payload=b"x" * 4096)
    hook = CheckpointCommitHook(ctx)
    hook.scheduler.last_sync = float("-inf")
    hook.periodic()
    hook.join_worker(None)
    [done] = ctx.emit.of("checkpoint_committed")
    assert len(done["checkpoint"].encode()) <= 255
    _box2, hook2 = replacement_box(onbox_home, tmp_path)
    got = hook2.restore()
    assert got is not None and os.path.basename(got) == name


# -- onbox verify ------------------------------------------------------------------------------------------------
def committed_dir(tmp_path, files: list) -> str:
    d = tmp_path / "ck"
    d.mkdir()
    (d / "ok.bin").write_bytes(b"fine")
    doc = {"schema": "onbox.manifest/1", "name": "ck", "kind": "dir", "hash": "sha256", "files": files}
    (d / "MANIFEST.json").write_text(json.dumps(doc))
    return str(d)


with open("/etc/passwd", "rb") as _f:
    PASSWD = _f.read()


@pytest.mark.parametrize("rel", ["../../../../../../../../etc/passwd", "/etc/passwd"])
def test_verify_never_vouches_for_a_file_outside_the_checkpoint(tmp_path, rel):
    d = committed_dir(tmp_path, [{"path": rel, "size": len(PASSWD), "sha256": hashlib.sha256(PASSWD).hexdigest()}])
    report = verify_path(d)
    assert not report.ok
    assert any(rel in p and "refused" in p for p in report.problems), report.problems


def test_verify_refuses_a_listed_symlink_that_leads_outside(tmp_path):
    d = committed_dir(tmp_path, [{"path": "passwd", "size": len(PASSWD),
                                  "sha256": hashlib.sha256(PASSWD).hexdigest()}])
    os.symlink("/etc/passwd", os.path.join(d, "passwd"))
    report = verify_path(d)
    assert not report.ok and any(p.startswith("passwd: refused") for p in report.problems), report.problems


def test_verify_names_the_field_of_a_manifest_of_the_wrong_shape(tmp_path):
    d = committed_dir(tmp_path, [{"path": "ok.bin", "size": 4, "sha256": hashlib.sha256(b"fine").hexdigest()}])
    with open(os.path.join(d, "MANIFEST.json")) as f:
        doc = json.load(f)
    for bad, why in ((dict(doc, hash="md7"), "unknown hash algorithm 'md7'"),
                     (dict(doc, files=[{"path": 5, "size": 4}]), "files[0].path 5: not a string"),
                     ("[" * 50_000, "nests more than")):
        with open(os.path.join(d, "MANIFEST.json"), "w") as f:
            f.write(bad if isinstance(bad, str) else json.dumps(bad))
        report = verify_path(d)
        assert not report.ok and why in report.problems[0], report.problems


def test_verify_refuses_a_fifo_and_kernel_files_in_one_line_without_reading(tmp_path):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="FIFO"):
        verify_path(str(fifo))
    with pytest.raises(UsageError, match="kernel's /proc filesystem"):
        verify_path("/proc/self")
    link = tmp_path / "zero.pt"
    link.symlink_to("/dev/zero")
    with pytest.raises(UsageError, match="kernel's /dev filesystem"):
        verify_path(str(link))


# -- the checks themselves -----------------------------------------------------------------------------------------
def test_what_onbox_writes_passes_its_own_check(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    commit_steps(ctx, [10, 20])
    target = LocalPathTarget(str(tmp_path / "durable"), "r1")
    for n in target.list_names():
        assert target.read_manifest(n)["name"] == n
    for e in index_of(tmp_path)["checkpoints"]:
        assert manifest.entry_problem(e) is None


def test_restore_newest_never_follows_a_name_that_is_a_path(tmp_path):
    target = LocalPathTarget(str(tmp_path / "durable"), "r1")
    res = restore_newest(target, ["../../etc", "a/b", ""], str(tmp_path / "ck"), EventRecorder())
    assert res.path is None and res.rejected == []


def test_index_entries_of_the_wrong_shape_are_dropped_and_rebuilt_from_their_manifests(onbox_home, tmp_path):
    ctx = ctx_in_home(onbox_home, tmp_path)
    hook = commit_steps(ctx, [10, 20])
    doc = index_of(tmp_path)
    doc["checkpoints"][0]["step"] = "ten"
    doc["checkpoints"][1]["name"] = "../../x"
    (tmp_path / "durable" / "r1" / "checkpoints_index.json").write_text(json.dumps(doc))
    entries = hook.committer.committed()
    assert [(e["name"], e["step"]) for e in entries] == [("step_00010.pt", 10), ("step_00020.pt", 20)]


def test_a_checkpoint_name_that_links_to_a_device_is_no_candidate_and_never_read(tmp_path):
    """A .pt symlink to /dev/zero (or a FIFO) was judged "empty file (torn ...)": it is no checkpoint at all, is
    never opened by the scan (a FIFO would block it), and its format check says what it is."""
    from onbox.checkpoints import formats
    from onbox.checkpoints.local.completion import CompletionTracker
    from onbox.checkpoints.local.detect import scan

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "step_00005.pt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "ck" / "step_00006.pt")
    assert CompletionTracker(0.0).update(scan(str(tmp_path / "ck")), 0.0, 0.0) == []
    res = formats.check_file(str(tmp_path / "ck" / "step_00005.pt"))
    assert "a character device (through a symlink to /dev/zero)" in res.problem
    assert "torn" not in res.problem and "empty" not in res.problem
