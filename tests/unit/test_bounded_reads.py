"""The readers of files a user, a box or a peer controls (issue 19): token files, JSON state files, the box
inventory, tunnels.json, pulls.json, the queue journal, node groups and peer notices. Each reads a regular file
only, within a size bound, nested at most 64 deep, and says which file and why when it refuses."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys

import pytest

from controller.boxes import inventory as boxes
from controller.boxes import tunnel
from controller.results import pull
from controller.tracker.pulled import PullsView
from onbox import fsutil, untrusted
from onbox.errors import UsageError
from onbox.multinode import notices
from onbox.queue.journal import Journal

DEEP = "[" * 100000 + "]" * 100000


def write(content: bytes):
    def make(path: str) -> None:
        with open(path, "wb") as f:
            f.write(content)
    return make


# -- token files: one reader, bounded, its refusals are OSErrors with a reason ----------------------------------------
def test_a_token_file_is_its_first_line_whatever_the_line_ends(tmp_path):
    tok = tmp_path / "tok"
    tok.write_bytes(b"  s3cret \r\nsecond line\n")
    assert fsutil.read_token_file(str(tok)) == "s3cret"
    tok.write_bytes(b"old-mac\rrest")
    assert fsutil.read_token_file(str(tok)) == "old-mac"


@pytest.mark.parametrize("make, why", [
    (lambda p: os.symlink("/dev/zero", p), "it is a character device, not a regular file"),
    (lambda p: os.mkfifo(p), "it is a FIFO (named pipe), not a regular file"),
    (write(b"t" * (untrusted.TOKEN_MAX_BYTES + 1)), "it is too large"),
    (write(b"\xff\xfetoken\n"), "it is not UTF-8 text (byte 0)"),
])
def test_a_token_file_that_is_no_token_is_refused_as_an_oserror_saying_why(tmp_path, make, why):
    path = str(tmp_path / "tok")
    make(path)
    with pytest.raises(fsutil.TokenFileRefused) as e:
        fsutil.read_token_file(path)
    assert isinstance(e.value, OSError) and e.value.strerror.startswith(why) and e.value.filename == path


def test_the_tracker_reads_its_token_file_with_the_agents_reader():
    from controller.commands.tracker import read_token_file

    with pytest.raises(UsageError, match="cannot read the token file /dev/zero: it is a character device"):
        read_token_file("/dev/zero")


# -- JSON state files ------------------------------------------------------------------------------------------------
def test_a_json_state_file_nested_too_deep_is_a_value_error_not_a_recursion_error(tmp_path):
    state = tmp_path / "state.json"
    state.write_text(DEEP)
    with pytest.raises(untrusted.UntrustedInput, match="nests more than 64 levels"):
        fsutil.read_json(str(state))
    with pytest.raises(untrusted.UntrustedInput, match="too large"):
        fsutil.read_json(str(state), limit=1024)


def test_a_corrupt_state_json_says_why_without_naming_the_file_twice(tmp_path):
    from onbox.supervisor.rundir import RunDir

    rd = RunDir(str(tmp_path))
    os.mkfifo(rd.state_path)
    assert rd.load_state() == (None, "it is a FIFO (named pipe), not a regular file: refusing to read it")
    os.unlink(rd.state_path)
    with open(rd.state_path, "w") as f:
        f.write(DEEP)
    assert rd.load_state() == (None, "it nests more than 64 levels deep")


# -- the config dir and the inventory --------------------------------------------------------------------------------
def test_a_config_dir_that_is_a_file_is_refused_not_read_as_empty(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path / "afile"))
    with pytest.raises(UsageError, match=r"ONBOX_CONFIG_DIR=.*afile is not a directory"):
        boxes.Inventory().load()
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path / "afile" / "onbox"))
    with pytest.raises(UsageError, match=r"is under .*afile, which is not a directory"):
        tunnel.Records()
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path / "not-yet"))
    assert boxes.config_dir() == str(tmp_path / "not-yet")  # made by the first write


def test_both_inventory_files_are_refused_naming_both(tmp_path):
    (tmp_path / "boxes.toml").write_text('[boxes.a]\nhost = "h"\n')
    (tmp_path / "boxes.json").write_text('{"boxes": {"a": {"host": "elsewhere"}}}')
    inv = boxes.Inventory(str(tmp_path))
    with pytest.raises(UsageError, match=r"both .*boxes.toml and .*boxes.json exist"):
        inv.resolve("a")
    os.unlink(tmp_path / "boxes.toml")
    assert inv.resolve("a").host == "elsewhere"


@pytest.mark.parametrize("content, says", [(DEEP, "nests more than 64 levels"), ("[]", "not a JSON object"),
                                           ("{nope", "not valid JSON")])
def test_a_json_inventory_is_read_with_the_same_bounds(tmp_path, content, says):
    (tmp_path / "boxes.json").write_text(content)
    with pytest.raises(UsageError, match=says):
        boxes.Inventory(str(tmp_path)).load()


# -- tunnels.json ----------------------------------------------------------------------------------------------------
GOOD = {"box": "b", "local": "[::1]:8787", "remote_port": 40000, "spec_port": 40000, "master_pid": 12}


@pytest.mark.parametrize("entry, says", [
    (dict(GOOD, local="127.0.0.1:abc"), "the tracker address '127.0.0.1:abc' is not host:port"),
    (dict(GOOD, local="127.0.0.1:\u0663"), "is not host:port"),
    (dict(GOOD, local=":8787"), "is not host:port"),
    (dict(GOOD, remote_port="40000"), "remote_port '40000' is not a port number"),
    (dict(GOOD, master_pid=True), "master_pid True is not a process id"),
    (dict(GOOD, extra=1), "entry 1 is not"),
    ("b", "entry 1 is not"),
])
def test_a_tunnel_entry_that_is_not_a_tunnel_is_a_damaged_record(tmp_path, entry, says):
    (tmp_path / "tunnels.json").write_text(json.dumps({"tunnels": [entry]}))
    with pytest.raises(UsageError, match="tunnel record .* is damaged: .*%s" % says.replace("(", r"\(")):
        tunnel.Records(str(tmp_path)).load()


def test_a_good_tunnel_record_loads(tmp_path):
    (tmp_path / "tunnels.json").write_text(json.dumps({"tunnels": [GOOD]}))
    assert tunnel.Records(str(tmp_path)).load() == [tunnel.Tunnel(**GOOD)]


# -- pulls.json: the teardown gate and the tracker -------------------------------------------------------------------
@pytest.mark.parametrize("content, says", [
    (DEEP, "nests more than 64 levels"), ('{"pulls": []}', 'not {"pulls"'),
    ('{"pulls": {"b/r": {"checkpoints": []}}}', "entry 'b/r' is not"),
    ('{"pulls": {"b/r": {"checkpoints": {"c": 1}}}}', "entry 'b/r' is not"),
])
def test_a_pulls_record_that_is_no_record_is_corrupt_for_the_gate(tmp_path, content, says):
    path = tmp_path / "pulls.json"
    path.write_text(content)
    with pytest.raises(UsageError, match="pulls record .* is corrupt: .*%s" % says):
        pull.PullsRecord(str(path)).get("b", "r")


def test_the_tracker_marks_every_pull_unknown_when_the_record_is_refused(tmp_path):
    path = tmp_path / "pulls.json"
    os.symlink("/dev/zero", path)
    view = PullsView(str(path))
    view.refresh()
    assert view.problem == "the pulls record %s is unreadable: it is a character device, not a regular file: " \
                           "refusing to read it" % path
    assert view.verdict("b", "r", {"name": "c"}) == {"status": "unknown", "text": view.problem}


def test_a_pulls_record_without_its_pulls_table_is_an_empty_one(tmp_path):
    path = tmp_path / "pulls.json"
    path.write_text("{}")
    view = PullsView(str(path))
    view.refresh()
    assert view.problem is None and view.verdict("b", "r", {"name": "c"})["status"] == "not_pulled"
    assert pull.PullsRecord(str(path)).get("b", "r") == {}


def test_a_pulled_manifest_nested_too_deep_counts_as_no_local_copy(tmp_path):
    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / "MANIFEST.json").write_text('{"digest": %s%s}' % ("[" * 5000, "]" * 5000))
    path = tmp_path / "pulls.json"
    path.write_text(json.dumps({"pulls": {"b/r": {"checkpoints": {"c": {"ok": True, "path": str(ckpt)}}}}}))
    view = PullsView(str(path))
    view.refresh()
    assert view.verdict("b", "r", {"name": "c", "digest": "sha256:x"})["status"] == "stale"


@pytest.mark.timeout(60)
def test_the_box_side_listing_skips_what_it_must_not_read(tmp_path):
    """The listing pull and the gate read (`onbox checkpoints --all --json`, the box's own python): a FIFO
    state.json, progress.json or checkpoint_status.json, a deep config.json and a deep manifest neither hang it nor end it in a RecursionError. A manifest
    the box refuses is still listed (with its problem): the gate must not take an older one for the newest."""
    run = tmp_path / "home" / "runs" / "r"
    run.mkdir(parents=True)
    durable = tmp_path / "durable"
    (run / "config.json").write_text(json.dumps({"durable": str(durable)}))
    for name in ("state.json", "progress.json", "checkpoint_status.json"):
        os.mkfifo(run / name)
    other = tmp_path / "home" / "runs" / "deep"
    other.mkdir()
    (other / "config.json").write_text(DEEP)
    for name, manifest in (("c-1", DEEP), ("c-2", json.dumps({"step": 2, "files": [{"size": "x"}, {"size": 3}]}))):
        (durable / "r" / "checkpoints" / name).mkdir(parents=True)
        (durable / "r" / "checkpoints" / name / "MANIFEST.json").write_text(manifest)
    os.mkfifo(durable / "r" / "checkpoints" / "c-3")  # no dir: no checkpoint
    (durable / "r" / "checkpoints" / "c-4").mkdir()
    os.mkfifo(durable / "r" / "checkpoints" / "c-4" / "MANIFEST.json")  # never opened for reading
    out = subprocess.run([sys.executable, "-m", "onbox", "checkpoints", "--all", "--json"], capture_output=True,
                         text=True, timeout=30, env={"ONBOX_HOME": str(tmp_path / "home"), "PATH": os.environ["PATH"]})
    assert out.returncode == 0, out.stderr
    runs = {d["run"]: d for d in json.loads(out.stdout)["runs"]}
    assert runs["deep"]["durable"] is None and "nests more than 64 levels deep" in runs["deep"]["problem"]
    assert runs["r"]["state"] is None
    assert [(c["name"], c["step"], c["bytes"]) for c in runs["r"]["manifests"]] == [("c-1", None, 0), ("c-2", 2, 3)]
    assert all("refused" in c["problem"] for c in runs["r"]["manifests"])
    docs = {d["run"]: d for d in (pull._run_doc(boxes.Box(name="b", host="h"), d) for d in runs.values())}
    assert [c.name for c in docs["r"]["checkpoints"]] == ["c-1", "c-2"] and docs["deep"]["checkpoints"] == []


# -- the queue journal, node groups, peer notices --------------------------------------------------------------------
def test_a_journal_that_is_no_file_is_refused_and_a_deep_line_is_skipped(tmp_path):
    j = Journal(str(tmp_path))
    with open(j.path, "w") as f:
        f.write('{"op": "add", "id": 1, "name": "a", "config": {}}\n%s\n' % DEEP)
    entries, _ = j.read()
    assert list(entries) == [1] and j.problems == ["%s line 2 is not a queue record; skipped" % j.path]
    os.unlink(j.path)
    os.symlink("/dev/zero", j.path)
    with pytest.raises(UsageError, match=r"queue journal .* is a character device"):
        j.read()


def test_a_node_group_that_is_a_fifo_is_refused_at_once(tmp_path):
    from onbox.multinode.role import load_group

    path = str(tmp_path / "group.json")
    os.mkfifo(path, 0o600)
    with pytest.raises(UsageError, match=r"the node group .* is a FIFO"):
        load_group(path)


def test_an_authentic_notice_nested_too_deep_is_dropped_not_a_crash_of_the_listener():
    key = b"k" * 32
    body = b"[" * 4000 + b"]" * 4000  # fits one datagram, past the json module's recursion limit
    data = notices.MAGIC + hmac.new(key, notices.MAGIC + body, hashlib.sha256).digest() + body
    assert notices.unseal(key, data) is None
    assert notices.unseal(key, notices.seal(key, {"kind": "stop"})) == {"kind": "stop"}


# -- onbox's own files: the heartbeat spool, cidfiles, the run lock ---------------------------------------------------
@pytest.mark.timeout(30)  # before issue 19 a FIFO here hung the agent's heartbeat thread forever
def test_the_spool_reads_its_state_and_beats_bounded_and_drops_what_it_cannot_send(tmp_path):
    from onbox.heartbeat.spool import SeqCounter, Spool

    d = tmp_path / "spool"
    d.mkdir()
    os.mkfifo(d / "state.json")
    assert Spool(str(d)).dropped == 0  # a FIFO reads as "no state", at once
    os.unlink(d / "state.json")
    (d / "state.json").write_text(DEEP)
    sp = Spool(str(d))
    assert sp.dropped == 0  # nested 100,000 deep: no state, not a RecursionError
    sp.put(1, {"seq": 1})
    sp.put(2, {"seq": 2})
    sp.put(3, {"seq": 3})
    os.unlink(sp._path(1))
    os.mkfifo(sp._path(1))
    with open(sp._path(2), "w") as f:
        f.write(DEEP)
    assert sp.pending(10) == [(3, {"seq": 3})] and sp.backlog() == 1  # unsendable beats are dropped, not a crash
    (tmp_path / "seq.json").write_text(DEEP)
    assert SeqCounter(str(tmp_path / "seq.json"), first=7).next() == 7


@pytest.mark.timeout(30)  # before issue 19 a FIFO cidfile hung the stop path and the holder scan
def test_a_cidfile_that_is_a_fifo_is_skipped_for_the_one_before(tmp_path):
    from types import SimpleNamespace

    from onbox.gpu.ownership import container_ids
    from onbox.launch.container import ContainerSeam

    cid = "ab" * 32
    (tmp_path / "containers").mkdir()
    (tmp_path / "containers" / "0.cid").write_text(cid + "\n")
    os.mkfifo(tmp_path / "containers" / "1.cid")
    cfg = SimpleNamespace(command=["python", "train.py"], docker_image="img")
    seam = ContainerSeam(None, cfg, "r", str(tmp_path), str(tmp_path / "ck"), {})
    assert seam._ref() == cid
    assert container_ids(str(tmp_path)) == {0: cid}


@pytest.mark.timeout(30)  # before issue 19 a FIFO lock file hung a second `onbox run --name` saying who holds it
def test_a_lock_file_that_is_no_pid_file_has_no_owner(tmp_path):
    from onbox.supervisor.detach import RunLock

    os.mkfifo(tmp_path / "lock")
    assert RunLock(str(tmp_path / "lock")).owner() is None
    (tmp_path / "lock2").write_text("4242\n")
    assert RunLock(str(tmp_path / "lock2")).owner() == 4242
