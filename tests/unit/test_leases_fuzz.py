"""Property: whatever a durable run's leases/ holds (random and near-valid lease files, names that look like leases
and names that do not, deep or huge documents, FIFOs, directories, symlinks out), the lease code raises nothing
but its own refusals, hangs on nothing, writes nothing outside the durable dir, and a healthy holder is fenced
only by a lease NAME that beats its own (the documented rule: names alone decide who holds a run).

The leases are real files on a mounted-path target in a temp dir; time is a FakeClock."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Dict, List, Tuple

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from onbox.checkpoints import SyncFailed
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.leases import beats, document, lease_name, parse_name
from onbox.checkpoints.leases.fencing import Fenced, LeaseRefused, NotHeldHere, PassiveLease, RunLease
from onbox.clock import FakeClock

HOLDER = "gpu1-0a1b2c3d-11111111"
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 70), st.floats(allow_nan=False),
                      st.text(max_size=8))
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c,
                                                                                       max_size=3), max_leaves=10)
holders = st.one_of(st.sampled_from(["gpu1-0a1b2c3d-00000000", "gpu2-99887766-ffffffff", "a", "zz", HOLDER,
                                     "-x", "a.b", "h" * 129]), st.text(max_size=10).filter(lambda h: "/" not in h and "\x00" not in h))
epochs = st.one_of(st.integers(0, 4), st.sampled_from([10 ** 10 - 1, -1]))


@st.composite
def lease_names(draw: Any) -> str:
    kind = draw(st.sampled_from(["lease", "lease", "junk", "tmp"]))
    if kind == "lease":
        e = draw(epochs)
        return ("%010d.%s.json" % (e, draw(holders))) if e >= 0 else "-1.%s.json" % draw(holders)
    if kind == "tmp":
        return ".onbox-tmp-" + draw(st.text(alphabet="abc123", max_size=6))
    return draw(st.text(alphabet="abcxyz0123456789.-_", min_size=1, max_size=20).filter(lambda n: n not in (".",
                                                                                                        "..")))


@st.composite
def contents(draw: Any, name: str) -> bytes:
    f = parse_name(name)
    base = document("fx", f if f is not None else parse_name(lease_name(1, HOLDER)), "gpu2", 77, 5,
                    draw(st.floats(0, 2e9)), 30.0, ["c1"])
    kind = draw(st.sampled_from(["valid", "near", "near", "junk", "deep", "raw"]))
    if kind == "valid":
        return json.dumps(base).encode()
    if kind == "near":
        for k in draw(st.lists(st.sampled_from([*sorted(base), "extra"]), max_size=3)):
            base[k] = draw(json_any)
        return json.dumps(base).encode()
    if kind == "junk":
        return json.dumps(draw(json_any)).encode()
    if kind == "deep":
        n = draw(st.integers(60, 50_000))
        return ("[" * n + "]" * n).encode()
    return draw(st.binary(max_size=64))


@st.composite
def lease_dirs(draw: Any) -> List[Tuple[str, str, bytes]]:
    """(name, what, content): what is file | dir | fifo | link (a symlink out of the durable dir)."""
    out = []
    for name in draw(st.lists(lease_names(), max_size=5, unique=True)):
        what = draw(st.sampled_from(["file", "file", "file", "dir", "fifo", "link"]))
        out.append((name, what, draw(contents(name))))
    return out


def snapshot(root: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, n), root)] = hashlib.sha256(f.read()).hexdigest()
        out.update({os.path.relpath(os.path.join(dirpath, d), root): "dir" for d in dirnames})
    return out


@settings(max_examples=60, deadline=10_000, suppress_health_check=[HealthCheck.too_slow])
@given(planted=lease_dirs(), take_over=st.booleans())
def test_no_lease_directory_makes_the_lease_code_raise_hang_write_outside_or_fence_without_a_better_name(
        planted, take_over):
    with tempfile.TemporaryDirectory() as tmp:
        clock = FakeClock(1_000.0)
        target = LocalPathTarget(os.path.join(tmp, "durable"), "fx")
        outside = os.path.join(tmp, "outside")
        os.makedirs(outside)
        with open(os.path.join(outside, "theirs"), "w") as f:
            f.write("not onbox's\n")
        holder = RunLease.take(target, "fx", 30.0, False, clock, lambda: [], 1.0, host="gpu1", box="gpu1-0a1b2c3d",
                               pid=4242, start_time=1, alive=lambda p, s: True)
        leases = os.path.join(target.run_root, "leases")
        for name, what, content in planted:
            path = os.path.join(leases, name)
            if os.path.lexists(path):
                continue
            if what == "dir":
                os.mkdir(path)
            elif what == "fifo":
                os.mkfifo(path)
            elif what == "link":
                with open(os.path.join(outside, "target-" + hashlib.md5(name.encode()).hexdigest()), "wb") as f:
                    f.write(content)
                os.symlink(f.name, path)
            else:
                with open(path, "wb") as f:
                    f.write(content)
        before = snapshot(outside)
        better = [f for f in (parse_name(n) for n, _w, _c in planted) if f is not None and beats(f, holder.mine)]
        event("a planted name beats the holder" if better else "no planted name beats the holder")

        # the healthy holder: fenced exactly when a planted lease NAME beats its own, whatever the content
        try:
            holder.tick()
        except Exception as e:  # tick says, never raises
            raise AssertionError("tick raised %r" % e)
        assert (holder.fence is not None) == bool(better), (planted, holder.fence)

        # another box's launch: its own refusals only (or it takes the run over: a lease of its own, never outside)
        try:
            RunLease.take(target, "fx", 30.0, take_over, clock, lambda: [], 1.0, host="gpu9", box="gpu9-00000000",
                          pid=99, start_time=2, alive=lambda p, s: True)
            event("another launch took the run")
        except (LeaseRefused, SyncFailed) as e:
            assert str(e) and "Traceback" not in str(e)
            event("another launch was refused")

        # a committer that is not the agent, with and without the holder's recorded lease
        for recorded in (None, {"epoch": holder.epoch, "holder": holder.holder, "durable": holder.store.url}):
            try:
                PassiveLease(target, "fx", recorded).check("the manifest")
            except (Fenced, NotHeldHere, SyncFailed):
                pass
        assert snapshot(outside) == before  # nothing written, moved or deleted outside the durable dir
