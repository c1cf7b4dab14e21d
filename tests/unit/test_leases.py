"""Run leases with a fake clock: who holds a run (the tie-break), when a lease is live, what a take refuses, what a
holder is fenced by, the lineage a new holder restores from, and lease files as untrusted input (a table).

The lease files are real files on a mounted-path target in a temp dir; time is a FakeClock."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List

import pytest

from onbox.checkpoints import SyncFailed
from onbox.checkpoints.durable.localpath import LocalPathTarget
from onbox.checkpoints.leases import (
    BadLease,
    Committed,
    LeaseFile,
    Lineage,
    base_for,
    box_of,
    document,
    fencing_lease,
    holder_of_run,
    is_live,
    lease_files,
    lease_name,
    new_holder,
    parse_name,
    renewed_ago,
)
from onbox.checkpoints.leases.fencing import (
    Fenced,
    LeaseRefused,
    LeaseStore,
    NotHeldHere,
    PassiveLease,
    RunLease,
)
from onbox.clock import FakeClock

TTL = 30.0
BOX = "gpu1-0a1b2c3d"
OTHER = "gpu2-99887766"


def lf(epoch: int, holder: str) -> LeaseFile:
    return LeaseFile(lease_name(epoch, holder), epoch, holder)


# -- names, the tie-break, liveness --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, parsed", [
    ("0000000003.gpu1-0a1b2c3d-deadbeef.json", (3, "gpu1-0a1b2c3d-deadbeef")),
    ("0000000000.x.json", (0, "x")),
    ("3.gpu1.json", None),  # the epoch is always ten digits
    ("0000000003.gpu1.json.tmp", None),
    (".onbox-tmp-abc", None),
    ("0000000003.-x.json", None),  # a holder starts with a letter or digit
    ("0000000003.a/b.json", None),
    ("0000000003.%s.json" % ("h" * 129), None),
])
def test_lease_file_names(name, parsed):
    got = parse_name(name)
    assert (got.epoch, got.holder) == parsed if parsed else got is None


def test_the_newest_epoch_holds_the_run_and_the_lowest_holder_wins_a_tie():
    files = lease_files(["0000000001.b.json", "0000000002.c.json", "0000000002.a.json", "junk", "0000000002.b.json"])
    assert holder_of_run(files) == lf(2, "a")
    assert holder_of_run([]) is None
    assert fencing_lease(files, 2, "a") is None  # the winner is fenced by nobody
    assert fencing_lease(files, 2, "b") == lf(2, "a")  # a loser of the tie is fenced
    assert fencing_lease(files, 1, "b") == lf(2, "a")  # an older epoch is fenced
    assert fencing_lease(files, 3, "z") is None  # a newer one (not listed yet) holds


def test_a_holder_names_its_box():
    h = new_holder(BOX)
    assert box_of(h) == BOX and h != new_holder(BOX) and parse_name(lease_name(1, h)) is not None


def test_live_means_renewed_within_the_holders_own_ttl_and_not_released():
    doc = document("r", lf(1, "a"), "gpu1", 10, 5, 1000.0, 30.0, [])
    assert is_live(doc, 1030.0, 999.0) and not is_live(doc, 1030.5, 999.0)  # its own ttl, not the reader's
    assert not is_live(dict(doc, released_at=1001.0), 1002.0, 999.0)
    assert is_live(dict(doc, ttl=None), 1500.0, 600.0)  # no ttl recorded: the reader's


# -- lineage ------------------------------------------------------------------------------------------------------
CKPTS = [Committed("legacy", None, None), Committed("c1", 1, "a"), Committed("c2", 2, "b"),
         Committed("c2-loser", 2, "z"), Committed("c3", 3, "c")]


def test_the_base_is_the_previous_holders_own_checkpoints_and_its_base():
    prev = lf(2, "b")
    assert base_for(prev, {"base": ["legacy", "c1", "retired"]}, [], CKPTS) == ["c1", "c2", "legacy"]
    assert base_for(None, None, [], CKPTS) == sorted(c.name for c in CKPTS)  # no lease yet: everything committed


def test_an_unreadable_previous_lease_continues_from_the_newest_readable_one():
    prev = lf(3, "c")
    older = [(lf(2, "b"), None), (lf(1, "a"), {"base": ["legacy"]})]
    assert base_for(prev, None, older, CKPTS) == ["c1", "c2", "c3", "legacy"]
    assert base_for(prev, None, [(lf(2, "b"), None)], CKPTS) == sorted(c.name for c in CKPTS)  # none readable


def test_orphans_are_older_epochs_and_tie_losers_outside_the_lineage():
    lin = Lineage(2, "b", ["c1"])
    entry = {c.name: {"name": c.name, "epoch": c.epoch, "holder": c.holder} for c in CKPTS}
    assert [n for n in entry if lin.contains(entry[n])] == ["c1", "c2"]
    assert [n for n in entry if lin.orphan(entry[n])] == ["legacy", "c2-loser"]  # c3: a newer epoch, not ours


# -- taking, checking, renewing -----------------------------------------------------------------------------------
class Box:
    """One agent's view of the durable target, with its own box id and a process table (`alive`)."""

    def __init__(self, tmp, clock: FakeClock, box: str = BOX, host: str = "gpu1", alive: bool = True) -> None:
        self.target = LocalPathTarget(str(tmp / "durable"), "r")
        self.clock = clock
        self.box = box
        self.host = host
        self.alive = alive
        self.committed: List[Dict[str, Any]] = []

    def take(self, take_over: bool = False, ttl: float = TTL) -> RunLease:
        return RunLease.take(self.target, "r", ttl, take_over, self.clock, lambda: self.committed, 1.0,
                             host=self.host, box=self.box, pid=4242, start_time=77,
                             alive=lambda pid, start: self.alive)


