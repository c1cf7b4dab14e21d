"""Property: whatever MANIFEST.json or checkpoints_index.json durable storage holds (hostile paths, wrong types,
odd sizes, deep nesting), restore and verify write nothing outside the checkpoint dir, raise nothing, and hang
on nothing; a checkpoint is only ever restored from a manifest that passes onbox's own check.

The durable checkpoint holds real payload files, a symlink out of it, and the replacement box's checkpoint dir a
symlink out too, so that the paths hypothesis draws can try both ways out.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Dict

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import manifest, retention
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.local.restore import restore_newest
from onbox.checkpoints.verify import verify_path
from onbox.clock import FakeClock
from tests.fakes.recorders import EventRecorder

FINE = b"fine\n"
FINE_SHA = hashlib.sha256(FINE).hexdigest()
HOSTILE_PATHS = ["../x", "../../evilsrc/payload", "/etc/passwd", "/tmp/onbox-fuzz-abs", "a/../../b", "ok.txt",
                 "sub/ok.txt", "sub", ".", "..", "", "a//b", "x\x00y", "link/escape", "link", "ok.txt/", "out",
                 "out/planted", "~", "~/x", "\\..\\x", "c" * 300]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 70), st.floats(allow_nan=False),
                      st.text(max_size=8))
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                       max_size=3), max_leaves=12)
paths = st.one_of(st.sampled_from(HOSTILE_PATHS), st.text(max_size=12), json_leaf, st.lists(st.text(), max_size=2))
sizes = st.one_of(st.sampled_from([len(FINE), 0, -1, True, "5", 1.5, None, 10 ** 30]), json_any)
digests = st.one_of(st.sampled_from([FINE_SHA, "zz", None, 5, FINE_SHA.upper()]), st.text(max_size=70), json_any)
entries = st.fixed_dictionaries({}, optional={"path": paths, "size": sizes, "sha256": digests, "sha512": digests,
                                              "extra": json_any})
manifests = st.fixed_dictionaries({}, optional={
    "files": st.one_of(st.lists(entries, max_size=4), entries, json_any),
    "hash": st.one_of(st.sampled_from(["sha256", "sha512", "md7", "shake_128", 5, None]), json_any),
    "kind": st.one_of(st.sampled_from(["file", "dir", "x", None, 3]), json_any),
    "local_name": paths, "name": st.one_of(st.sampled_from(["step_00020.pt", "../x"]), json_any),
    "step": st.one_of(st.integers(-3, 2 ** 70), json_any), "created": json_any, "digest": json_any,
    "bytes": json_any, "metrics": json_any,
    "source": st.one_of(json_any, st.fixed_dictionaries({"fingerprint": st.lists(
        st.lists(st.one_of(paths, st.integers(-1, 10 ** 20)), max_size=4), max_size=3)})),
})
VALID = {"schema": "onbox.manifest/1", "name": "step_00020.pt", "kind": "dir", "hash": "sha256", "step": 20,
         "created": 2.0, "files": [{"path": "ok.txt", "size": len(FINE), "sha256": FINE_SHA},
                                   {"path": "sub/ok.txt", "size": len(FINE), "sha256": FINE_SHA}]}


@st.composite
def near_valid(draw: Any) -> str:
    """A manifest onbox would accept, with one to three fields replaced or one file entry added: most draws
    are one step from a restore, which is where a missing check would let a hostile value through."""
    doc = json.loads(json.dumps(VALID))
    changes = draw(st.dictionaries(st.sampled_from([*sorted(VALID), "local_name", "source"]),
                                   manifests.flatmap(lambda m: st.sampled_from(list(m.values()) or [None])),
                                   max_size=3))
    doc.update(changes)
    if draw(st.booleans()) and isinstance(doc.get("files"), list):
        doc["files"] = [*doc["files"], draw(entries)]
    return json.dumps(doc)


raw_docs = st.one_of(near_valid(), near_valid(), manifests.map(json.dumps), json_any.map(json.dumps),
                     st.just(json.dumps(VALID)),
                     st.integers(1, 200_000).map(lambda n: "[" * n + "]" * n), st.text(max_size=40))


def snapshot(root: str, skip: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            if p.startswith(skip + os.sep):
                continue
            st_ = os.lstat(p)
            if os.path.islink(p):
                out[p] = (st_.st_mode, os.readlink(p))
                continue
            with open(p, "rb") as f:
                out[p] = (st_.st_mode, st_.st_size, hashlib.sha256(f.read()).hexdigest())
        out.update({os.path.join(dirpath, d): "dir" for d in dirnames
                    if not os.path.join(dirpath, d).startswith(skip)})
    return out


def durable_with(root: str, raw_manifest: str) -> LocalPathTarget:
    """<root>/durable/r1/checkpoints/step_00020.pt/ holding ok.txt, sub/ok.txt, `link` -> <root>/outside and the
    drawn MANIFEST.json; <root>/box2/ckpt with `out` -> <root>/outside."""
    ck = os.path.join(root, "durable", "r1", "checkpoints", "step_00020.pt")
    os.makedirs(os.path.join(ck, "sub"))
    for rel in ("ok.txt", "sub/ok.txt"):
        with open(os.path.join(ck, rel), "wb") as f:
            f.write(FINE)
    outside = os.path.join(root, "outside")
    os.makedirs(outside)
    with open(os.path.join(outside, "escape"), "wb") as f:
        f.write(FINE)
    os.symlink(outside, os.path.join(ck, "link"))
    with open(os.path.join(ck, "MANIFEST.json"), "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(raw_manifest)
    os.makedirs(os.path.join(root, "box2", "ckpt"))
    os.symlink(outside, os.path.join(root, "box2", "ckpt", "out"))
    return LocalPathTarget(os.path.join(root, "durable"), "r1")


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=raw_docs)
def test_no_manifest_makes_restore_or_verify_write_outside_raise_or_restore_unchecked(raw):
    with tempfile.TemporaryDirectory(prefix="onbox-fuzz-") as root:
        target = durable_with(root, raw)
        ckpt = os.path.join(root, "box2", "ckpt")
        before = snapshot(root, skip=os.path.realpath(ckpt))
        emit = EventRecorder()
        res = restore_newest(target, target.list_names(), ckpt, emit)
        event("restored" if res.path else "refused")
        assert snapshot(root, skip=os.path.realpath(ckpt)) == before
        assert not os.path.exists("/tmp/onbox-fuzz-abs")
        if res.path is not None:  # restored: only from a manifest onbox's check passes, and inside the dir
            doc = json.loads(raw)
            assert manifest.problem(doc, "step_00020.pt") is None
            assert os.path.realpath(res.path).startswith(os.path.realpath(ckpt) + os.sep)
        else:
            assert res.rejected  # refused or failed: said, never silently skipped
        report = verify_path(os.path.join(root, "durable", "r1", "checkpoints", "step_00020.pt"))
        if not report.ok:
            assert report.problems
        else:  # verify checks a copy wherever it lies (a pulled one may be renamed): all but the dir's name
            assert manifest.problem(json.loads(raw)) is None
        assert snapshot(root, skip=os.path.realpath(ckpt)) == before


index_entries = st.one_of(json_any, st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["step_00010.pt", "../../x", "missing"]), json_any),
    "step": st.one_of(st.integers(-3, 100), json_any), "created": json_any, "local_name": paths,
    "metrics": st.one_of(st.dictionaries(st.sampled_from(["loss"]), json_any), json_any),
    "verified": json_any, "verification": json_any, "digest": json_any}))
index_docs = st.one_of(json_any, st.fixed_dictionaries({}, optional={
    "checkpoints": st.one_of(st.lists(index_entries, max_size=4), json_any),
    "quarantined": st.one_of(st.lists(json_any, max_size=2), json_any), "schema": json_any}))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=index_docs)
def test_no_index_document_breaks_the_committer_or_retention(doc):
    with tempfile.TemporaryDirectory(prefix="onbox-fuzz-") as root:
        good = json.dumps({"schema": "onbox.manifest/1", "name": "step_00010.pt", "kind": "dir", "hash": "sha256",
                           "step": 10, "created": 1.0, "files": [{"path": "ok.txt", "size": len(FINE),
                                                                  "sha256": FINE_SHA}]})
        target = durable_with(root, good.replace("step_00010.pt", "step_00020.pt"))
        with open(os.path.join(root, "durable", "r1", "checkpoints_index.json"), "w") as f:
            json.dump(doc, f)
        committer = CheckpointCommitter(target, "r1", FakeClock(), EventRecorder())
        entries = committer.committed()
        assert [e["name"] for e in entries] == ["step_00020.pt"]
        assert all(manifest.entry_problem(e) is None for e in entries)
        retention.select_keep(entries, keep_last=1, best_metric="loss", every_steps=5)
        res = restore_newest(target, [e["name"] for e in reversed(entries)], os.path.join(root, "box2", "ckpt"),
                             EventRecorder())
        assert res.path is not None and os.path.basename(res.path) == "step_00020.pt"
