"""The contract with the subsystems (runhooks.py), checked on the real loop in this process with real children:
restore before each attempt (ONBOX_RESUME_FROM + resume args), periodic and tick every tick, every output line,
every progress record (parsed once by the loop's feed), every event, the reaper before each attempt with the earlier session ids, final(deadline) on preemption, close,
and the Slurm requeue call."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

from onbox.config import RunConfig
from onbox.fsutil import atomic_write
from onbox.proc import set_child_subreaper
from onbox.supervisor.hooks import Hooks
from onbox.supervisor.loop import RunState, Seams, Supervisor
from onbox.supervisor.rundir import RunDir

pytestmark = pytest.mark.integration
PY = sys.executable


class Recorder:
    """Implements all three hook protocols and records every call."""

    def __init__(self, resume: Optional[str]) -> None:
        self.resume = resume
        self.calls: List[tuple] = []
        self.lines: List[str] = []
        self.records: List[Dict[str, float]] = []
        self.events: List[Dict[str, Any]] = []

    def restore(self) -> Optional[str]:
        self.calls.append(("restore",))
        return self.resume

    def periodic(self) -> None:
        self.calls.append(("periodic",))

    def after_failure(self, seconds: float) -> bool:
        self.calls.append(("after_failure", seconds))
        return False

    def final(self, deadline: float) -> Optional[Dict[str, Any]]:
        self.calls.append(("final", deadline))
        return {"name": "step-7"}

    def on_output(self, line: str) -> None:
        self.lines.append(line)

    def on_progress(self, fields: Dict[str, float]) -> None:
        self.records.append(dict(fields))

    def on_event(self, event: Dict[str, Any]) -> None:
        self.events.append(event)

    def tick(self, state: Dict[str, Any]) -> None:
        self.calls.append(("tick", state["state"]))

    def close(self, state: Dict[str, Any]) -> None:
        self.calls.append(("close", state["state"]))

    def before_attempt(self, earlier_sessions: List[int]) -> None:
        self.calls.append(("before_attempt", list(earlier_sessions)))


def _supervisor(tmp_path, command, resume=None, environ=None, **cfg_fields):
    rec = Recorder(resume)
    cfg = RunConfig(name="hk", command=command, notice_source="none", tick_interval=0.02, backoff_initial=0.01,
                    term_timeout=0.3, sync_reserve=0.0, **cfg_fields).validate()
    rd = RunDir(str(tmp_path / "runs" / "hk"))
    os.makedirs(rd.path)
    rd.write_config(cfg.to_dict())
    requeued: List[str] = []
    sup = Supervisor(cfg, rd, hooks_factory=lambda ctx: Hooks(rec, rec, rec),
                     seams=Seams(requeue=lambda job: requeued.append(job) or True,
                                 environ=dict(os.environ, **(environ or {})), log=lambda m: None))
    return sup, rec, requeued


def test_restart_cycle_drives_every_hook(tmp_path):
    probe = tmp_path / "argv.jsonl"
    code = ("import json, os, sys; open(%r, 'a').write(json.dumps([sys.argv[1:], os.environ['ONBOX_RESUME_FROM'], "
            "os.environ['ONBOX_RESTART_COUNT']]) + '\\n'); print('out-line', os.environ['ONBOX_RESTART_COUNT']); "
            "print('step', os.environ['ONBOX_RESTART_COUNT'], 'loss 0.5'); "
            "sys.exit(0 if os.environ['ONBOX_RESTART_COUNT'] == '1' else 1)" % str(probe))
    sup, rec, _ = _supervisor(tmp_path, [PY, "-c", code], resume="/ck/step-5",
                              resume_args=["--init_from=resume", "--ckpt={ckpt}"], final_sync_timeout=42.0)
    assert sup.run() == RunState.DONE
    t_end = time.monotonic()
    seen = [json.loads(line) for line in probe.read_text().splitlines()]
    assert seen == [[["--init_from=resume", "--ckpt=/ck/step-5"], "/ck/step-5", "0"],
                    [["--init_from=resume", "--ckpt=/ck/step-5"], "/ck/step-5", "1"]]
    names = [c[0] for c in rec.calls]
    assert names.count("restore") == 2 and "periodic" in names and "tick" in names
    befores = [c[1] for c in rec.calls if c[0] == "before_attempt"]
    first_sid = sup.attempts[0]["sid"]
    assert befores == [[], [first_sid]]
    assert rec.calls[-1] == ("close", "done")
    # the run ended without a notice: one final commit, after the last attempt (none before the restart), with
    # the final_sync_timeout as its deadline
    finals = [(i, c[1]) for i, c in enumerate(rec.calls) if c[0] == "final"]
    last_restore = max(i for i, c in enumerate(rec.calls) if c[0] == "restore")
    assert len(finals) == 1 and finals[0][0] > last_restore
    assert t_end + 42.0 - 5.0 <= finals[0][1] <= t_end + 42.0
    assert "out-line 0" in rec.lines and "out-line 1" in rec.lines
    assert rec.records == [{"step": 0, "loss": 0.5}, {"step": 1, "loss": 0.5}]
    types = [e["type"] for e in rec.events]
    assert types.count("exit") == 2 and "state" in types


def test_preemption_calls_final_with_the_deadline_and_requeues_under_slurm(tmp_path):
    sup, rec, requeued = _supervisor(tmp_path, [PY, "-c", "import time; time.sleep(30)"], grace=7.0,
                                     environ={"SLURM_JOB_ID": "4242"})
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGCHLD)}
    t0 = time.monotonic()
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        assert sup.run() == RunState.PREEMPTED
    finally:
        timer.cancel()
    finals = [c for c in rec.calls if c[0] == "final"]
    assert len(finals) == 1 and t0 + 7.0 <= finals[0][1] <= time.monotonic() + 7.0
    assert requeued == ["4242"]
    assert sup.state_doc()["preemption"]["source"] == "signal:SIGUSR1"
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored in `finally`
    assert signal.set_wakeup_fd(-1) == -1  # and the wakeup fd
    assert set_child_subreaper(False) is False  # and this process is no subreaper again


def test_no_requeue_when_disabled_and_stop_request_stops(tmp_path):
    sup, rec, requeued = _supervisor(tmp_path, [PY, "-c", "import time; time.sleep(30)"], requeue=False,
                                     environ={"SLURM_JOB_ID": "1"})
    timer = threading.Timer(0.3, lambda: atomic_write(sup.rd.stop_request, '{"grace": 2}'))
    timer.start()
    try:
        assert sup.run() == RunState.STOPPED
    finally:
        timer.cancel()
    assert requeued == [] and not os.path.exists(sup.rd.stop_request)
    assert sup.last_exit["classification"] == "stopped"
    assert any(c[0] == "final" for c in rec.calls)


def _bystander():
    """An unrelated live session (someone's shell, another run's child) whose leader has pid == sid."""
    import subprocess

    p = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], start_new_session=True,
                         stdin=subprocess.DEVNULL)
    from onbox.proc import start_time

    return p, start_time(p.pid)


@pytest.mark.parametrize("recorded", ["other-leader-start", "other-boot"])
def test_a_relaunch_never_kills_whoever_leads_the_old_attempts_session_id_now(tmp_path, recorded):
    # a run re-launched days later (or after a reboot, ONBOX_HOME on a persistent disk) clears the session of
    # its last recorded attempt; that id is a pid the kernel may have handed to anyone since
    p, ticks = _bystander()
    try:
        sup, _rec, _ = _supervisor(tmp_path, [PY, "-c", "pass"])
        old = {"n": 0, "pid": p.pid, "sid": p.pid, "pgid": p.pid, "start_time": ticks, "started_at": 1.0,
               "ended_at": 2.0, "boot_id": None}
        if recorded == "other-leader-start":
            old["start_time"] = ticks - 1 if ticks else 1
        else:
            old["boot_id"] = "00000000-0000-0000-0000-000000000000"
        sup.launcher.attempts = [old]
        assert sup.run() == RunState.DONE
        assert p.poll() is None, "the bystander session %d was killed" % p.pid
        assert sup.attempts[-1].get("boot_id")  # recorded for the next relaunch
    finally:
        p.kill()
        p.wait()
