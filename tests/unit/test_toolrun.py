"""The one tool runner (onbox/toolrun.py): each failure becomes the caller's own domain error, worded by the caller;
and each caller's wording, through its runner seam (a recorder) where it has one. A few real processes check what
a fake cannot: the whole process group of a tool in its own session dies at the timeout."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from onbox.errors import ExitCode, JobFailed, UnfitError
from onbox.proc import is_alive
from onbox.toolrun import Helper, Says, Tool, call, stderr_tail, stream
from tests.conftest import subprocess_env
from tests.fakes.recorders import RunnerRecorder
from tests.polling import wait_for


class Refused(JobFailed):
    def __init__(self, message, hint=None, code=None):
        super().__init__(message, hint)
        self.code = code


TOOL = Tool("frob", Refused,
            missing=Says("frob is missing", "install frob", error=UnfitError),
            timed_out=Says("frob {op} hung {timeout:.1f} s", "check {where}", code="ETIMEDOUT"),
            failed=Says("frob {op} failed (exit {rc}): {stderr}", code="EIO"),
            tail=stderr_tail(lines=2, sep=" | "))


def test_a_call_is_a_list_argv_with_a_timeout_and_captured_text():
    r = RunnerRecorder(stdout="ok\n")
    done = TOOL.run(("frob", "x"), 7, runner=r, op="x", where="w")
    (argv, kw), = r.calls
    assert argv == ["frob", "x"] and kw == {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
                                            "timeout": 7}
    assert done.stdout == "ok\n"


def test_each_failure_is_the_callers_error_in_the_callers_words():
    with pytest.raises(UnfitError) as missing:
        TOOL.run(["frob"], 1, runner=RunnerRecorder(exc=FileNotFoundError("frob")), op="x", where="w")
    assert (missing.value.message, missing.value.hint) == ("frob is missing", "install frob")
    with pytest.raises(Refused) as hung:
        TOOL.run(["frob"], 2.5, runner=RunnerRecorder(exc=subprocess.TimeoutExpired(["frob"], 2.5)), op="x", where="net")
    assert (hung.value.message, hung.value.hint, hung.value.code) == ("frob x hung 2.5 s", "check net", "ETIMEDOUT")
    with pytest.raises(Refused) as failed:
        TOOL.run(["frob"], 1, runner=RunnerRecorder(rc=4, stderr="a\nb\n  c  \n"), op="y", where="w")
    assert (failed.value.message, failed.value.hint, failed.value.code) == (
        "frob y failed (exit 4): b |   c", None, "EIO")  # only the tail of stderr, as the tool says


def test_an_unchecked_call_returns_the_exit_code_and_a_timeout_can_read_as_one():
    assert TOOL.run(["frob"], 1, check=False, runner=RunnerRecorder(rc=3)).returncode == 3
    partial = subprocess.TimeoutExpired(["frob"], 1, output=b"half", stderr=b"")
    done = TOOL.run(["frob"], 1, runner=RunnerRecorder(exc=partial), timed_out_rc=255)
    assert (done.returncode, done.stdout) == (255, b"half")


@pytest.mark.parametrize("policy, err, out, want", [
    (stderr_tail(), "  boom \n", "", "boom"),
    (stderr_tail(), "", "said on stdout", ""),
    (stderr_tail(or_stdout=True), "", "said on stdout\n", "said on stdout"),
    (stderr_tail(chars=4, empty="(no output)"), "abcdef", "", "cdef"),
    (stderr_tail(chars=4, empty="(no output)"), " \n", "", "(no output)"),
    (stderr_tail(lines=3, sep=" | "), "1\n2\n3\n4\n", "", "2 | 3 | 4"),
])
def test_what_of_the_output_a_failure_carries(policy, err, out, want):
    assert policy(err, out) == want


def test_a_missing_tool_and_a_failed_one_for_real():
    with pytest.raises(JobFailed, match=r"^onbox-no-such-tool is not installed$"):
        Tool("onbox-no-such-tool").run(["onbox-no-such-tool"], 5)
    with pytest.raises(JobFailed) as e:
        Tool("python").run([sys.executable, "-c", "import sys; sys.stderr.write('bad input\\n'); sys.exit(2)"], 30)
    assert e.value.message.endswith("failed (exit 2): bad input") and e.value.exit_code == ExitCode.JOB_FAILED


def test_a_tool_in_its_own_session_dies_with_its_whole_group_at_the_timeout():
    script = "import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); " \
             "time.sleep(60)"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        call([sys.executable, "-c", script], timeout=2, start_new_session=True, text=True)
    grandchild = int(e.value.output.split()[0])
    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously: bounded, not a sleep-then-assert
    while is_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not is_alive(grandchild)  # not only the process we started: what it started too


def test_input_goes_to_stdin():
    assert call(["cat"], timeout=30, input=b"abc").stdout == b"abc"


def test_callers_keep_their_own_words():
    """Each caller's Tool, on the failures its tests and goldens know."""
    from controller.boxes.ssh import SSH, RemoteCommandFailed, RemoteTimeout
    from onbox.checkpoints import SyncFailed
    from onbox.checkpoints.durable.rclone import RcloneTarget
    from onbox.slurm.job import SlurmError
    from onbox.slurm.script import submit

    t = RcloneTarget("remote:bucket", "r1", runner=RunnerRecorder(rc=5, stderr="x\nERROR : a\nERROR : b\nERROR : c\n"))
    with pytest.raises(SyncFailed) as e:
        t.write_index({})
    assert e.value.message == "rclone copyto failed (exit 5) for remote:bucket/r1: ERROR : a | ERROR : b | ERROR : c"
    assert e.value.errno_name == "EIO" and "previous committed checkpoint is intact" in (e.value.hint or "")
    t = RcloneTarget("remote:bucket", "r1", runner=RunnerRecorder(exc=subprocess.TimeoutExpired(["rclone"], 60)))
    with pytest.raises(SyncFailed, match=r"^rclone lsjson timed out after 60 s \(remote:bucket/r1\)$") as e:
        t.list_names()
    assert e.value.errno_name == "ETIMEDOUT"
    t = RcloneTarget("remote:bucket", "r1", runner=RunnerRecorder(exc=FileNotFoundError("rclone")))
    with pytest.raises(SyncFailed, match=r"^rclone is not installed on this box$"):
        t.list_names()
    # a trap of the box, not of the remote, is named with what to do (the AWS_CA_BUNDLE one against a real old
    # rclone: test_ckpt_s3.py); an rclone older than a flag onbox passes stops with pflag's own words
    t = RcloneTarget("remote:bucket", "r1", runner=RunnerRecorder(rc=1, stderr="Error: unknown flag: --no-check-dest\n"
                                                                          "Usage:\n  rclone copy source:path dest:path\n"))
    with pytest.raises(SyncFailed, match=r"too old for the flags onbox passes$") as e:
        t.write_index({})
    assert "rclone.org/install" in (e.value.hint or "") and "intact" in (e.value.hint or "")

    with pytest.raises(UnfitError, match=r"^sbatch not found on PATH$"):  # exit 3: this box cannot submit
        submit("#!/bin/bash\n", runner=RunnerRecorder(exc=FileNotFoundError("sbatch")))
    with pytest.raises(SlurmError, match=r"^sbatch refused the job \(exit 1\): sbatch: error: no partition$"):
        submit("#!/bin/bash\n", runner=RunnerRecorder(rc=1, stderr="sbatch: error: no partition\n"))
    r = RunnerRecorder(stdout="4242;cluster\n")
    assert submit("#!/bin/bash\n", workdir="/tmp", timeout=9, runner=r) == "4242"
    assert r.calls[0][1]["input"] == "#!/bin/bash\n" and r.calls[0][1]["cwd"] == "/tmp"

    with pytest.raises(RemoteCommandFailed, match=r"^launch on gpu1 exited 3: \(no output\)$"):
        SSH.check(subprocess.CompletedProcess(["ssh"], 3, b"", b"  \n"), what="launch", box="gpu1")
    with pytest.raises(RemoteTimeout, match=r"^launch on gpu1 did not finish within 5 s$"):
        SSH.run(["ssh"], 5, runner=RunnerRecorder(exc=subprocess.TimeoutExpired(["ssh"], 5)), what="launch", box="gpu1")
    with pytest.raises(UnfitError, match=r"^ssh is not installed on this machine$"):
        SSH.run(["ssh"], 5, runner=RunnerRecorder(exc=FileNotFoundError("ssh")), what="launch", box="gpu1")


