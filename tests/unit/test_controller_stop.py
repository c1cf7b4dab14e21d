"""`onboxctl stop`'s logic without a box (controller/launch/stop.py): what it says for each outcome, the bound of --wait,
and the agent's answers it refuses. The real thing against an sshd box: tests/integration/test_controller_stop.py."""
from __future__ import annotations

import pytest

from controller.boxes.inventory import Box
from controller.boxes.ssh import BoxUnreachable, Result
from controller.launch import stop as st
from onbox.clock import FakeClock
from onbox.errors import JobFailed, UsageError

BOX = Box(name="gpu1", host="h")


def answer(monkeypatch, doc, rc=0, err=b""):
    """The agent's answer to `onbox stop ... --json`."""
    asked = []

    def fake_ask(ssh, box, args, timeout=60.0):
        asked.append((args, timeout))
        return doc, Result(["ssh"], rc, b"", err), "onbox " + " ".join(args)

    monkeypatch.setattr(st, "ask", fake_ask)
    return asked


def statuses(monkeypatch, docs):
    """`onbox status RUN --json` answers, one per call (the last one repeats)."""
    calls = []

    def fake(ssh, box, args, schema, timeout=60.0):
        calls.append(args)
        d = docs[min(len(calls), len(docs)) - 1]
        if isinstance(d, Exception):
            raise d
        return d

    monkeypatch.setattr(st, "agent_json", fake)
    return calls


ASKED = {"schema": "onbox.stop/1", "outcome": "asked", "run": "gpt", "state": "running", "grace": 30.0, "wait_s": 60.0}
ENDED = {"schema": "onbox.status/1", "run": "gpt", "state": "stopped", "agent_alive": False,
         "last_exit": {"classification": "stopped", "message": "stopped on request (exit code 0)"},
         "checkpoint": {"latest_durable": {"name": "step_000120", "step": 120}, "durable": "/workspace/durable/gpt",
                        "last_sync": {"ok": True}}}


def test_without_wait_the_ask_is_all_and_says_who_does_what(monkeypatch):
    asked = answer(monkeypatch, ASKED)
    rep = st.stop_run(None, BOX, "gpt", grace=12.0)  # type: ignore[arg-type]
    assert asked[0][0] == ["stop", "gpt", "--no-wait", "--json", "--grace", "12"]
    assert asked[0][1] == st.ask_timeout(12.0) == 60 + 12 + 300
    assert rep.outcome == "asked" and rep.grace == 30.0 and rep.state == "running"
    assert st.render(rep) == ("gpu1/gpt: stop asked: the trainer checkpoints (grace 30 s), the agent commits and "
                              "ends the run (not restarted); `onboxctl status --box gpu1` follows it\n")


def test_wait_polls_status_until_ended_then_names_state_and_newest_durable_checkpoint(monkeypatch):
    answer(monkeypatch, ASKED)
    running = dict(ENDED, state="stopping", agent_alive=True)
    calls = statuses(monkeypatch, [running, running, dict(ENDED, agent_alive=True), ENDED])
    clock, said = FakeClock(), []
    rep = st.stop_run(None, BOX, "gpt", wait=True, say=said.append, clock=clock)  # type: ignore[arg-type]
    assert len(calls) == 4 and calls[0] == ["status", "gpt", "--json"]  # ended = terminal AND the agent gone
    assert said == ["gpu1/gpt: stop asked: the trainer checkpoints (grace 30 s), the agent commits and ends the run; "
                    "waiting up to 90 s"]
    assert rep.outcome == "ended" and rep.state == "stopped" and rep.waited_s == 3.0
    assert st.render(rep).splitlines() == [
        "gpu1/gpt: stopped after 3.0 s (last exit: stopped — stopped on request (exit code 0))",
        "  newest durable checkpoint: step_000120 (step 120) in /workspace/durable/gpt"]
    assert rep.to_dict()["checkpoint"] == {"name": "step_000120", "step": 120}


