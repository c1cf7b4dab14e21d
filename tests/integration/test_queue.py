"""The run queue with real processes and signals: entries run in turn as their own `onbox run`; entries added (two
at once) and removed while it runs; a SIGTERM to the runner during the second entry preempts it (checkpoint, exit
75) and stops the queue; the relaunch resumes the second from its checkpoint, runs the rest, never re-runs the
first. Bad input is refused with nothing written; --per-gpu gives each entry its own GPU (NVML faked at its seam)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from onbox.proc import start_time
from onbox.queue.journal import Journal
from onbox.queue.runner import QueueRunner
from onbox.queue.slots import agent_argv, gpu_slots
from tests.conftest import subprocess_env
from tests.fakes.nvml import FakeGpu, FakeNvml
from tests.integration.supervisor_helpers import FAST, env_for, onbox, state
from tests.polling import wait_for
from tests.processes import Started, pid_alive, signal_own

pytestmark = [pytest.mark.integration]
PY = sys.executable
TRAINER = [PY, "-m", "tests.integration.phase_trainer", "--interval", "0.01"]


def q(home, *args, **kw):
    """`onbox queue ...` in a subprocess (the real CLI, exit code and all)."""
    return onbox(home, "queue", *args, **kw)


def cli(capsys, *argv):
    """`onbox ...` in this process (the same code path, without an interpreter's start-up): (exit code, err)."""
    from onbox.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr().err


def entries(home):
    """The queue as the journal holds it (the last record of each entry wins), read in this process."""
    journal = Journal(str(home / "queue"))
    with journal.locked(exclusive=False):
        found, _ = journal.read()
    return {e.name: e for e in found.values()}


@pytest.fixture
def fast(monkeypatch):
    """The time knobs in milliseconds for entries added in this process (they are part of each entry's record)."""
    for k, v in FAST.items():
        monkeypatch.setenv(k, v)


def test_a_preempted_queue_continues_at_the_entry_it_was_on(onbox_home, tmp_path, capsys, fast, cleanup):
    hold = tmp_path / "hold"
    hold.write_text("")
    dropped = tmp_path / "dropped-ran"
    for name, cmd in (("first", [*TRAINER, "--steps", "3"]),
                      ("second", [*TRAINER, "--steps", "20", "--hold", str(hold), "--hold-at", "4"]),
                      ("third", [*TRAINER, "--steps", "3"])):
        assert cli(capsys, "queue", "add", "--name", name, "--", *cmd)[0] == 0
    r = q(onbox_home, "run", "--json")
    assert r.returncode == 0, r.stderr
    runner = json.loads(r.stdout)["runner_pid"]
    wait_for(lambda: "\n{\"step\": 4," in _output(onbox_home, "second"), timeout=30, what="the second entry at step 4")
    # while it runs: two adds at once (each its own id, both seen), `rm` of a pending entry; a running one stays
    adds = [subprocess.Popen([PY, "-m", "onbox", "queue", "add", "--name", name, "--", *cmd], env=env_for(onbox_home),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, cmd in (("extra", ["true"]), ("dropped", ["touch", str(dropped)]))]
    assert [p.wait(timeout=60) for p in adds] == [0, 0], [p.communicate() for p in adds]
    assert cli(capsys, "queue", "rm", "dropped")[0] == 0
    code, err = cli(capsys, "queue", "rm", "second")
    assert code == 2 and "is running" in err
    now = entries(onbox_home)
    assert {n: e.state for n, e in now.items()} == {
        "first": "done", "second": "running", "third": "pending", "extra": "pending", "dropped": "removed"}
    assert {now["extra"].id, now["dropped"].id} == {4, 5}  # two adds at once: two ids, nothing lost
    signal_own(onbox_home, runner, signal.SIGTERM)
    wait_for(lambda: not pid_alive(runner), timeout=60, what="the runner to stop")
    doc = json.loads(q(onbox_home, "ls", "--json").stdout)
    assert doc["runner"]["state"] == "preempted" and doc["runner"]["exit"] == 75
    assert {e["name"]: (e["state"], e["run_state"]) for e in doc["entries"]} == {
        "first": ("done", "done"), "second": ("preempted", "preempted"), "third": ("pending", None),
        "extra": ("pending", None)}  # the removed entry is not listed

    hold.unlink()
    r = q(onbox_home, "run", "--foreground", timeout=120)
    assert r.returncode == 0, r.stderr
    assert {n: e.state for n, e in entries(onbox_home).items()} == {
        "first": "done", "second": "done", "third": "done", "extra": "done"}  # compacted: no removed entry left
    assert not dropped.exists()  # removed before its turn: never run
    assert len(state(onbox_home, "first")["attempts"]) == 1  # done once, never run twice
    second, third = state(onbox_home, "second"), state(onbox_home, "third")
    assert second["attempts"][-1]["resume_from"].endswith("step_000005.ckpt")  # resumed, not started over
    assert "resumed from step 5" in _output(onbox_home, "second")
    assert second["attempts"][-1]["ended_at"] <= third["attempts"][0]["started_at"]  # in turn
    assert entries(onbox_home)["second"].launches == 2


def test_a_killed_runner_leaves_its_agents_running_and_the_next_runner_never_starts_them_twice(
        onbox_home, tmp_path, capsys, fast, cleanup):
    """Two entries side by side; the runner is SIGKILLed. One finishes while no runner watches (recorded done,
    not started again), the other still runs when the next runner comes (watched again, not started twice)."""
    holds = {n: tmp_path / ("hold-" + n) for n in ("early", "late")}
    for name, hold in holds.items():
        hold.write_text("")
        cmd = [*TRAINER, "--steps", "8", "--hold", str(hold), "--hold-at", "2"]
        assert cli(capsys, "queue", "add", "--name", name, "--", *cmd)[0] == 0
    runner = json.loads(q(onbox_home, "run", "--parallel", "2", "--json").stdout)["runner_pid"]
    wait_for(lambda: all("\n{\"step\": 2," in _output(onbox_home, n) for n in holds), timeout=30,
             what="both entries at step 2")
    signal_own(onbox_home, runner, signal.SIGKILL)  # no chance to record anything
    wait_for(lambda: not pid_alive(runner), what="the runner gone")
    agents = {n: entries(onbox_home)[n].agent_pid for n in holds}
    holds["early"].unlink()
    wait_for(lambda: not pid_alive(agents["early"]), timeout=30, what="the early entry to finish unwatched")
    assert ls_state(onbox_home, capsys) == {"early": ("running", False), "late": ("running", True)}
    with Started() as started:
        again = started.popen([PY, "-m", "onbox", "queue", "run", "--foreground"], env=env_for(onbox_home),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: _runner_watches(onbox_home, again.pid, "late"), timeout=30,
                 what="the new runner to watch the live agent")
        holds["late"].unlink()
        _out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert "entry 1 early ended while no runner watched it: done" in err
    assert "watching the live agent of late again (pid %d)" % agents["late"] in err
    for name in holds:
        assert entries(onbox_home)[name].state == "done" and entries(onbox_home)[name].launches == 1
        assert len(state(onbox_home, name)["attempts"]) == 1 and "resumed" not in _output(onbox_home, name)


def ls_state(home, capsys):
    from onbox.cli import main

    with pytest.raises(SystemExit):
        main(["queue", "ls", "--json"])
    doc = json.loads(capsys.readouterr().out)
    return {e["name"]: (e["state"], e["agent_alive"]) for e in doc["entries"]}


def _runner_watches(home, pid, name):
    try:
        doc = json.loads((home / "queue" / "runner.json").read_text())
    except (OSError, ValueError):
        return False
    return doc.get("pid") == pid and name in doc.get("running", [])


def _output(home, name):
    try:
        return (home / "runs" / name / "output.log").read_text()
    except OSError:
        return ""


def test_bad_input_is_refused_and_nothing_is_written(onbox_home, tmp_path, capsys, monkeypatch):
    bad_phase = tmp_path / "run.toml"
    bad_phase.write_text('[run]\ncommand = ["true"]\n\n[[phase]]\nname = "a"\ncriteria = "eval_loss ~ 2"\n')
    for args, says in ((["add", "--grace", "nan", "--", "true"], "--grace must be a number"),
                       (["add", "--", "no-such-command-here"], "cannot run no-such-command-here"),
                       (["add", "-f", str(bad_phase)], "is not METRIC OP NUMBER"),
                       (["add", "--foreground", "--", "true"], "--foreground is not an option of a queue entry"),
                       (["add"], "no command to queue"),
                       (["run", "--parallel", "2", "--per-gpu"], "exclude each other")):
        code, err = cli(capsys, "queue", *args)
        assert code == 2 and says in err, (args, err)
    assert not (onbox_home / "queue").exists()  # a refused entry creates nothing, not even the queue
    assert cli(capsys, "queue", "add", "--name", "one", "--", "true")[0] == 0
    before = (onbox_home / "queue" / "journal.jsonl").read_bytes()
    for args, says in ((["add", "--name", "one", "--", "true"], "the run name one is taken (queue entry 1)"),
                       (["rm", "7"], "no queue entry '7'"),
                       (["run", "--parallel", "0"], "0 is not in the range")):
        code, err = cli(capsys, "queue", *args)
        assert code == 2 and says in err, (args, err)
    assert (onbox_home / "queue" / "journal.jsonl").read_bytes() == before
    for tick in ("abc", "nan"):  # the runner's own knob: a clean refusal, never a traceback
        monkeypatch.setenv("ONBOX_TICK_INTERVAL", tick)
        code, err = cli(capsys, "queue", "run")
        assert code == 2 and "ONBOX_TICK_INTERVAL" in err and "Traceback" not in err, (tick, err)
    monkeypatch.delenv("ONBOX_TICK_INTERVAL")
    code, err = cli(capsys, "queue", "run", "--per-gpu")  # this machine has no NVIDIA driver: unfit, not a crash
    assert code == 3 and "--per-gpu: no GPU here" in err and "hint:" in err


def test_per_gpu_runs_one_entry_per_gpu_with_cuda_visible_devices(onbox_home, tmp_path, capsys, fast, cleanup):
    """The runner in this process with NVML faked at its seam (two GPUs), real agents and children."""
    seen = tmp_path / "seen"
    seen.mkdir()
    script = 'echo "$CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER" > %s/$ONBOX_RUN; sleep 0.4' % seen
    for i in range(3):
        assert cli(capsys, "queue", "add", "--name", "g%d" % i, "--", "sh", "-c", script)[0] == 0
    slots = gpu_slots(_seam(FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b", pci_bus_id="00000000:5E:00.0")])))
    journal = Journal(str(onbox_home / "queue"))
    logged = []
    runner = QueueRunner(journal, slots, agent_argv(), str(onbox_home / "runs"), log=logged.append, tick=0.05,
                         environ=subprocess_env({"ONBOX_HOME": str(onbox_home), "ONBOX_GRACE": "7"}))
    assert runner.run() == 0
    got = {p.name: p.read_text().split() for p in seen.iterdir()}
    assert sorted(got) == ["g0", "g1", "g2"] and all(order == "PCI_BUS_ID" for _, order in got.values())
    assert {got["g0"][0], got["g1"][0]} == {"0", "1"}  # the first two side by side, one on each GPU
    started = [m for m in logged if " started " in m]
    assert [m.split()[2] for m in started] == ["g0", "g1", "g2"]
    assert logged.index(started[2]) > min(i for i, m in enumerate(logged) if m.endswith(": done"))  # waited
    # U32: the runner's own ONBOX_* settings never reach an entry; its queued record does
    assert json.loads((onbox_home / "runs" / "g0" / "config.json").read_text())["grace"] is None


def _seam(fake):
    from onbox.gpu.nvml import NvmlSeam

    return NvmlSeam(fake)


def test_an_entry_whose_agent_refuses_on_resume_fails_and_is_not_restarted_forever(
        onbox_home, tmp_path, capsys, fast, cleanup):
    """The run's state.json still says `preempted` (its previous launch) when the relaunched agent refuses to start
    (exit 2: its script lost its x bit): that stale state is not this agent's word. The entry fails with the
    agent's reason; it is not taken for preempted again and restarted at every tick."""
    hold = tmp_path / "hold"
    hold.write_text("")
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexec %s\n" % " ".join(
        [*TRAINER, "--steps", "20", "--hold", str(hold), "--hold-at", "2"]))
    os.chmod(script, 0o755)
    assert cli(capsys, "queue", "add", "--name", "lost", "--", str(script))[0] == 0
    runner = json.loads(q(onbox_home, "run", "--json").stdout)["runner_pid"]
    wait_for(lambda: "\n{\"step\": 2," in _output(onbox_home, "lost"), timeout=30, what="the entry at step 2")
    signal_own(onbox_home, runner, signal.SIGTERM)
    wait_for(lambda: not pid_alive(runner), timeout=60, what="the runner to stop")
    assert state(onbox_home, "lost")["state"] == "preempted"
    os.chmod(script, 0o644)
    r = q(onbox_home, "run", "--foreground", timeout=60)
    assert r.returncode == 1, r.stderr
    e = entries(onbox_home)["lost"]
    assert (e.state, e.launches) == ("failed", 2) and "cannot run %s" % script in e.message, (e.state, e.message)


def test_an_entry_preempted_on_its_own_stops_the_queue_and_is_resumed_first(onbox_home, tmp_path, capsys, fast,
                                                                             cleanup):
    """Its agent got a preemption the runner did not (SIGTERM to the agent alone; on a cloud box, its own notice
    poller): the queue stops there (exit 75), the next entry never starts, and nothing restarts it in a loop."""
    hold = tmp_path / "hold"
    hold.write_text("")
    assert cli(capsys, "queue", "add", "--name", "solo", "--",
               *TRAINER, "--steps", "20", "--hold", str(hold), "--hold-at", "2")[0] == 0
    assert cli(capsys, "queue", "add", "--name", "next", "--", *TRAINER, "--steps", "2")[0] == 0
    with Started() as started:
        runner = started.popen([PY, "-m", "onbox", "queue", "run", "--foreground"], env=env_for(onbox_home),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: "\n{\"step\": 2," in _output(onbox_home, "solo"), timeout=30, what="the entry at step 2")
        agent = entries(onbox_home)["solo"]
        signal_own(onbox_home, agent.agent_pid, signal.SIGTERM, start=agent.agent_start)  # that very agent
        _out, err = runner.communicate(timeout=60)
    assert runner.returncode == 75, err
    now = entries(onbox_home)
    assert (now["solo"].state, now["solo"].launches, now["next"].state) == ("preempted", 1, "pending"), err
    assert state(onbox_home, "solo")["state"] == "preempted" and not (onbox_home / "runs" / "next").exists()
    assert "preemption notice from entry 1 solo" in err


def test_a_live_agent_keeps_its_gpu_when_a_lower_entry_starts_beside_it(onbox_home, tmp_path, capsys, fast, cleanup):
    """A runner that died left entry 2's agent running on GPU 0 and entry 1 to start again (its agent gone, its run
    not ended). The next runner watches entry 2 on GPU 0 first, then starts entry 1 on the free GPU 1, never on
    the GPU the live agent holds. (NVML faked at its seam; entry 2's agent is a stand-in process of this test.)"""
    seen = tmp_path / "seen"
    seen.mkdir()
    for name in ("g0", "g1"):
        assert cli(capsys, "queue", "add", "--name", name, "--", "sh", "-c",
                   'echo "$CUDA_VISIBLE_DEVICES" > %s/$ONBOX_RUN' % seen)[0] == 0
    gone = subprocess.Popen(["true"])
    gone.wait()
    hold = tmp_path / "hold"
    hold.write_text("")
    stand_in = subprocess.Popen(["sh", "-c", 'while [ -e "%s" ]; do sleep 0.05; done' % hold])
    try:
        journal = Journal(str(onbox_home / "queue"))
        with journal.locked():
            found, _ = journal.read()
            journal.set_state(found[1], "running", agent_pid=gone.pid, agent_start=1, gpu=1, launches=1)
            journal.set_state(found[2], "running", agent_pid=stand_in.pid, agent_start=start_time(stand_in.pid),
                              gpu=0, launches=1)
        slots = gpu_slots(_seam(FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b",
                                                                          pci_bus_id="00000000:5E:00.0")])))
        logged = []

        def log(message):
            logged.append(message)
            if message.startswith("entry 1 g0: ") and hold.exists():
                hold.unlink()  # entry 1 ended: the stand-in may end too

        runner = QueueRunner(journal, slots, agent_argv(), str(onbox_home / "runs"), log=log, tick=0.05,
                             environ=subprocess_env({"ONBOX_HOME": str(onbox_home)}))
        runner.run()
    finally:
        if hold.exists():
            hold.unlink()
        stand_in.wait(timeout=30)
    assert "watching the live agent of g1 again (pid %d)" % stand_in.pid in logged, logged
    assert (seen / "g0").read_text().split() == ["1"], logged  # GPU 0 is g1's