def leases_dir(tmp) -> str:
    return str(tmp / "durable" / "r" / "leases")


def test_the_first_take_is_epoch_1_with_every_committed_checkpoint_as_its_base(tmp_path):
    box = Box(tmp_path, FakeClock())
    box.committed = [{"name": "old.pt"}]  # committed by an agent without leases
    lease = box.take()
    assert (lease.epoch, lease.lineage.base, lease.lineage.local_ok) == (1, frozenset({"old.pt"}), True)
    with open(os.path.join(leases_dir(tmp_path), lease.mine.name)) as f:
        doc = json.load(f)
    assert doc["schema"] == "onbox.lease/1" and doc["agent"] == {"pid": 4242, "start_time": 77}
    assert doc["host"] == "gpu1" and doc["base"] == ["old.pt"] and doc["resumed_from"] is None


def test_a_live_lease_of_another_box_refuses_the_launch_naming_it(tmp_path):
    clock = FakeClock()
    first = Box(tmp_path, clock, box=OTHER, host="gpu2").take()
    clock.advance(5)
    with pytest.raises(LeaseRefused) as e:
        Box(tmp_path, clock).take()
    assert "held by another agent: %s on gpu2 (lease epoch 1), renewed 5 s ago" % first.holder in e.value.message
    assert "--take-over" in (e.value.hint or "") and int(e.value.exit_code) == 2
    assert len(os.listdir(leases_dir(tmp_path))) == 1  # the refused launch wrote nothing


def test_an_expired_or_released_lease_does_not_refuse(tmp_path):
    clock = FakeClock()
    other = Box(tmp_path, clock, box=OTHER)
    other.take()
    clock.advance(TTL + 0.1)
    second = Box(tmp_path, clock).take()
    assert second.epoch == 2 and not second.lineage.local_ok  # another box held it last
    second.close(release=True)
    assert Box(tmp_path, clock, box="gpu3-00000000").take().epoch == 3  # released: no wait for the ttl


def test_this_boxs_own_dead_agent_does_not_block_a_relaunch_but_a_live_one_does(tmp_path):
    clock = FakeClock()
    Box(tmp_path, clock).take()
    with pytest.raises(LeaseRefused):
        Box(tmp_path, clock, alive=True).take()  # another live agent of this box (another ONBOX_HOME)
    again = Box(tmp_path, clock, alive=False).take()  # its own agent ended (preempted, stopped): not blocked
    assert again.epoch == 2 and again.lineage.local_ok  # and its local checkpoints are this lineage's


