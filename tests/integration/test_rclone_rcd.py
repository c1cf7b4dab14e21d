"""The rclone target's one long-lived `rclone rcd` (onbox/checkpoints/rcd.py, rclonerc.py), real: rclone 1.75.2
(tests/hosts/s3.py's venv) as daemon and as process.

- each call onbox makes means over rc what it means as a command line: both run side by side on the same trees
  (the local backend), and leave the same files, print the same listing, fail alike;
- a commit starts one rclone process, the daemon, which no other user can reach (its socket in a 0700 dir, a
  random user and password in its environment, none in its argv, a request without them refused);
- it never outlives its committer: closed with the target, SIGKILLed with the process, killed when a call of it
  times out (so its upload goes no further), stopped at a fence; one that ended between calls is started again.
The commit protocol itself over rcd and as processes, on sftp and S3: test_ckpt_rclone.py (rclone_remote)."""
from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
from typing import Dict, List

import pytest

from onbox.checkpoints import SyncFailed
from onbox.checkpoints.commit import CheckpointCommitter
from onbox.checkpoints.durable import rclonerc
from onbox.checkpoints.durable.rcd import MAX_ENDED, Rcd
from onbox.checkpoints.durable.rclone import RcloneTarget
from onbox.checkpoints.leases.fencing import Fenced, RunLease
from onbox.clock import SystemClock
from onbox.proc import is_alive
from tests.checkpoint_files import write_torch_zip
from tests.conftest import subprocess_env
from tests.fakes.recorders import EventRecorder
from tests.hosts import require_built
from tests.hosts.s3 import RCLONE, unavailable_reason
from tests.integration.test_ckpt_rclone import newest
from tests.polling import wait_for
from tests.processes import kill_exact, start_ticks

pytestmark = pytest.mark.integration

# (the call as onbox makes it, with {d} the test's directory) -> run as a process and over rc, on equal trees
CALLS = [
    ["lsjson", "{d}/tree", "-R", "--files-only", "--fast-list", "--no-modtime", "--no-mimetype"],
    ["lsjson", "{d}/tree", "--files-only", "--no-modtime", "--no-mimetype", "--include", "/a.bin"],
    ["lsjson", "{d}/tree/nope", "-R", "--files-only"],
    ["cat", "--count", "5", "{d}/tree/a.bin"],
    ["cat", "--count", "5", "{d}/tree/nope.bin"],
    ["copyto", "{d}/src/MANIFEST.json", "{d}/tree/sub/MANIFEST.json", "--ignore-times"],
    ["copy", "{d}/src", "{d}/tree/new", "--files-from-raw", "{d}/list", "--no-traverse", "--no-check-dest"],
    ["copy", "{d}/tree", "{d}/quarantine", "--exclude", "/a.bin", "--exclude", "/sub/x.bin"],
    ["sync", "{d}/src", "{d}/tree/sub", "--include", "/MANIFEST.json", "--include", "/.onbox-partial"],
    ["delete", "{d}/tree/sub", "--exclude", "/.onbox-partial", "--rmdirs"],
    ["delete", "{d}/tree/sub", "--rmdirs"],  # the emptied dir itself stays
    ["purge", "{d}/tree/sub"],
    ["moveto", "{d}/tree/sub", "{d}/moved"],
    ["backend", "features", "{d}/tree"],
    ["backend", "cleanup", "{d}/tree", "-o", "max-age=0"],  # the local backend has none: both fail
]


def _tree(d: str) -> None:
    files = {"tree/a.bin": b"0123456789", "tree/sub/.onbox-partial": b"", "tree/sub/x.bin": b"x" * 300,
             "tree/sub/deep/y.bin": b"y", "src/MANIFEST.json": b'{"m": 1}', "src/w.bin": b"w" * 70}
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(data)
    with open(os.path.join(d, "list"), "w") as f:
        f.write("w.bin\nMANIFEST.json\n")


def _files(d: str) -> Dict[str, bytes]:
    out = {}
    for root, dirs, names in os.walk(d):
        for n in names + [x for x in dirs if not os.listdir(os.path.join(root, x))]:
            p = os.path.join(root, n)
            out[os.path.relpath(p, d)] = b"<empty dir>"
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    out[os.path.relpath(p, d)] = f.read()
    return out


def _said(op: str, out: bytes) -> object:
    """What a call printed, as onbox reads it."""
    if op == "lsjson":
        return {e["Path"]: e["Size"] for e in json.loads(out)}
    if op == "backend" and out:
        return json.loads(out)["Features"]["DirMove"]
    return out