# -- Helper: a long-lived tool (rclone rcd), real processes --------------------------------------------------------
SLEEPER = [sys.executable, "-c", "import sys, time; print('up', file=sys.stderr, flush=True); time.sleep(60)"]
STARTER = r"""
import sys, threading, time
from onbox.toolrun import Helper
h = Helper(sys.argv[1:])
t = threading.Thread(target=h.start)  # started by a worker thread that ends at once
t.start()
t.join()
time.sleep(0.2)
print(h.pid, h.start_time, flush=True)
time.sleep(60)
"""


def test_a_helper_runs_until_stopped_by_its_pid_and_keeps_its_last_words():
    h = Helper(SLEEPER)
    h.start()
    try:
        assert h.running() and is_alive(h.pid, h.start_time)
        wait_for(lambda: h.tail() == "up", timeout=10, what="its stderr read")
    finally:
        h.stop()
    assert not h.running() and not is_alive(h.pid, h.start_time)
    assert h.returncode == -15  # TERM was enough, and it was reaped
    with pytest.raises(FileNotFoundError):
        Helper(["/nonexistent/onbox-helper"]).start()


def test_a_helper_dies_with_the_process_that_started_it_sigkill_too_not_with_the_thread_that_did():
    starter = subprocess.Popen([sys.executable, "-c", STARTER, *SLEEPER], stdout=subprocess.PIPE, text=True,
                               env=subprocess_env())
    try:
        pid, start = map(int, starter.stdout.readline().split())
        assert is_alive(pid, start)  # its starting thread ended 0.2 s ago: the helper lives on
    finally:
        starter.kill()  # SIGKILL: no handler, no atexit ran
        starter.wait()
        starter.stdout.close()
    wait_for(lambda: not is_alive(pid, start), timeout=10, what="the helper gone with its process")