def test_take_over_supersedes_a_live_lease_loudly_and_fences_its_holder(tmp_path):
    clock = FakeClock()
    old = Box(tmp_path, clock, box=OTHER, host="gpu2").take()
    said: List[Any] = []
    old.attach(lambda event, **f: said.append((event, f)))
    new = Box(tmp_path, clock).take(take_over=True)
    events: List[Any] = []
    new.attach(lambda event, **f: events.append((event, f)))
    assert [e for e, _ in events] == ["lease_taken_over", "lease_taken"]
    with pytest.raises(Fenced) as e:
        old.check("the manifest of ckpt-9")
    assert e.value.info["newer_holder"] == new.holder and e.value.info["newer_epoch"] == 2
    assert e.value.info["host"] == "gpu1" and e.value.info["refused"] == "the manifest of ckpt-9"
    with pytest.raises(Fenced):
        old.check("the index")  # fenced for good, said once
    assert [e for e, _ in said].count("fenced") == 1
    new.check("the index")  # the new holder writes on


def test_the_lineage_excludes_what_the_old_holder_commits_after_the_take(tmp_path):
    clock = FakeClock()
    a = Box(tmp_path, clock, box=OTHER)
    lease_a = a.take()
    b = Box(tmp_path, clock)
    b.committed = [{"name": "a1", "epoch": 1, "holder": lease_a.holder}]
    lease_b = b.take(take_over=True)
    assert lease_b.lineage.base == frozenset({"a1"})
    late = {"name": "a2", "epoch": 1, "holder": lease_a.holder}  # the race window
    assert lease_b.lineage.orphan(late) and not lease_b.lineage.contains(late)


def test_a_launch_that_loses_the_tie_stands_back(tmp_path):
    clock = FakeClock()
    box = Box(tmp_path, clock, box="zz-box")
    real_put = box.target.put_lease

    def put_and_race(name: str, doc: Dict[str, Any]) -> None:
        real_put(name, doc)  # another launch wrote the same epoch at the same moment, with a lower holder
        real_put(lease_name(doc["epoch"], "aa-box-00000000"), dict(doc, holder="aa-box-00000000", host="gpu9"))

    box.target.put_lease = put_and_race  # type: ignore[method-assign]
    with pytest.raises(LeaseRefused) as e:
        box.take()
    assert "taken at the same moment by another agent: aa-box-00000000 on gpu9" in e.value.message


def test_a_check_that_cannot_list_the_leases_fails_the_write(tmp_path, monkeypatch):
    lease = Box(tmp_path, FakeClock()).take()

    def unreachable() -> List[str]:
        raise SyncFailed("durable storage unreachable")

    monkeypatch.setattr(lease.store.target, "list_leases", unreachable)
    with pytest.raises(SyncFailed):
        lease.check("the manifest")  # fail closed: no write without a look
    assert lease.fence is None


def test_renewals_come_every_third_of_the_ttl_and_checks_in_between(tmp_path):
    clock = FakeClock()
    lease = Box(tmp_path, clock).take()
    path = os.path.join(leases_dir(tmp_path), lease.mine.name)
    taken = lease.doc["renewed_at"]
    clock.advance(TTL / 3 - 1)
    lease.tick()
    with open(path) as f:
        assert json.load(f)["renewed_at"] == taken  # only a check
    clock.advance(1)
    lease.tick()
    with open(path) as f:
        assert json.load(f)["renewed_at"] == taken + TTL / 3
    lease.resumed("ckpt-7.pt")
    with open(path) as f:
        assert json.load(f)["resumed_from"] == "ckpt-7.pt"


