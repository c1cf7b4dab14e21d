"""A multi-node group restarts together after a hang, driven by scripted attempts on a FakeClock (the harness of
test_hang_loop.py): the node that judges its own attempt hung tells its peers once its stacks are kept and before it
stops anything; a peer's word stops this node's attempt (its stacks first) and restarts it, even when this node's
trainer reports no step at all (its own cadence can never judge it) and whatever its own --on-hang says; a word that
comes while no attempt runs is ignored, never a reason to stop the next one."""
from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Tuple

from onbox.proc import ExitStatus
from onbox.supervisor.hooks import Hooks, NoTelemetry
from onbox.supervisor.loop import RunState, Supervisor
from tests.unit.test_hang_loop import events, make, runs_until_killed


class Nodes:
    """The `nodes` hook of a group's node: records what it is told to send, hands in the peers' words."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.put: Optional[Callable[[Tuple[Optional[float], str, str]], None]] = None
        self.restarts: List[Tuple[Dict[str, Any], List[Tuple[float, int]]]] = []  # (detail, signals sent so far)

    def start(self, put_notice: Callable[[Tuple[Optional[float], str, str]], None]) -> None:
        self.put = put_notice

    def on_notice(self, source: str, detail: str, lead: float) -> None:
        return None

    def on_restart(self, detail: Dict[str, Any]) -> None:
        self.restarts.append((dict(detail), list(self.sup.proc.signals)))  # type: ignore[attr-defined]

    def close(self) -> None:
        return None

    def peer_restart(self, node: int, **detail: Any) -> None:
        assert self.put is not None
        self.put((None, "restart:node%d" % node, json.dumps(detail)))


def group_node(tmp_path: Any, scripts: List[Any], hang_at: List[Optional[float]],
               at: Dict[float, Callable[[Nodes], None]], **fields: Any) -> Tuple[Supervisor, Nodes, List[Any]]:
    """A node of a group: the harness's supervisor with a `nodes` hook; `at`: {fake second: what a peer does}."""
    sup, _procs, _reaper, _synced, captured = make(tmp_path, scripts, hang_at, **fields)
    nodes = Nodes(sup)
    hooks = sup.hooks
    sup.hooks = Hooks(hooks.checkpoints, NoTelemetry(), hooks.reaper, nodes=nodes, logs=hooks.logs)
    trainer_wait = sup.waiter
    todo = sorted(at.items())
    t0 = sup.clock.monotonic()

    def wait(seconds: float) -> None:
        trainer_wait(seconds)
        while todo and sup.clock.monotonic() >= t0 + todo[0][0]:
            todo.pop(0)[1](nodes)
    sup.waiter = wait
    return sup, nodes, captured


PEER = {"step": 41, "quiet_s": 12.5, "bound_s": 10.0, "rule": "train: max(10 x median step interval 1 s, floor 5 s)",
        "phase": "train", "stacks": "/home/u/.onbox/runs/mn/hang-stacks.0.txt"}


def test_a_node_that_judges_its_own_hang_tells_its_peers_before_it_stops_anything(tmp_path):
    sup, nodes, _captured = group_node(
        tmp_path, [runs_until_killed, lambda t, s: ExitStatus(code=0) if t >= 30 else None], [20.0, None], {})
    assert sup.run() == RunState.DONE
    (told, signals_by_then) = nodes.restarts[0]
    assert len(nodes.restarts) == 1 and signals_by_then == []  # nothing was stopped yet: the peers take their stacks
    (hang,) = events(sup, "hang_detected")
    assert told["stacks"] == hang["stacks"] and told["step"] == hang["step"] and told["bound_s"] == 10.0
    assert sup.attempts[0]["exit"]["classification"] == "hung" and len(sup.attempts) == 2


def test_a_peers_word_restarts_a_node_whose_trainer_reports_no_step(tmp_path):
    # this node's trainer prints nothing (hang_at 0): its own cadence never judges it; node 0's word at 20 s does
    sup, nodes, captured = group_node(
        tmp_path, [runs_until_killed, lambda t, s: ExitStatus(code=0) if t >= 10 else None], [0.0, 0.0],
        {20.0: lambda n: n.peer_restart(0, **PEER)})
    assert sup.run() == RunState.DONE
    (hang,) = events(sup, "hang_detected")
    assert hang["phase"] == "group" and hang["peer"]["node"] == 0 and hang["peer"]["stacks"] == PEER["stacks"]
    assert captured and hang["stacks"] == sup.rd.file("hang-stacks.0.txt")  # this node's own stacks, first
    first = sup.attempts[0]["exit"]
    assert first["classification"] == "hung" and "node 0 judged it hung" in first["message"]
    assert PEER["stacks"] in first["message"] and hang["stacks"] in first["message"]
    (action,) = events(sup, "hang_action")
    assert action["action"] == "restart" and action["state"] == "backoff" and action["peer"] == 0
    assert "with its group" in action["message"]
    assert nodes.restarts == []  # a peer's word is never sent on
    assert len(sup.attempts) == 2 and sup.attempts[1]["exit"]["code"] == 0
    with open(hang["stacks"]) as f:
        assert "by a peer: node 0 judged the group hung" in f.read()


def test_a_peers_word_restarts_even_where_on_hang_only_alerts(tmp_path):
    sup, _nodes, _captured = group_node(
        tmp_path, [runs_until_killed, lambda t, s: ExitStatus(code=0) if t >= 10 else None], [0.0, 0.0],
        {5.0: lambda n: n.peer_restart(1, **PEER)}, on_hang="alert")
    assert sup.run() == RunState.DONE
    assert sup.attempts[0]["exit"]["classification"] == "hung" and len(sup.attempts) == 2


def test_a_peers_word_while_no_attempt_runs_is_ignored_and_the_next_attempt_is_left_alone(tmp_path):
    # attempt 0 fails at 3 s (backoff 2 s): the word comes during the backoff; attempt 1 trains to its end
    sup, _nodes, captured = group_node(
        tmp_path, [lambda t, s: ExitStatus(code=1) if t >= 3 else None,
                   lambda t, s: ExitStatus(code=0) if t >= 10 else None], [None, None],
        {4.0: lambda n: n.peer_restart(0, **PEER)})
    assert sup.run() == RunState.DONE
    (ignored,) = events(sup, "peer_restart_ignored")
    assert ignored["node"] == 0 and ignored["state"] == "backoff"
    assert events(sup, "hang_detected") == [] and captured == []
    assert [a["exit"]["code"] for a in sup.attempts] == [1, 0]


def test_no_word_no_restart_for_a_silent_healthy_node(tmp_path):
    sup, nodes, captured = group_node(
        tmp_path, [lambda t, s: ExitStatus(code=0) if t >= 300 else None], [0.0], {})
    assert sup.run() == RunState.DONE and len(sup.attempts) == 1
    assert events(sup, "hang_detected") == [] and captured == [] and nodes.restarts == []


def test_a_run_without_peers_judges_and_restarts_as_before(tmp_path):
    sup, _procs, _reaper, _synced, _captured = make(tmp_path, [runs_until_killed, lambda t, s: ExitStatus(code=0)
                                                               if t >= 30 else None], [20.0, None])
    assert sup.run() == RunState.DONE and len(events(sup, "hang_detected")) == 1  # NoNodes: on_restart does nothing
    assert events(sup, "peer_restart_ignored") == [] and len(sup.attempts) == 2