@pytest.fixture(scope="module")
def rcd():
    require_built(unavailable_reason())
    daemon = Rcd(RCLONE, [])
    assert daemon.ready(), daemon.problem
    yield daemon
    daemon.stop()


@pytest.mark.parametrize("call", CALLS, ids=lambda c: " ".join(a for a in c[:3] if "{d}" not in a))
def test_a_call_means_over_rc_what_it_means_as_a_process(tmp_path, rcd, call):
    cli, rc = str(tmp_path / "cli"), str(tmp_path / "rc")
    _tree(cli)
    _tree(rc)
    by_process = subprocess.run([RCLONE, *[a.format(d=cli) for a in call]], capture_output=True, timeout=60)
    over_rc = rclonerc.run(rcd, [a.format(d=rc) for a in call], 60.0, binary=True)
    assert over_rc is not None, "a call onbox makes is made over rc"
    assert (over_rc.returncode == 0) == (by_process.returncode == 0), (over_rc.stderr, by_process.stderr)
    if by_process.returncode == 0:
        assert _said(call[0], over_rc.stdout) == _said(call[0], by_process.stdout)
    elif call[0] == "lsjson":
        assert over_rc.returncode == by_process.returncode == 3  # directory not found, as rclone says it
    assert _files(rc) == _files(cli)


def test_what_the_rc_path_does_not_know_runs_as_a_process(rcd):
    assert rclonerc.run(rcd, ["copy", "a:", "b:", "--checksum"], 5.0, binary=False) is None
    assert rclonerc.run(rcd, ["rcat", "a:x"], 5.0, binary=False) is None


def _shim(tmp_path) -> tuple:
    """An rclone in front of 1.75.2 that notes the op of each process started."""
    noted = tmp_path / "started"
    shim = tmp_path / "rclone"
    shim.write_text('#!/bin/sh\necho "$1" >> %s\nexec %s "$@"\n' % (noted, RCLONE))
    shim.chmod(0o755)
    return str(shim), noted


def test_a_commit_starts_one_rclone_the_daemon_which_only_this_process_can_reach(tmp_path, s3):
    shim, noted = _shim(tmp_path)
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-1", "model.pt"))
    calls: List[str] = []
    target = RcloneTarget(s3.remote, "r1", rclone=shim, trace=lambda t, args, how: calls.append(how))
    com = CheckpointCommitter(target, "r1", SystemClock(), EventRecorder())
    assert com.commit(newest(src)).status == "committed"
    assert noted.read_text().split() == ["rcd"] and set(calls) == {"rc"}, (noted.read_text(), calls)
    assert os.path.isfile(os.path.join(s3.durable_root, "r1", "checkpoints", "checkpoint-1", "MANIFEST.json"))
    pid, folder = target.rcd.pid, target.rcd._dir
    with open("/proc/%d/environ" % pid, "rb") as f:
        env = dict(kv.partition(b"=")[::2] for kv in f.read().split(b"\0") if kv)
    password = env[b"RCLONE_RC_PASS"]
    assert len(password) >= 32
    with open("/proc/%d/cmdline" % pid, "rb") as f:
        argv = f.read()
    assert password not in argv and env[b"RCLONE_RC_USER"] not in argv  # argv is every user's to read
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    conn = http.client.HTTPConnection("localhost", timeout=10)
    conn.sock = socket.socket(socket.AF_UNIX)
    conn.sock.connect(os.path.join(folder, "rc.sock"))
    conn.request("POST", "/core/version", b"{}", {"Content-Type": "application/json"})
    assert conn.getresponse().status == 401  # no user and password: refused
    conn.close()
    start = start_ticks(pid)
    target.close()
    assert not is_alive(pid, start) and not os.path.exists(folder)


DIES_WITH = r"""
import sys, time
from onbox.checkpoints.durable.rclone import RcloneTarget
target = RcloneTarget(sys.argv[1], "r1")
target.list_names()
print(target.rcd.pid, flush=True)
time.sleep(60)
"""


def test_the_daemon_dies_with_its_committer_sigkilled(tmp_path, s3):
    child = subprocess.Popen([sys.executable, "-c", DIES_WITH, s3.remote], stdout=subprocess.PIPE, text=True,
                             env=dict(subprocess_env(), **s3.env))
    try:
        pid = int(child.stdout.readline())
        start = start_ticks(pid)
        assert start is not None and is_alive(pid, start)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    wait_for(lambda: not is_alive(pid, start), timeout=10, what="the daemon gone with its committer")