def test_wait_is_bounded_by_the_agents_own_wait_and_says_the_request_stays(monkeypatch):
    answer(monkeypatch, dict(ASKED, wait_s=5.0))
    calls = statuses(monkeypatch, [dict(ENDED, state="stopping", agent_alive=True)])
    clock = FakeClock()
    with pytest.raises(JobFailed) as e:
        st.stop_run(None, BOX, "gpt", wait=True, clock=clock)  # type: ignore[arg-type]
    assert e.value.message == "run gpt on gpu1 did not stop within 35 s (it is stopping)"
    assert "the stop request stays and the agent still stops the run" in (e.value.hint or "")
    assert sum(clock.sleeps) == 35.0 and len(calls) == 36


def test_a_box_lost_while_waiting_says_the_stop_was_asked(monkeypatch):
    answer(monkeypatch, ASKED)
    statuses(monkeypatch, [BoxUnreachable("cannot reach box gpu1 (h): Connection timed out", hint="check it")])
    with pytest.raises(BoxUnreachable) as e:
        st.stop_run(None, BOX, "gpt", wait=True, clock=FakeClock())  # type: ignore[arg-type]
    assert e.value.exit_code == 3
    assert e.value.message.startswith("cannot reach box gpu1 (h): Connection timed out, while waiting for run gpt")
    assert "the stop was asked" in e.value.message


@pytest.mark.parametrize("outcome,says", [
    ("already_ended", "run gpt on gpu1 has already ended (stopped): nothing to stop"),
    ("nothing_to_stop", "run gpt on gpu1 has no live agent and no live trainer (state.json says stopped): nothing "
                        "to stop")])
def test_nothing_to_stop_is_exit_1_and_one_sentence(monkeypatch, outcome, says):
    answer(monkeypatch, dict(ASKED, outcome=outcome, state="stopped"))
    with pytest.raises(st.NothingToStop) as e:
        st.stop_run(None, BOX, "gpt")  # type: ignore[arg-type]
    assert e.value.exit_code == 1 and e.value.message == says


def test_a_run_without_agent_is_stopped_by_the_ask_itself(monkeypatch):
    answer(monkeypatch, {"schema": "onbox.stop/1", "outcome": "stopped", "run": "gpt", "state": "stopped"})
    statuses(monkeypatch, [dict(ENDED, checkpoint={"latest_durable": None, "durable": None})])
    rep = st.stop_run(None, BOX, "gpt", wait=False)  # type: ignore[arg-type]
    assert rep.outcome == "ended" and rep.state == "stopped"
    assert st.render(rep).splitlines()[1] == ("  no durable checkpoint: the run commits nowhere (no --durable); its "
                                              "checkpoints stay on the box")


def test_the_agents_refusal_and_an_older_agent(monkeypatch):
    answer(monkeypatch, None, rc=2, err=b"onbox: no run named gpt in /root/.onbox/runs\nhint: `onbox ls` lists runs\n")
    with pytest.raises(UsageError) as e:
        st.stop_run(None, BOX, "gpt")  # type: ignore[arg-type]
    assert e.value.message == "onbox stop gpt on gpu1: no run named gpt in /root/.onbox/runs"
    answer(monkeypatch, None, rc=2, err=b"Error: No such option: --no-wait\n")  # an onbox.pyz older than onboxctl
    with pytest.raises(UsageError) as e:
        st.stop_run(None, BOX, "gpt")  # type: ignore[arg-type]
    assert "No such option: --no-wait" in e.value.message and "onboxctl push gpu1" in (e.value.hint or "")


def test_checkpoint_line_never_hides_a_failed_sync_or_a_missing_commit():
    r = st.StopReport(box="b", run="r", outcome="ended", durable="/d/r",
                      last_sync={"ok": False, "error": "rclone exited 1"})
    assert st.checkpoint_line(r) == "no checkpoint committed to /d/r; LAST SYNC FAILED: rclone exited 1"
    r.checkpoint = {"name": "ckpt.pt", "step": None}
    assert st.checkpoint_line(r) == "newest durable checkpoint: ckpt.pt in /d/r; LAST SYNC FAILED: rclone exited 1"
