"""Node groups over SSH: the group document, the authenticated UDP notices between agents (real sockets on
loopback), what a peer's notice does to an agent, node 0's resume point, address picking, the teardown gate."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from onbox.errors import UsageError
from onbox.multinode import hooks as mn
from onbox.multinode.notices import PeerChannel, seal, unseal
from onbox.multinode.role import Peer, child_vars, load_group, node_run_name, parse_group, read_group_stream
from tests.polling import wait_for

KEY = "ab" * 32


def free_udp() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doc(rank=0, nnodes=2, ports=None, key=KEY, group="0123456789abcdef"):
    ports = ports or [40000 + i for i in range(nnodes)]
    return {"schema": "onbox.node_group/1", "group": group, "run": "big", "rank": rank, "nnodes": nnodes,
            "master_addr": "127.0.0.1", "master_port": 29500,
            "peers": [{"rank": i, "addr": "127.0.0.1", "port": ports[i]} for i in range(nnodes)], "key": key}


def test_the_group_document_is_checked_field_by_field_and_never_shows_its_key(tmp_path):
    g = parse_group(doc(rank=1), "t")
    assert g.role.rank == 1 and not g.role.primary and g.role.run_name("big") == "big.node1"
    assert node_run_name("big", 0) == "big" and g.me == Peer(1, "127.0.0.1", 40001)
    assert "key" not in g.public() and KEY not in repr(g)
    assert parse_group(g.to_doc(), "again") == g
    env = child_vars(g)
    assert env["NODE_RANK"] == env["PET_NODE_RANK"] == "1" and env["PET_RDZV_BACKEND"] == "static"
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "127.0.0.1" and env["PET_NNODES"] == "2"
    for bad, what in ((dict(doc(), key="ab" * 8), "key"), (dict(doc(), rank=2), "rank"), (dict(doc(), nnodes=1), "nnodes"),
                      (dict(doc(), master_addr="-oProxy"), "master_addr"), (dict(doc(), peers=[]), "peers"),
                      (dict(doc(), schema="x"), "not a"), (dict(doc(), run="../x"), "run")):
        with pytest.raises(UsageError) as e:
            parse_group(bad, "t")
        assert what in e.value.message and KEY not in e.value.message
    with pytest.raises(UsageError, match="not JSON"):
        read_group_stream(b"{oops")
    # a key of an odd number of hex digits is no key; a document nested too deep is no JSON: each a UsageError
    # (exit 2), never a traceback from bytes.fromhex or the JSON decoder
    with pytest.raises(UsageError, match="even number") as e:
        parse_group(dict(doc(), key="a" * 65), "t")
    assert "a" * 65 not in e.value.message
    with pytest.raises(UsageError, match="not JSON"):
        read_group_stream(b"[" * 100000)
    deep = tmp_path / "deep.json"
    deep.write_bytes(b"[" * 100000)
    os.chmod(deep, 0o600)
    with pytest.raises(UsageError, match="not JSON"):
        load_group(str(deep))
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc()))
    os.chmod(path, 0o644)
    with pytest.raises(UsageError, match="readable by others"):
        load_group(str(path))
    os.chmod(path, 0o600)
    assert load_group(str(path)).rank == 0


def test_seal_and_unseal_refuse_a_wrong_key_and_a_changed_byte():
    data = seal(b"k" * 32, {"a": 1})
    assert unseal(b"k" * 32, data) == {"a": 1}
    assert unseal(b"x" * 32, data) is None
    assert unseal(b"k" * 32, data[:-2] + b"2}") is None
    assert unseal(b"k" * 32, b"OBN1short") is None


@pytest.fixture
def pair():
    ports = [free_udp(), free_udp()]
    got = {0: [], 1: []}
    chans = [PeerChannel(parse_group(doc(rank=i, ports=ports), "t"),
                         on_notice=lambda kind, rank, msg, i=i: got[i].append((kind, rank, msg.get("lead"))),
                         answer=lambda: {"seq": 3, "name": "step_9", "step": 9}).start() for i in range(2)]
    yield chans, got, ports
    for c in chans:
        c.close(linger=0)


@pytest.mark.integration
def test_a_notice_reaches_the_peer_once_and_is_acknowledged(pair):
    chans, got, _ports = pair
    sender = chans[1].broadcast("preempt", lead=12.5, source="signal:SIGTERM")
    wait_for(lambda: got[0], 5, "node 0 to hear node 1")
    sender.join(5)
    assert not sender.is_alive()  # acknowledged: the resends stopped long before SEND_TRIES
    assert got[0] == [("preempt", 1, 12.5)] and got[1] == []
    reply = chans[1].ask(0, timeout=2)
    assert reply["seq"] == 3 and reply["name"] == "step_9" and reply["kind"] == "answer"


@pytest.mark.integration
def test_forged_foreign_and_self_datagrams_are_dropped(pair):
    chans, got, ports = pair
    before = chans[0].dropped
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        base = {"g": "0123456789abcdef", "from": 1, "id": "x1", "kind": "preempt", "lead": 1, "t": time.time()}
        s.sendto(seal(bytes.fromhex("cd" * 32), base), ("127.0.0.1", ports[0]))  # another key
        s.sendto(seal(bytes.fromhex(KEY), dict(base, g="ffffffffffffffff")), ("127.0.0.1", ports[0]))  # another group
        s.sendto(seal(bytes.fromhex(KEY), dict(base, **{"from": 0})), ("127.0.0.1", ports[0]))  # "from" itself
        s.sendto(seal(bytes.fromhex(KEY), dict(base, **{"from": 7})), ("127.0.0.1", ports[0]))  # not a node
        s.sendto(b"garbage", ("127.0.0.1", ports[0]))
        wait_for(lambda: chans[0].dropped - before >= 5, 5, "five drops")
        # the genuine one, twice (a resend): acted on once
        s.sendto(seal(bytes.fromhex(KEY), base), ("127.0.0.1", ports[0]))
        s.sendto(seal(bytes.fromhex(KEY), base), ("127.0.0.1", ports[0]))
        s.settimeout(2)
        acks = [unseal(bytes.fromhex(KEY), s.recvfrom(8192)[0]) for _ in range(2)]
    assert [a["kind"] for a in acks] == ["ack", "ack"] and acks[0]["re"] == "x1"
    wait_for(lambda: got[0], 5, "the genuine notice")
    time.sleep(0.2)
    assert got[0] == [("preempt", 1, 1)]


@pytest.mark.integration
def test_an_unanswered_ask_gives_up_in_time():
    g = parse_group(doc(rank=1, ports=[free_udp(), free_udp()]), "t")
    ch = PeerChannel(g).start()
    try:
        t0 = time.monotonic()
        assert ch.ask(0, timeout=0.5) is None
        assert time.monotonic() - t0 < 5
    finally:
        ch.close(linger=0)


@pytest.mark.integration
def test_a_peers_notice_becomes_this_agents_own_and_a_stop_becomes_a_stop_request(tmp_path):
    ports = [free_udp(), free_udp()]
    events, put = [], []
    n0 = mn.GroupNotices(parse_group(doc(rank=0, ports=ports), "t"), str(tmp_path / "stop.request"),
                         lambda t, **f: events.append((t, f)))
    n1 = mn.GroupNotices(parse_group(doc(rank=1, ports=ports), "t"), str(tmp_path / "stop1.request"),
                         lambda t, **f: None)
    n0.start(put.append)
    n1.start(lambda item: None)
    try:
        n1.on_notice("signal:SIGTERM", "spot", 20.0)
        wait_for(lambda: put, 5, "node 0 to get node 1's preemption")
        lead, source, detail = put[0]
        assert lead == 20.0 and source == "peer:node1" and "signal:SIGTERM" in detail
        n0.on_notice("peer:node1", detail, 19.0)  # a peer's notice is not sent around again
        assert not [k for k, _ in events if k == "peer_notice_sent"]
        n1.on_notice("stop", "onbox stop", 7.0)
        wait_for(lambda: os.path.exists(tmp_path / "stop.request"), 5, "node 0's stop request")
        req = json.loads((tmp_path / "stop.request").read_text())
        assert req["grace"] == 7.0 and req["by"] == "node 1" and n0.stopping.is_set()
        n0.on_notice("stop", "onbox stop", 7.0)  # node 0 now stops for node 1's request: not echoed back
        assert not [k for k, _ in events if k == "peer_notice_sent"]
    finally:
        n0.close()
        n1.close()


def test_node0_publishes_each_restore_and_a_node_follows_it(tmp_path):
    class Inner:
        resumed = {"name": "step_00004.pt", "step": 4}

        def scan_now(self, settle=None):
            return []

        def restore(self):
            return "/ck/step_00004.pt"

    point = mn.ResumePoint()
    prim = mn.GroupPrimary(Inner(), point, type("C", (), {"monotonic": staticmethod(time.monotonic)}), 5.0)
    assert point.answer()["seq"] == 0
    assert prim.restore() == "/ck/step_00004.pt"
    assert point.answer() == {"seq": 1, "name": "step_00004.pt", "step": 4}

    class Chan:
        def __init__(self, replies):
            self.replies = list(replies)

        def ask(self, rank, timeout):
            return self.replies.pop(0) if self.replies else None

    events = []
    g = parse_group(doc(rank=1), "t")
    emit = lambda t, **f: events.append((t, f))  # noqa: E731
    # node 0 has not restored for this attempt yet (seq 0), then starts fresh: so does this node
    chan = Chan([{"seq": 0}, {"seq": 1, "name": None, "step": None}])
    fresh = mn.GroupRestore(g, str(tmp_path / "d"), str(tmp_path / "ck"), emit, lambda: chan, wait_s=5)
    assert fresh() is None and fresh.last_seq == 1 and events[-1][0] == "node_resume"
    # node 0 resumes from a checkpoint this node cannot fetch (a durable dir only node 0 sees): said loudly
    chan = Chan([{"seq": 1, "name": "step_00004.pt", "step": 4}])
    missing = mn.GroupRestore(g, str(tmp_path / "d"), str(tmp_path / "ck"), emit, lambda: chan, wait_s=5)
    assert missing() is None and events[-1][0] == "node_resume_failed"
    assert "every node reaches" in events[-1][1]["reason"]
    # node 0 never answers: bounded wait, then the newest committed one (none here)
    chan = Chan([])
    silent = mn.GroupRestore(g, str(tmp_path / "d"), str(tmp_path / "ck"), emit, lambda: chan, wait_s=0.3)
    assert silent() is None and [k for k, _ in events[-2:]] == ["node_resume_fallback", "node_resume"]


def test_a_non_primary_node_never_blocks_its_boxs_teardown():
    from controller.results.pull import PullsRecord
    from controller.results.teardown import judge_run

    rec = PullsRecord("/nonexistent/pulls.json")
    node1 = {"run": "big.node1", "state": "preempted", "durable": "/d", "run_root": "/d/big.node1",
             "checkpoints": [], "node": {"rank": 1, "run": "big", "nnodes": 2}}
    v = judge_run("b1", node1, rec)
    assert not v.blocking and "node 0 commits" in v.reason
    node0 = dict(node1, run="big", run_root="/d/big", node={"rank": 0, "run": "big", "nnodes": 2})
    assert judge_run("b0", node0, rec).blocking  # node 0's run is gated like any run


def test_each_node_is_reached_on_the_subnet_all_boxes_share():
    from controller.boxes.inventory import Box
    from controller.launch.nodes import group_docs, node_address

    boxes = [Box("b0", "203.0.113.5"), Box("b1", "203.0.113.6"), Box("b2", "gpu2", in_inventory=False)]
    probes = [{"addrs": [{"addr": "203.0.113.5", "prefix": 32}, {"addr": "10.0.0.5", "prefix": 16}],
               "tcp_port": 29511, "udp_port": 41000},
              {"addrs": [{"addr": "10.0.7.9", "prefix": 16}], "tcp_port": 1, "udp_port": 41001},
              {"addrs": [{"addr": "10.0.3.1", "prefix": 24}], "tcp_port": 2, "udp_port": 41002}]
    assert node_address(0, boxes, probes) == "10.0.0.5"  # the cluster network, not the public address
    assert node_address(1, boxes, probes) == "10.0.7.9"
    # box 2's /24 holds neither other box, and its name is an ssh alias: refused, with what to do
    with pytest.raises(UsageError, match="ssh alias"):
        node_address(2, boxes, probes)
    lonely = [{"addrs": [{"addr": "192.168.1.2", "prefix": 24}]}, {"addrs": [{"addr": "10.1.1.1", "prefix": 24}]}]
    assert node_address(0, boxes[:2], lonely) == "203.0.113.5"  # no shared subnet: the inventory host
    docs = group_docs(["big", "big.node1"], ["10.0.0.5", "10.0.7.9"], probes[:2], "10.0.0.5", "ab" * 8, b"k" * 32)
    groups = [parse_group(d, "t") for d in docs]
    assert [g.rank for g in groups] == [0, 1] and groups[0].master_port == 29511
    assert groups[1].peers[0] == Peer(0, "10.0.0.5", 41000) and groups[0].run == groups[1].run == "big"


@pytest.mark.integration
def test_onbox_run_takes_the_group_from_stdin_checks_it_and_records_only_its_path(tmp_path, onbox_argv):
    import subprocess

    from tests.conftest import subprocess_env

    home = tmp_path / "home"
    env = subprocess_env({"ONBOX_HOME": str(home)})
    durable = tmp_path / "durable"
    durable.mkdir()
    g1 = dict(doc(rank=1, ports=[free_udp(), free_udp()]))
    # node 1 before node 0 marked the durable target: it cannot see node 0's commits, refused (exit 3)
    r = subprocess.run([*onbox_argv, "run", "--name", "big.node1", "--node-group", "-", "--durable", str(durable),
                        "--", "true"], input=json.dumps(g1).encode(), env=env, capture_output=True, timeout=60)
    assert r.returncode == 3 and b"does not see node 0's durable target" in r.stderr
    assert not (home / "runs" / "big.node1").exists()
    # node 0 under another name than the group's run: refused (exit 2), nothing written
    g0 = dict(g1, rank=0)
    r = subprocess.run([*onbox_argv, "run", "--name", "other", "--node-group", "-", "--durable", str(durable),
                        "--", "true"], input=json.dumps(g0).encode(), env=env, capture_output=True, timeout=60)
    assert r.returncode == 2 and b"must run as big" in r.stderr and not (home / "nodes").exists()
    r = subprocess.run([*onbox_argv, "run", "--name", "big", "--node-group", "-", "--durable", str(durable),
                        "--foreground", "--", "true"], input=json.dumps(g0).encode(), env=env, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((home / "runs" / "big" / "config.json").read_text())
    assert cfg["node_group"] == str(home / "nodes" / "big.json") and KEY not in json.dumps(cfg)
    assert cfg["env"]["NODE_RANK"] == "0" and cfg["env"]["PET_RDZV_BACKEND"] == "static"
    assert os.stat(home / "nodes" / "big.json").st_mode & 0o777 == 0o600
    assert (durable / "big" / ".onbox-group").read_text().strip() == g0["group"]


def test_a_node_that_cannot_start_from_node0s_step_says_so_until_it_does():
    from onbox.supervisor.notes import RunNotes

    notes = RunNotes()
    notes.on_event({"type": "node_resume_failed", "time": 1.0, "reason": "cannot restore step_4 from /d"})
    warn = [w for w in notes.to_state()["warnings"] if w["code"] == "node_resume_failed"]
    assert warn and warn[0]["severity"] == "critical" and "step_4" in warn[0]["message"]
    assert notes.take() == (False, True)
    notes.on_event({"type": "checkpoint_resume", "time": 2.0, "source": "node0:durable"})
    assert not notes.to_state()["warnings"]


@pytest.mark.integration
def test_node_probe_reports_addresses_free_ports_and_whether_a_run_lives(tmp_path, onbox_argv):
    import subprocess

    from tests.conftest import subprocess_env

    home = tmp_path / "home"
    (home / "runs" / "r").mkdir(parents=True)
    (home / "runs" / "r" / "state.json").write_text(json.dumps({
        "state": "running", "agent_pid": os.getpid(), "agent_start_time": None, "child_pid": None}))
    r = subprocess.run([*onbox_argv, "node", "probe", "--run", "r", "--json"], env=subprocess_env(
        {"ONBOX_HOME": str(home)}), capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    assert doc["schema"] == "onbox.node_probe/1" and 0 < doc["tcp_port"] < 65536 and 0 < doc["udp_port"] < 65536
    assert all("addr" in a and "prefix" in a for a in doc["addrs"])
    assert doc["run"]["agent_alive"] is True and doc["run"]["child_alive"] is False


def test_a_notice_port_taken_meanwhile_is_a_loud_warning(tmp_path):
    from onbox.supervisor.notes import RunNotes

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("", 0))
        port = taken.getsockname()[1]
        notes = RunNotes()
        nodes = mn.GroupNotices(parse_group(doc(rank=1, ports=[free_udp(), port]), "t"), str(tmp_path / "stop"),
                                lambda t, **f: notes.on_event(dict(f, type=t)))
        nodes.start(lambda item: None)
        assert nodes.channel is None
        nodes.on_notice("signal:SIGTERM", "", 5.0)  # nothing to send with: no crash
        nodes.close()
    warn = notes.to_state()["warnings"]
    assert warn and warn[0]["code"] == "thread_died" and "another node will not stop this one" in warn[0]["message"]


def test_a_notice_port_that_cannot_be_bound_leaks_no_socket():
    import gc
    import warnings

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("", 0))
        g = parse_group(doc(rank=1, ports=[free_udp(), taken.getsockname()[1]]), "t")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with pytest.raises(OSError):
                PeerChannel(g).start()
            gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


@pytest.mark.integration
def test_a_peer_name_that_fails_to_resolve_once_is_looked_up_again():
    """A name server briefly away when the first notice goes out must not cut node 0 off for the agent's life."""
    ports = [free_udp(), free_udp()]
    got = []
    lookups = []

    def flaky_dns(host, port, *args):  # the name-service seam: fails twice, then answers like getaddrinfo
        lookups.append(host)
        if len(lookups) <= 2:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return socket.getaddrinfo("127.0.0.1", port, *args)

    d1 = doc(rank=1, ports=ports)
    d1["peers"][0]["addr"] = "node0.cluster.internal"
    node0 = PeerChannel(parse_group(doc(rank=0, ports=ports), "t"),
                        on_notice=lambda kind, rank, msg: got.append((kind, rank))).start()
    node1 = PeerChannel(parse_group(d1, "t"), resolve=flaky_dns).start()
    try:
        sender = node1.broadcast("preempt", lead=5.0, source="signal:SIGTERM")
        wait_for(lambda: got, 10, "node 0 to hear node 1 once its name resolves")
        sender.join(10)
        assert got == [("preempt", 1)]
        assert lookups[:3] == ["node0.cluster.internal"] * 3  # asked again after each failure, then kept
        assert len(lookups) == 3
    finally:
        node0.close(linger=0)
        node1.close(linger=0)


@pytest.mark.integration
def test_a_notice_sealed_before_the_agent_started_is_a_replay_and_dropped(pair):
    """A relaunch from the same group file keeps the key: a `preempt` captured in the previous life must not stop
    the new one. A fresh notice with the same key still works."""
    chans, got, ports = pair
    logged = []
    chans[0].log = logged.append
    before = chans[0].dropped
    old = {"g": "0123456789abcdef", "from": 1, "id": "replayed-1", "kind": "preempt", "lead": 5,
           "t": chans[0].started_wall - 3600}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(seal(bytes.fromhex(KEY), old), ("127.0.0.1", ports[0]))
        s.sendto(seal(bytes.fromhex(KEY), dict(old, id="replayed-2", t=None)), ("127.0.0.1", ports[0]))
        wait_for(lambda: chans[0].dropped - before >= 2, 5, "both replays dropped")
        s.sendto(seal(bytes.fromhex(KEY), dict(old, id="fresh", t=time.time())), ("127.0.0.1", ports[0]))
        wait_for(lambda: got[0], 5, "the fresh notice")
    assert got[0] == [("preempt", 1, 5)]
    assert len([m for m in logged if "replayed datagram" in m]) == 1  # said once for that node
