"""What an attempt leaves running is stopped when the attempt ends, also a process that left the attempt's session
and its process tree (a double fork and setsid): found by the per-attempt marker in its environment."""
from __future__ import annotations

import sys
import textwrap

import pytest

from onbox.proc import is_alive
from tests.integration.supervisor_helpers import events, onbox, state
from tests.processes import Started

pytestmark = pytest.mark.integration
PY = sys.executable

# The child double-forks a grandchild into a session of its own (`setsid sleep 301 &`, by hand), waits until the
# grandchild wrote "<pid> <start time>" and exits 0: the grandchild is nobody's child and nobody's session member.
DOUBLE_FORK = textwrap.dedent("""
    import os, signal, sys, time
    pidfile = sys.argv[1]
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what the test relies on; kept across exec
            start = open("/proc/self/stat").read().rpartition(")")[2].split()[19]
            with open(pidfile + ".tmp", "w") as f:
                f.write("%d %s" % (os.getpid(), start))
            os.rename(pidfile + ".tmp", pidfile)
            os.execvp("sleep", ["sleep", "301"])
        os._exit(0)
    os.wait()
    for _ in range(2000):
        if os.path.exists(pidfile):
            break
        time.sleep(0.01)
    sys.exit(0)
""")


def test_a_double_forked_setsid_grandchild_is_stopped_when_the_run_ends_done(onbox_home, tmp_path):
    pidfile = tmp_path / "grandchild"
    with Started(onbox_home) as started:
        r = onbox(onbox_home, "run", "--foreground", "--name", "lo", "--", PY, "-c", DOUBLE_FORK, str(pidfile))
        pid, start = (int(x) for x in pidfile.read_text().split())
        started.add(pid, start)
        assert r.returncode == 0, r.stderr
        assert state(onbox_home, "lo")["state"] == "done"
        assert not is_alive(pid, start)
        stopped = [e for e in events(onbox_home, "lo") if e["type"] == "attempt_leftovers_stopped"]
        assert len(stopped) == 1 and pid in stopped[0]["pids"]
        assert stopped[0]["commands"][stopped[0]["pids"].index(pid)] == "sleep 301"
        steps = [e for e in events(onbox_home, "lo") if e["type"] == "attempt_leftovers_signal"]
        assert steps and steps[0]["signal"] == "SIGTERM" and pid in steps[0]["pids"]