def test_a_fork_of_the_starter_never_stops_its_helper():
    h = Helper(SLEEPER)
    h.start()
    try:
        child = os.fork()
        if child == 0:  # a fork inherits the object, not the helper
            h.stop()
            os._exit(1 if h.running() else 0)
        _, status = os.waitpid(child, 0)
        assert os.WEXITSTATUS(status) == 0 and h.running() and is_alive(h.pid, h.start_time)
    finally:
        h.stop()
    assert not is_alive(h.pid, h.start_time)


# A progress meter as rsync's --info=progress2 writes it: \r between updates of one line, \n at its end. Each line
# waits for the caller to have seen the one before (a file the callback writes): lines kept until the tool ended
# would never be seen in time, and the tool would say so and fail.
METER = r"""
import os, sys, time
seen = sys.argv[1]
for i, end in enumerate(["\r", "\r", "\n", "\n"]):
    sys.stdout.write("%d%%%s" % (i * 25, end))
    sys.stdout.flush()
    deadline = time.monotonic() + 20
    while not os.path.exists("%s.%d" % (seen, i)):
        if time.monotonic() > deadline:
            sys.stderr.write("line %d was never seen\n" % i)
            sys.exit(3)
        time.sleep(0.01)
sys.stderr.write("meter done\n")
"""


def test_a_streamed_tool_hands_each_line_to_the_caller_as_it_comes(tmp_path):
    seen = []

    def on_line(line):
        open("%s.%d" % (tmp_path / "seen", len(seen)), "w").close()
        seen.append(line)

    done = stream([sys.executable, "-c", METER, str(tmp_path / "seen")], timeout=60, on_line=on_line, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, None, "meter done\n")
    assert seen == ["0%", "25%", "50%", "75%"]


def test_a_streamed_tool_through_a_tool_keeps_the_callers_words():
    lines = []
    said = "import sys; print('10%'); print('20%'); sys.stderr.write('disk full\\n'); sys.exit(11)"
    done = TOOL.run([sys.executable, "-c", said], 60, check=False, on_line=lines.append)
    assert (done.returncode, done.stderr, lines) == (11, "disk full\n", ["10%", "20%"])
    with pytest.raises(Refused, match=r"^frob y failed \(exit 11\): disk full$"):
        TOOL.run([sys.executable, "-c", said], 60, on_line=lines.append, op="y")


# prints its own pid, then its child's, then a progress line, then stalls: a transfer whose link went quiet
STALL = "import subprocess, sys, time, os; p = subprocess.Popen(['sleep', '60']); " \
        "print(os.getpid(), flush=True); print(p.pid, flush=True); print('42%', flush=True); time.sleep(60)"


def test_a_stalled_streamed_tool_is_killed_at_its_timeout_with_its_group():
    lines = []
    try:
        with pytest.raises(Refused, match=r"^frob pull hung 2.0 s$"):
            TOOL.run([sys.executable, "-c", STALL], 2, on_line=lines.append, new_session=True, op="pull",
                     where="w")
        assert lines[2:] == ["42%"]  # what it said before it stalled came through
        for pid in map(int, lines[:2]):  # the tool and what it started: the whole group, and only those
            wait_for(lambda pid=pid: not is_alive(pid), timeout=10, what="pid %d killed" % pid)
    finally:
        for pid in map(int, lines[:2]):
            if is_alive(pid):
                os.kill(pid, 9)


def test_a_streamed_tool_that_ends_in_time_is_left_alone():
    lines = []
    done = stream([sys.executable, "-c", "print('100%')"], timeout=60, on_line=lines.append,
                  start_new_session=True)
    assert (done.returncode, lines) == (0, ["100%"])  # no TimeoutExpired: the watchdog never fired
