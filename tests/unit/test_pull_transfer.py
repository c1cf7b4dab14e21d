"""The pull's transfer (controller/results/pull.py's Transfer) through the tool runner, with a real child standing
in for rsync: its progress lines reach the caller as they come, an attempt that stalls is killed at its cap and
retried after a backoff the clock seam takes (a FakeClock: no test waits for it), a transfer that ends is left
alone."""
from __future__ import annotations

import sys

import pytest

from controller.boxes.inventory import Box
from controller.results.pull import Transfer
from onbox.clock import FakeClock
from onbox.errors import JobFailed

LINE = "    1,048,576  16%    1.00MB/s    0:00:05"


class RsyncStandIn:
    """An Ssh whose rsync is `script` (python), run once per attempt."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.attempts = 0

    def ensure_master(self, target) -> None:
        pass

    def rsync_argv(self, target, sources, dest, upload, io_timeout, extra):
        self.attempts += 1
        return [sys.executable, "-c", self.script]


def transfer(ssh, clock, **kw):
    seen = []
    tr = Transfer(ssh, Box(name="b1", host="h", in_inventory=False), clock=clock,
                  progress=lambda label, pct, rate: seen.append((label, pct, rate)), **kw)
    return tr, seen


def test_a_stalled_attempt_is_killed_at_its_cap_and_retried_after_a_backoff(tmp_path):
    ssh = RsyncStandIn("import sys, time; sys.stdout.write(%r + '\\r'); sys.stdout.flush(); time.sleep(60)" % LINE)
    clock = FakeClock()
    tr, seen = transfer(ssh, clock, attempts=2, attempt_timeout=1.0, backoff=3.0)
    with pytest.raises(JobFailed) as e:
        tr.fetch("step_5", ["src/"], str(tmp_path / "d") + "/", [])
    assert e.value.message == "pulling step_5 from b1 failed after 2 attempts: pulling step_5 took longer than 1 s"
    assert ssh.attempts == 2 and clock.sleeps == [3.0]  # one backoff, through the clock seam
    assert seen == [("step_5", 16, "1.00MB/s")] * 2  # each attempt's progress before it stalled


def test_a_transfer_that_ends_is_one_attempt_and_a_failed_one_says_rsyncs_words(tmp_path):
    clock = FakeClock()
    tr, seen = transfer(RsyncStandIn("print(%r)" % LINE.replace("16%", "100%")), clock, attempt_timeout=60.0)
    assert tr.fetch("index", ["src"], str(tmp_path / "d") + "/", []) == 1
    assert clock.sleeps == [] and seen == [("index", 100, "1.00MB/s")]
    failing = RsyncStandIn("import sys; sys.stderr.write('rsync: write failed: No space left\\n'); sys.exit(11)")
    tr, _ = transfer(failing, clock, attempts=1, attempt_timeout=60.0)
    with pytest.raises(JobFailed, match=r"after 1 attempts: rsync of logs from b1 exited 11: rsync: write failed: No "
                                        r"space left$"):
        tr.fetch("logs", ["src"], str(tmp_path / "d") + "/", [])