def test_a_fenced_holder_neither_renews_nor_releases(tmp_path):
    clock = FakeClock()
    old = Box(tmp_path, clock, box=OTHER).take()
    Box(tmp_path, clock).take(take_over=True)
    before = os.listdir(leases_dir(tmp_path))
    clock.advance(TTL)
    old.tick()
    assert old.fence is not None
    old.close(release=True)
    with open(os.path.join(leases_dir(tmp_path), old.mine.name)) as f:
        doc = json.load(f)
    assert doc["released_at"] is None and doc["renewed_at"] == old.doc["taken_at"]
    assert os.listdir(leases_dir(tmp_path)) == before  # and nothing is ever deleted


def test_a_passive_committer_writes_under_the_agents_recorded_lease_only(tmp_path):
    clock = FakeClock()
    target = LocalPathTarget(str(tmp_path / "durable"), "r")
    PassiveLease(target, "r", None).check("the manifest")  # a run without leases: nothing to fence
    lease = Box(tmp_path, clock).take()
    PassiveLease(target, "r", {"epoch": lease.epoch, "holder": lease.holder}).check("the manifest")
    with pytest.raises(Fenced):
        PassiveLease(target, "r", None).check("the manifest")  # leases exist, and this box holds none
    Box(tmp_path, clock, box=OTHER).take(take_over=True)
    with pytest.raises(Fenced):
        PassiveLease(target, "r", {"epoch": lease.epoch, "holder": lease.holder}).check("the manifest")


def test_a_lease_renewed_in_the_future_says_the_clock_skew_not_zero_seconds_ago(tmp_path):
    """Issue 30.14: a lease renewed a year ahead of this box's clock read "renewed 0 s ago"; it stays live (the
    safe side: never two writers), and the refusal says why."""
    clock = FakeClock()
    Box(tmp_path, clock, box=OTHER).take()
    [f] = os.listdir(leases_dir(tmp_path))
    path = os.path.join(leases_dir(tmp_path), f)
    with open(path) as fh:
        doc = json.load(fh)
    with open(path, "w") as fh:
        json.dump(dict(doc, renewed_at=clock.time() + 365 * 86400), fh)
    with pytest.raises(LeaseRefused, match=r"renewed 365\.0 days IN THE FUTURE by this box's clock \(the clocks of "
                                           r"the two boxes disagree"):
        Box(tmp_path, clock).take()
    assert renewed_ago(100.0, 103.0) == "0 s ago"  # NTP's ordinary disagreement is not news
    assert renewed_ago(100.0, 40.0) == "60 s ago" and renewed_ago(100.0, None) == "at an unknown time"
    assert renewed_ago(100.0, 100.0 + 7200) == "2.0 h IN THE FUTURE by this box's clock (the clocks of the two " \
                                               "boxes disagree by that much, or the lease was written by hand)"


def test_a_passive_committer_writes_only_where_the_lease_it_recorded_is(tmp_path):
    """Issue 30.1: a lease holds a run on one target. A box whose run took epoch 3 on D2 must not write into the
    run on D (epoch 1 there would not fence it), nor, in the same-epoch variant, one whose holder sorts first."""
    clock = FakeClock()
    here = Box(tmp_path / "D", clock).take()  # the run on D: epoch 1, held by another box
    d2 = [Box(tmp_path / "D2", clock, box=OTHER).take(take_over=True) for _ in range(3)][-1]  # this box's run on D2: epoch 3
    on_d = LocalPathTarget(str(tmp_path / "D" / "durable"), "r")
    recorded = {"epoch": d2.epoch, "holder": d2.holder, "durable": d2.store.url}
    with pytest.raises(NotHeldHere, match=r"lease \(epoch 3, %s\) on %s, and no such lease is on" % (
            d2.holder, d2.store.url)) as e:
        PassiveLease(on_d, "r", recorded).check("the manifest")
    assert "leave out --durable" in e.value.hint
    same = Box(tmp_path / "D3", clock, box="aaa-00000000").take()  # epoch 1, a holder that sorts before D's
    assert same.epoch == here.epoch and same.holder < here.holder
    with pytest.raises(NotHeldHere):
        PassiveLease(on_d, "r", {"epoch": same.epoch, "holder": same.holder}).check("the index")
    with pytest.raises(NotHeldHere):  # a target without any lease is no exception for a box that holds one
        PassiveLease(LocalPathTarget(str(tmp_path / "empty"), "r"), "r", recorded).check("the manifest")
    # the false-positive side: on its own target the recorded lease writes, whatever other targets hold
    PassiveLease(d2.store.target, "r", recorded).check("the manifest")
    PassiveLease(on_d, "r", {"epoch": here.epoch, "holder": here.holder}).check("the manifest")


