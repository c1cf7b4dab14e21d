"""A hang restart travels between the agents of an SSH group (real authenticated UDP notices on loopback): what one
node's hang watch says reaches every peer as the supervisor's own wire for it (`restart:node<K>`), once; a restart
of a group attempt the receiving node has left already (node 0's resume point seq) is ignored and said so."""
from __future__ import annotations

import json

import pytest

from onbox.multinode import hooks as mn
from onbox.multinode.role import parse_group
from tests.polling import wait_for
from tests.unit.test_multinode import doc, free_udp

pytestmark = pytest.mark.integration

SAID = {"step": 41, "quiet_s": 12.5, "bound_s": 10.0, "rule": "train: ...", "phase": "train",
        "stacks": "/r/hang-stacks.0.txt"}


@pytest.fixture
def group(tmp_path):
    ports = [free_udp(), free_udp()]
    got = {0: [], 1: []}
    said = {0: [], 1: []}
    nodes = [mn.GroupNotices(parse_group(doc(rank=i, ports=ports), "t"), str(tmp_path / ("stop%d" % i)),
                             lambda t, i=i, **f: said[i].append((t, f))) for i in range(2)]
    for i, n in enumerate(nodes):
        n.start(got[i].append)
    yield nodes, got, said
    for n in nodes:
        n.close()


def test_a_restart_reaches_every_peer_as_its_own_wire_once(group):
    nodes, got, said = group
    nodes[0].point.publish("step_00040.pt", 40)  # node 0 runs group attempt 1
    nodes[1].channel.joined = 1  # ... and node 1 joined it
    nodes[0].on_restart(dict(SAID, other="not sent"))
    wait_for(lambda: got[1], 5, "node 1 to hear node 0's restart")
    ((lead, source, detail),) = got[1]
    assert lead is None and source == "restart:node0" and json.loads(detail) == SAID
    assert ("peer_notice_sent", {"kind": "restart", "to": [1]}) in said[0]
    heard = [f for t, f in said[1] if t == "peer_notice"]
    assert heard == [{"kind": "restart", "node": 0, "seq": 1, "stacks": SAID["stacks"]}]
    assert got[0] == [] and not nodes[1].stopping.is_set()  # a restart is no stop of the group
    nodes[1].on_restart(SAID)  # node 1's own judgement reaches node 0 the same way
    wait_for(lambda: got[0], 5, "node 0 to hear node 1's restart")
    assert got[0][0][1] == "restart:node1"


def test_a_restart_of_a_group_attempt_already_left_is_ignored(group):
    nodes, got, said = group
    nodes[0].point.publish("step_00040.pt", 40)
    nodes[0].point.publish("step_00050.pt", 50)  # node 0 restarted: group attempt 2 now
    nodes[1].channel.joined = 1  # node 1's word is about attempt 1 (a late one)
    nodes[1].on_restart(SAID)
    wait_for(lambda: [f for t, f in said[0] if t == "peer_restart_ignored"], 5, "node 0 to ignore it")
    ((_, ignored),) = [(t, f) for t, f in said[0] if t == "peer_restart_ignored"]
    assert ignored["node"] == 1 and ignored["seq"] == 1 and ignored["joined"] == 2
    assert got[0] == []
    nodes[1].channel.joined = None  # node 1 restored on its own (node 0 gave no answer): any word counts
    nodes[1].on_restart(SAID)
    wait_for(lambda: got[0], 5, "node 0 to act on it")
