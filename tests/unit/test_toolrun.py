"""The one tool runner (onbox/toolrun.py): each failure becomes the caller's own domain error, worded by the caller;
and each caller's wording, through its runner seam (a recorder) where it has one. A few real processes check what
a fake cannot: the whole process group of a tool in its own session dies at the timeout."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from onbox.errors import ExitCode, JobFailed, UnfitError
from onbox.proc import is_alive
from onbox.toolrun import Says, Tool, call, stderr_tail
from tests.fakes.recorders import RunnerRecorder


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
    from controller.ssh import SSH, RemoteCommandFailed, RemoteTimeout
    from onbox.checkpoints import SyncFailed
    from onbox.checkpoints.rclone import RcloneTarget
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