# -- lease files are untrusted input ------------------------------------------------------------------------------
GOOD = document("r", lf(1, "gpu2-99887766-00000000"), "gpu2", 10, 5, 1_700_000_000.0, TTL, ["c1"])
DEEP = "[" * 100 + "]" * 100


@pytest.mark.parametrize("content, problem", [
    (b"", "not JSON"),
    (b"{\"schema\": ", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (DEEP.encode(), "nests more than 64 levels"),
    (b"[1]", "not a JSON object"),
    (json.dumps(dict(GOOD, schema="onbox.lease/9")).encode(), "schema"),
    (json.dumps(dict(GOOD, run="other")).encode(), "a lease of run 'other'"),
    (json.dumps(dict(GOOD, epoch=7)).encode(), "its file name says 1"),
    (json.dumps(dict(GOOD, holder="x")).encode(), "its file name says"),
    (json.dumps(dict(GOOD, host="")).encode(), "host"),
    (json.dumps(dict(GOOD, agent={"pid": "10"})).encode(), "agent.pid"),
    (json.dumps(dict(GOOD, renewed_at=float("nan"))).encode(), "renewed_at"),
    (json.dumps(dict(GOOD, renewed_at=True)).encode(), "renewed_at"),
    (json.dumps(dict(GOOD, ttl=-1)).encode(), "ttl"),
    (json.dumps(dict(GOOD, base="c1")).encode(), "base is not a list"),
    (json.dumps(dict(GOOD, base=["../../etc"])).encode(), "base[0]"),
    (json.dumps(dict(GOOD, resumed_from="a/b")).encode(), "resumed_from"),
    (json.dumps(dict(GOOD, ended="running")).encode(), "ended 'running' is not one of"),
    (json.dumps(dict(GOOD, ended=["done"])).encode(), "ended"),
    (b" " * (4 * 1024 * 1024 + 1), "too large"),
])
def test_a_corrupt_lease_file_is_a_clear_refusal_and_is_kept(tmp_path, content, problem):
    clock = FakeClock()
    path = os.path.join(leases_dir(tmp_path), lf(1, GOOD["holder"]).name)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(content)
    store = LeaseStore(LocalPathTarget(str(tmp_path / "durable"), "r"), "r")
    with pytest.raises(BadLease) as e:
        store.read(lf(1, GOOD["holder"]))
    assert problem in str(e.value) and path in str(e.value)
    with pytest.raises(LeaseRefused) as refused:  # the lease that holds the run cannot be read: refused ...
        Box(tmp_path, clock).take()
    assert "cannot be read" in refused.value.message and problem in refused.value.message
    lease = Box(tmp_path, clock).take(take_over=True)  # ... unless --take-over, which supersedes it
    assert lease.epoch == 2
    with open(path, "rb") as f:
        assert f.read() == content  # never deleted, never rewritten


def test_a_fifo_or_a_directory_as_a_lease_file_is_refused_without_hanging(tmp_path):
    d = leases_dir(tmp_path)
    os.makedirs(d)
    os.mkfifo(os.path.join(d, lf(1, "a").name))
    os.mkdir(os.path.join(d, lf(2, "b").name))
    store = LeaseStore(LocalPathTarget(str(tmp_path / "durable"), "r"), "r")
    for f, why in ((lf(1, "a"), "FIFO"), (lf(2, "b"), "directory")):
        with pytest.raises(BadLease, match=why):
            store.read(f)


def test_a_corrupt_newer_lease_still_fences(tmp_path):
    """Who holds a run is decided by names alone: a newer lease whose content cannot be read fences all the same
    (the safe side)."""
    lease = Box(tmp_path, FakeClock()).take()
    with open(os.path.join(leases_dir(tmp_path), lf(2, "x").name), "w") as f:
        f.write("garbage")
    with pytest.raises(Fenced) as e:
        lease.check("the index")
    assert e.value.info["newer_holder"] == "x" and e.value.info["host"] is None


def test_a_lease_at_the_last_epoch_refuses_instead_of_making_an_invisible_one(tmp_path):
    d = leases_dir(tmp_path)
    os.makedirs(d)
    with open(os.path.join(d, lf(9_999_999_999, "x").name), "w") as f:
        f.write("{}")
    with pytest.raises(LeaseRefused, match="last epoch"):
        Box(tmp_path, FakeClock()).take(take_over=True)


def test_a_requeued_slurm_job_is_not_blocked_by_its_own_earlier_incarnation(tmp_path):
    """Slurm runs one incarnation of a job at a time: a live lease of the same job, from another node after a node
    failure, belongs to an agent that is gone."""
    clock = FakeClock()
    first = Box(tmp_path, clock, box=OTHER)
    RunLease.take(first.target, "r", TTL, False, clock, lambda: [], 1.0, box=OTHER, slurm_job="4242")
    with pytest.raises(LeaseRefused):
        RunLease.take(first.target, "r", TTL, False, clock, lambda: [], 1.0, box=BOX, slurm_job="4243")
    again = RunLease.take(first.target, "r", TTL, False, clock, lambda: [], 1.0, box=BOX, slurm_job="4242")
    assert again.epoch == 2 and again.doc["slurm_job"] == "4242"


def test_a_released_lease_says_how_the_run_ended_and_what_a_relaunch_reads_of_it(tmp_path):
    """close(release, ended): the release records the final state; durable_facts (what `onbox match` reports for a
    relaunch on another box) reads it back with the newest checkpoint's step and whether the lease would block."""
    from onbox.checkpoints.runfacts import durable_facts

    clock = FakeClock()
    durable = str(tmp_path / "durable")
    assert durable_facts(durable, "r", TTL, now=clock.time())["exists"] is False  # nothing there yet
    lease = Box(tmp_path, clock, box=OTHER, host="gpu2").take()
    facts = durable_facts(durable, "r", TTL, now=clock.time(), box=BOX, alive=lambda pid, start: True)
    assert facts["exists"] and facts["step"] is None and facts["checkpoints"] == 0
    assert facts["lease"]["live"] and facts["lease"]["blocks"] and facts["lease"]["host"] == "gpu2"
    mine = durable_facts(durable, "r", TTL, now=clock.time(), box=OTHER, alive=lambda pid, start: False)
    assert mine["lease"]["live"] and not mine["lease"]["blocks"]  # the same box's agent is gone: no block
    for step in (5, 10):
        ck = os.path.join(durable, "r", "checkpoints", "step_%05d" % step)
        os.makedirs(ck)
        with open(os.path.join(ck, "model.dat"), "wb") as f:
            f.write(b"x")
        with open(os.path.join(ck, "MANIFEST.json"), "w") as f:  # as onbox writes one (see test_controller_ssh)
            json.dump({"step": step, "created": 1767225600.0 + step, "files": [
                {"path": "model.dat", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}]}, f)
    lease.close(release=True, ended="done")
    with open(os.path.join(leases_dir(tmp_path), lease.mine.name)) as f:
        doc = json.load(f)
    assert doc["ended"] == "done" and doc["released_at"] is not None
    facts = durable_facts(durable, "r", TTL, now=clock.time(), box=BOX, alive=lambda pid, start: True)
    assert (facts["step"], facts["checkpoint"], facts["checkpoints"]) == (10, "step_00010", 2)
    assert facts["lease"]["ended"] == "done" and not facts["lease"]["live"] and not facts["lease"]["blocks"]
    again = Box(tmp_path, clock).take()
    again.close(release=True, ended="fenced")  # not a way a released run ends: not recorded
    with open(os.path.join(leases_dir(tmp_path), again.mine.name)) as f:
        assert "ended" not in json.load(f)