def test_a_fork_of_the_committer_leaves_its_daemon_alone(tmp_path, s3):
    shim, noted = _shim(tmp_path)
    target = RcloneTarget(s3.remote, "r1", rclone=shim)
    target.list_names()
    pid = target.rcd.pid
    child = os.fork()
    if child == 0:  # a fork that closes what it inherited (a daemonizing parent, a test's child) as it exits
        target.close()
        os._exit(0)
    os.waitpid(child, 0)
    assert target.list_names() == [] and target.rcd.pid == pid
    assert noted.read_text().split() == ["rcd"]  # the call went to it: its socket is where it was, no process
    target.close()


def test_a_call_that_times_out_kills_the_daemon_and_the_next_call_starts_another(tmp_path, s3):
    src = str(tmp_path / "ck")
    write_torch_zip(os.path.join(src, "checkpoint-1", "model.pt"), payload=os.urandom(2_000_000))
    # 100 kB/s: the payload's upload takes ~20 s; each call is given 3 s (the small ones take milliseconds)
    target = RcloneTarget(s3.remote, "r1", base_timeout=3.0, min_rate=1e12, extra_flags=["--bwlimit", "100k"])
    target.list_names()
    pid = target.rcd.pid
    start = start_ticks(pid)
    with pytest.raises(SyncFailed, match=r"^rclone copy timed out after 3 s") as e:
        CheckpointCommitter(target, "r1", SystemClock(), EventRecorder()).commit(newest(src))
    assert e.value.errno_name == "ETIMEDOUT"
    assert not is_alive(pid, start)  # what it was uploading goes no further
    landed = os.path.join(s3.durable_root, "r1", "checkpoints", "checkpoint-1")
    # no payload object, no manifest: nothing a reader takes (the server drops its temp file of the cut-off upload,
    # `.rclone_temp_put_*`, once it sees the connection gone: on a loaded box that can come a moment later)
    wait_for(lambda: os.listdir(landed) == [".onbox-partial"], timeout=15, what="only the partial marker landed")
    target.base_timeout = 30.0
    assert target.list_names() == ["checkpoint-1"] and target.rcd.pid not in (None, pid)
    # one that ended between calls (killed here) is started again, and the call made on it
    again = target.rcd.pid
    assert kill_exact(again, start_ticks(again))
    wait_for(lambda: target.rcd.pid is None, timeout=10, what="the killed daemon reaped")
    assert target.list_names() == ["checkpoint-1"] and target.rcd.pid not in (None, again)
    target.close()


def test_a_daemon_whose_socket_went_is_replaced(s3):
    calls: List[str] = []
    target = RcloneTarget(s3.remote, "r1", trace=lambda t, args, how: calls.append(how))
    target.list_names()
    pid, folder = target.rcd.pid, target.rcd._dir
    start = start_ticks(pid)
    os.unlink(os.path.join(folder, "rc.sock"))  # as a cleaner of old files in /tmp would
    assert target.list_names() == [] and calls == ["rc", "rc"]
    assert target.rcd.pid not in (None, pid) and not is_alive(pid, start)
    target.close()


def test_a_daemon_that_keeps_ending_by_itself_leaves_the_calls_to_processes(s3):
    calls: List[str] = []
    target = RcloneTarget(s3.remote, "r1", trace=lambda t, args, how: calls.append(how))
    for _ in range(MAX_ENDED):
        target.list_names()
        pid = target.rcd.pid
        assert kill_exact(pid, start_ticks(pid))  # as a crash would
        wait_for(lambda: target.rcd.pid is None, timeout=10, what="the killed daemon reaped")
    assert target.list_names() == [] and target.rcd.problem.startswith("rclone rcd ended by itself 3 times")
    assert calls == ["rc"] * MAX_ENDED + ["cli"] and target.rcd.pid is None


def test_a_fenced_agents_daemon_stops_at_the_fence(s3):
    clock = SystemClock()
    t1, t2 = RcloneTarget(s3.remote, "r1"), RcloneTarget(s3.remote, "r1")

    def take(target: RcloneTarget, over: bool) -> RunLease:
        return RunLease.take(target, "r1", 60.0, over, clock, lambda: [], 1.0, host="h", box="box-0000000" + (
            "1" if target is t1 else "2"), pid=1, start_time=1, alive=lambda p, s: True)

    first = take(t1, False)
    first.check("a write")
    pid = t1.rcd.pid
    start = start_ticks(pid)
    second = take(t2, True)
    with pytest.raises(Fenced):
        first.check("the manifest")
    assert t1.rcd.pid is None and not is_alive(pid, start)  # nothing of the fenced agent writes on
    second.close(release=True)
    assert t2.rcd.pid is None  # the agent's end stops it
