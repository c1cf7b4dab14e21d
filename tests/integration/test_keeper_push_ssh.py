"""The keeper's push to a replacement box (issue 31, part 3: a wave recovers on many spares at once, each push a
string of ssh calls and a start of the pyz there), on a real sshd box on loopback with the real onbox.pyz: a spare
that has this onbox.pyz already, recorded by a push without a code dir, is not pushed again (one ssh call reads
its hash and its push record); beside it, every case where the push must still be made: another onbox.pyz there,
a push record of another pyz, a push record with a code dir (a launch there would run in that dir), no pyz at all.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.hosts.keeper_rig import Rig
from tests.hosts.sshd_box import SshdBox, _need_root_tools

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def spare(tmp_path):
    _need_root_tools()
    box = SshdBox(str(tmp_path / "s"))
    try:
        yield box.start()
    finally:
        box.stop()


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _pushed(box: SshdBox) -> dict:
    with open(os.path.join(box.home, ".onbox", "pushed.json")) as f:
        return json.load(f)


@pytest.fixture
def kept(tmp_path, onbox_pyz, spare, monkeypatch):
    """(a fresh keeper's World maker, a recorded run of pool p): spare s0 in the inventory of a rig whose
    environment this process takes."""
    from controller.boxes.inventory import Inventory
    from controller.boxes.ssh import Ssh, settings_from_env
    from controller.keeper.policy import LaunchRecord, RecoveryPolicy
    from controller.keeper.world import World

    rig = Rig(tmp_path / "ctl", onbox_pyz)
    try:
        rig.add("s0", spare, pool="p")
        for key, value in rig.env.items():
            if key.startswith("ONBOX_"):
                monkeypatch.setenv(key, value)
        rec = LaunchRecord(run="kp", boxes=["b0"], command=["python", "train.py"], policy=RecoveryPolicy(pool="p"),
                           pyz=onbox_pyz)
        yield (lambda: World(Ssh(settings_from_env()), Inventory())), rec
    finally:
        rig.close()


def test_a_spare_that_has_this_pyz_is_not_pushed_again_and_every_other_one_is(kept, spare):
    world, rec = kept
    pyz = os.path.join(spare.home, ".onbox", "onbox.pyz")

    def push() -> bool:
        """The keeper's push to s0 (a fresh keeper each time): whether it pushed (the record was rewritten)."""
        path = os.path.join(spare.home, ".onbox", "pushed.json")
        before = _bytes(path) if os.path.exists(path) else None
        one = world()
        one.push(one.box("s0"), rec)
        return _bytes(path) != before

    assert push()  # no pyz there: pushed
    assert not push()  # this pyz, recorded without a code dir: nothing to do
    with open(pyz, "r+b") as f:  # another pyz there (one byte differs)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert push() and not push()
    record = _pushed(spare)
    for changed in ({"pyz_sha256": "0" * 64}, {"code": ".onbox/code/train"}):
        with open(os.path.join(spare.home, ".onbox", "pushed.json"), "w") as f:
            json.dump(dict(record, **changed), f)
        assert push(), changed
        assert _pushed(spare)["code"] is None and _pushed(spare)["pyz_sha256"] == record["pyz_sha256"]
    # the record is the box's word: one that is no record of ours (not JSON, nested past the bound, this pyz's
    # record padded past 64 KiB) is no reason to skip the push, and never a traceback
    for bad in (b"{not json", b"[" * 5000 + b"]" * 5000,
                json.dumps(dict(record, pad="x" * 70000)).encode()):
        with open(os.path.join(spare.home, ".onbox", "pushed.json"), "wb") as f:
            f.write(bad)
        assert push(), bad[:20]
        assert _pushed(spare)["pyz_sha256"] == record["pyz_sha256"]


def test_an_idle_spare_with_no_onbox_is_warmed_and_one_with_anything_of_a_push_is_left_as_it_is(kept, spare):
    """World.warm (spares.py): a spare with no onbox.pyz and no push record gets this pyz (verified, its first start
    made: the extraction is there); warming it again does nothing; a spare with a person's push record (a code dir)
    and no pyz is left as it is, as is one with any onbox.pyz."""
    world, rec = kept
    root = os.path.join(spare.home, ".onbox")
    assert world().warm("s0", rec)
    assert _pushed(spare)["code"] is None and os.path.isfile(os.path.join(root, "onbox.pyz"))
    shiv = os.path.join(spare.home, ".shiv")  # the box's HOME is writable: its extraction goes there
    assert os.path.isdir(shiv) and any(n.startswith("onbox.pyz_") for n in os.listdir(shiv))  # its first start
    assert not os.path.exists(os.path.join(root, "runs"))  # nothing launched
    record = _bytes(os.path.join(root, "pushed.json"))
    assert not world().warm("s0", rec)  # it has one now
    os.unlink(os.path.join(root, "onbox.pyz"))
    person = json.dumps({"pyz_sha256": "0" * 64, "code": ".onbox/code/train"}).encode()
    with open(os.path.join(root, "pushed.json"), "wb") as f:
        f.write(person)
    assert not world().warm("s0", rec)  # a person's push: left alone
    assert _bytes(os.path.join(root, "pushed.json")) == person != record
    assert not os.path.exists(os.path.join(root, "onbox.pyz"))
