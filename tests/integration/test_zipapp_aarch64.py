"""dist/onbox-aarch64.pyz executed: Debian's arm64 python3.11 (build/arm64-sysroot.sh, `make arm64-sysroot`) under
qemu user mode runs `--version`, `audit --json`, a foreground run of an aarch64 child, and a detached run that
`onbox status` sees and `onbox stop` stops.

No binfmt handler is registered (never on the host): the python runs as `qemu-aarch64-static PYTHON`, the sysroot is
named by QEMU_LD_PREFIX (which, unlike `-L`, reaches the emulated processes' children), and an aarch64 child is run
as `-- qemu-aarch64-static ROOT/bin/busybox ...`, as a box's own aarch64 binaries would be run natively.

What qemu changes (the detached test checks it): qemu-user answers an emulated process's reads of its OWN
/proc/self/stat and /proc/<own pid>/stat itself (linux-user/syscall.c, open_self_stat) with a start time taken when
that qemu process started, kept across fork(), and pgrp and session 0; reads of other processes' stat files reach
the kernel. The detached agent (a grandchild of `onbox run`, after the double fork) therefore records the start time
of the `onbox run` that launched it, which no reader ever sees for that pid. What compares the recorded pair alone
(`onbox node probe --run`) takes such an agent for dead; `onbox status` still finds it through the run's lock file
(the lock holder's start time is read from outside), and `onbox stop` ends the run. A real aarch64 kernel reports
the true start time to the process itself: this is qemu only, not a bug of the aarch64 build.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from onbox.multinode.probe import addresses
from tests.conftest import REPO_ROOT
from tests.integration.supervisor_helpers import FAST, state
from tests.polling import wait_for
from tests.processes import start_ticks

pytestmark = pytest.mark.integration

SYSROOT = os.path.join(REPO_ROOT, "build", "out", "arm64-sysroot")
QEMU_TIMEOUT = 120  # one emulated start costs about a second of CPU; a loaded 2-core machine stretches it


@pytest.fixture(scope="module")
def qemu():
    found = shutil.which("qemu-aarch64-static")
    if found is None:
        pytest.skip("qemu-aarch64-static missing (build/sysdeps.sh installs qemu-user-static)")
    return found


@pytest.fixture(scope="module")
def sysroot():
    if not os.path.isfile(os.path.join(SYSROOT, ".installed")):
        pytest.skip("no arm64 sysroot in %s (`make arm64-sysroot` builds it; `make test` does)" % SYSROOT)
    return SYSROOT


@pytest.fixture(scope="module")
def shiv_root(tmp_path_factory):
    """One extraction root for the module: the first start extracts (a few seconds emulated), the rest are warm."""
    return str(tmp_path_factory.mktemp("shiv-aarch64"))


@pytest.fixture
def arm_onbox(qemu, sysroot, shiv_root, dist, onbox_home, tmp_path):
    """Run the aarch64 pyz with the emulated python, in a box-like environment (no venv, private HOME)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(home),
           "ONBOX_HOME": str(onbox_home), "SHIV_ROOT": shiv_root, "QEMU_LD_PREFIX": sysroot, **FAST}
    argv = [qemu, os.path.join(sysroot, "usr", "bin", "python3.11"), str(dist / "onbox-aarch64.pyz")]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=QEMU_TIMEOUT,
                              stdin=subprocess.DEVNULL)

    return run


def arm_child(qemu, sysroot, *args):
    """An aarch64 busybox command line (qemu in front: no binfmt)."""
    return [qemu, os.path.join(sysroot, "bin", "busybox"), *args]


def test_version_and_audit_under_the_arm64_python(arm_onbox, sysroot):
    r = arm_onbox("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("onbox, version ")
    r = arm_onbox("audit", "--json", "--profile", "local", "--min-free-gb", "0")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["fit"] is True
    py = {c["name"]: c for c in doc["checks"]}["python"]
    assert py["data"]["executable"] == os.path.join(sysroot, "usr", "bin", "python3.11")  # the emulated one
    assert py["data"]["version"].startswith("3.11.")


def test_foreground_run_of_an_aarch64_child(arm_onbox, qemu, sysroot, onbox_home, cleanup):
    child = arm_child(qemu, sysroot, "sh", "-c", 'echo "machine $(uname -m) run $ONBOX_RUN"; exit 3')
    r = arm_onbox("run", "--foreground", "--name", "arm-fg", "--restart", "never", "--", *child)
    assert r.returncode == 1, r.stderr  # the job failed: its own exit 3 is in the record
    st = state(onbox_home, "arm-fg")
    assert st["state"] == "failed"
    assert [a["exit"]["code"] for a in st["attempts"]] == [3]
    with open(os.path.join(str(onbox_home), "runs", "arm-fg", "output.log")) as f:
        assert "machine aarch64 run arm-fg" in f.read()


def test_detached_run_status_probe_and_stop(arm_onbox, qemu, sysroot, onbox_home, cleanup):
    r = arm_onbox("run", "--name", "arm-bg", "--", *arm_child(qemu, sysroot, "sleep", "60"))
    assert r.returncode == 0, r.stderr
    st = wait_for(lambda: (lambda s: s if s.get("state") == "running" and s.get("child_pid") else None)(
        state(onbox_home, "arm-bg")), timeout=30, what="the detached aarch64 run to be running")
    agent, kernel_start = st["agent_pid"], start_ticks(st["agent_pid"])
    assert kernel_start is not None, "the agent %d is gone" % agent
    # qemu's answer to the agent's read of its own stat (see the module docstring): the launcher's start time,
    # earlier than the agent's own. Should qemu ever answer with the kernel's value, this note can go.
    assert st["agent_start_time"] < kernel_start, (st["agent_start_time"], kernel_start)
    assert start_ticks(st["child_pid"]) == st["child_start_time"]  # the child's own start, read from outside

    r = arm_onbox("status", "--json", "arm-bg")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    shown = shown[0] if isinstance(shown, list) else shown
    # Found through the lock file: the holder's pid and its start time as the kernel reports it.
    assert (shown["state"], shown["agent_alive"]) == ("running", True), shown.get("note")
    assert (shown["agent_pid"], shown["agent_start_time"]) == (agent, kernel_start)

    # psutil's aarch64 library loads: the addresses are the ones psutil finds natively. The probe's agent_alive
    # compares the recorded start time and so reads false under qemu (not asserted: it is qemu's doing).
    r = arm_onbox("node", "probe", "--json", "--run", "arm-bg")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["addrs"] == addresses()

    r = arm_onbox("stop", "--json", "arm-bg")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "stopped"
    wait_for(lambda: start_ticks(st["child_pid"]) != st["child_start_time"], timeout=10,
             what="the aarch64 child to be gone after onbox stop")
