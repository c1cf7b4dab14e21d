"""Fixtures for the GPU reaper tests: stand-in NVIDIA device files and real processes holding them.

`gpu_devices` makes tmp files nvidia0, nvidia1, nvidiactl, nvidia-uvm and returns their glob (the holder scan's
device pattern is a parameter). `spawn_holder(...)` starts a process holding some of them (optionally forking
workers, in a new session, as another uid, or in a new PID namespace via `unshare`); the fixture kills exactly the
processes it started (parents and workers, by pid and start time) at teardown.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
from typing import List, Optional

import pytest

from tests.processes import Started, start_ticks

HOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_holder_proc.py")


@dataclasses.dataclass
class Spawned:
    popen: subprocess.Popen
    pid: int  # the holding process, as /proc here sees it
    workers: List[int]
    sid: int  # its session id, read while it was alive
    start_ticks: int  # /proc/<pid>/stat field 22, what the supervisor records as an attempt's start_time


@pytest.fixture
def gpu_devices(tmp_path):
    d = tmp_path / "dev"
    d.mkdir(mode=0o755)
    os.chmod(str(tmp_path), 0o755)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (d / name).write_bytes(b"")
        os.chmod(str(d / name), 0o666)
    return str(d / "nvidia*")


@pytest.fixture
def spawn_holder(gpu_devices):
    started: List[Spawned] = []
    ours = Started()  # every holder process by pid and start time, for the teardown
    dev_dir = os.path.dirname(gpu_devices)

    def spawn(files=("nvidia0", "nvidiactl", "nvidia-uvm"), workers: int = 0, ignore_term: int = 0,
              uid: Optional[int] = None, new_session: bool = True, new_pid_ns: bool = False,
              env: Optional[dict] = None) -> Spawned:
        argv = [sys.executable, HOLDER, str(workers), str(ignore_term), str(-1 if uid is None else uid)]
        argv += [os.path.join(dev_dir, f) for f in files]
        if new_pid_ns:
            argv = ["unshare", "--pid", "--fork", "--", *argv]
        p = subprocess.Popen(argv, start_new_session=new_session, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             env=dict(os.environ, **(env or {})))
        ready, _, _ = select.select([p.stdout], [], [], 30.0)
        line = p.stdout.readline() if ready else b""  # type: ignore[union-attr]
        p.stdout.close()  # type: ignore[union-attr]
        if not line:
            p.kill()
            p.wait(timeout=10)
            raise AssertionError("holder did not start (exit %s)" % p.returncode)
        doc = json.loads(line)
        ticks = start_ticks(doc["pid"])
        assert ticks is not None, "holder %d gone at once" % doc["pid"]
        s = Spawned(popen=p, pid=doc["pid"], workers=doc["workers"], sid=os.getsid(doc["pid"]), start_ticks=ticks)
        started.append(s)
        for pid in [s.pid, *s.workers, p.pid]:
            ours.add(pid)
        return s

    yield spawn
    ours.kill()
    for s in started:
        try:
            s.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
