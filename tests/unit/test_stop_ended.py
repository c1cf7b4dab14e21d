"""`onbox stop` of a run that has ended while its agent still finishes (its final beat, its last records): the
outcome is `already_ended`, never a second stop asked of an agent that is leaving; with --wait (the default) it
returns once that agent is gone, with --no-wait at once. The "agent" is a process this test started, named in
state.json by pid and start time, as the agent names itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from onbox import paths, vocab
from onbox.launch.stopping import prepare_stop, stop
from onbox.proc import start_time
from onbox.supervisor.rundir import RunDir

AGENT = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)  # the run's lock, held for the agent's whole life as the real one holds it
open(sys.argv[2], "w").close()
time.sleep(1.5)
"""


def test_a_run_that_ended_while_its_agent_finishes_is_already_ended(tmp_path):
    rd = RunDir(str(tmp_path / "runs" / "ended"))
    os.makedirs(rd.path)
    ready = str(tmp_path / "ready")
    agent = subprocess.Popen([sys.executable, "-c", AGENT, rd.lock_path, ready])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(rd.state_path, "w") as f:
            json.dump({"state": "stopped", "agent_pid": agent.pid, "agent_start_time": start_time(agent.pid)}, f)
        t0 = time.monotonic()
        asked = stop(prepare_stop(rd, wait=False))
        assert asked.outcome == vocab.STOP_ALREADY_ENDED and agent.poll() is None and time.monotonic() - t0 < 1.0
        assert not os.path.exists(os.path.join(rd.path, paths.STOP_REQUEST))  # nothing asked of it
        waited = stop(prepare_stop(rd, wait=True, timeout=30))
        assert waited.outcome == vocab.STOP_ALREADY_ENDED and agent.poll() is not None  # returned once it was gone
    finally:
        agent.kill()
        agent.wait(timeout=10)
