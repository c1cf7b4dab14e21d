"""A real `onbox run` whose checkpoint dir is far too large (issue 19: `--ckpt-dir /` made the agent read every file
of the machine for over a minute, deaf to SIGTERM): the scan stops at its bound (shrunk here through the
ONBOX_SCAN_MAX_* knobs), the run says the dir is implausibly large (an event, the warning in `onbox status`), and
SIGTERM still stops it promptly."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.integration.supervisor_helpers import env_for, events, onbox
from tests.polling import wait_for
from tests.processes import Started

pytestmark = [pytest.mark.integration]
PY = sys.executable

# Exits 0 on SIGTERM (its "checkpoint"), after saying so.
TRAINER = textwrap.dedent("""
    import signal, sys, time
    def on_term(signum, frame):
        print("child-got-term", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("child-up", flush=True)
    for _ in range(60000):
        time.sleep(0.01)
    sys.exit(3)
""")


def wide(root):
    for d in range(20):
        sub = root / ("shard-%02d" % d)
        sub.mkdir(parents=True)
        for f in range(50):
            (sub / ("part-%03d.bin" % f)).write_bytes(b"x")


def deep(root):
    d = root / "nest"
    for i in range(12):
        d = d / ("level-%d" % i)
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"x")


CASES = {"entries": (wide, {"ONBOX_SCAN_MAX_ENTRIES": "200"}, "more than 200 entries"),
         "depth": (deep, {"ONBOX_SCAN_MAX_DEPTH": "4"}, "directories nested more than 4 levels deep (%s/nest/level-0/"
                                                               "level-1/level-2/level-3)")}


@pytest.mark.parametrize("bound", sorted(CASES))
def test_a_too_large_checkpoint_dir_is_said_and_sigterm_still_stops_the_run_promptly(tmp_path, onbox_home, bound,
                                                                                     cleanup):
    ck = tmp_path / "ck"
    build, knobs, why = CASES[bound][0], CASES[bound][1], CASES[bound][2].replace("%s", str(ck))
    build(ck)
    log = onbox_home / "runs" / "big" / "output.log"
    with Started() as started:
        p = started.popen([PY, "-m", "onbox", "run", "--foreground", "--name", "big", "--ckpt-dir", str(ck),
                           "--grace", "20", "--", PY, "-c", TRAINER],
                          env=env_for(onbox_home, **knobs), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL)
        wait_for(lambda: log.exists() and "child-up" in log.read_text(), what="the trainer running")
        said = wait_for(lambda: [e for e in events(onbox_home, "big") if e["type"] == "checkpoint_dir_too_large"],
                        what="the checkpoint_dir_too_large event")
        assert said[0]["bound"] == bound and why in said[0]["error"], said[0]["error"]
        status = wait_for(lambda: (lambda r: "implausibly large" in r.stdout and r)(onbox(onbox_home, "status", "big")),
                          what="the warning in `onbox status`")
        assert "WARNING: the checkpoint dir %s is implausibly large for checkpoints: %s" % (ck, why) in status.stdout, status.stdout
        assert "is --ckpt-dir the directory the trainer saves to?" in status.stdout
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)  # the agent this test started, by its PID
        _out, err = p.communicate(timeout=60)
        took = time.monotonic() - sent
    assert p.returncode == 75, err
    assert took < 10, "the agent took %.1f s to stop on SIGTERM" % took
    assert "child-got-term" in log.read_text()
    kinds = [e["type"] for e in events(onbox_home, "big")]
    assert kinds.count("checkpoint_dir_too_large") == 1 and "hook_error" not in kinds
