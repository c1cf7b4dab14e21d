"""A real single-node Slurm 22.05 (munged + slurmctld + slurmd) started in the foreground from a temp dir.

Everything lives under one temp dir with its own ports; the fixture records the PIDs it
started and stops exactly those. Every client command needs SLURM_CONF: use `cluster.env()` / `cluster.run()`.
Session-scoped: start-up is cheap (< 1 s) but requeue cycles are not (6-8 s each, cred_expire=5), so tests should
keep their number small.
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import pytest

SBIN = "/usr/sbin"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _missing_tools() -> List[str]:
    tools = [os.path.join(SBIN, "slurmctld"), os.path.join(SBIN, "slurmd"), os.path.join(SBIN, "munged"),
             "sbatch", "scontrol", "squeue", "scancel", "sinfo"]
    return [t for t in tools if not (os.path.isabs(t) and os.access(t, os.X_OK)) and not shutil.which(t)]


class SlurmCluster:
    """Handles to the running cluster: its config path, env for client commands, and job helpers."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.host = socket.gethostname().split(".")[0]
        self.procs: List[subprocess.Popen] = []

    # --- clients -----------------------------------------------------------------------------------------------
    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = self.conf
        if extra:
            env.update(extra)
        return env

    def run(self, argv: List[str], timeout: float = 30.0, check: bool = True,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        cp = subprocess.run(argv, env=self.env(env), capture_output=True, text=True, timeout=timeout)
        if check and cp.returncode != 0:
            raise AssertionError("%s failed (%d): %s%s" % (argv, cp.returncode, cp.stdout, cp.stderr))
        return cp

    def job(self, job_id: str) -> Dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once the job is gone."""
        cp = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False, timeout=15)
        if cp.returncode != 0:
            return {}
        out: Dict[str, str] = {}
        for m in re.finditer(r"(\w+(?::\w+)?)=(\S*)", cp.stdout):
            out.setdefault(m.group(1), m.group(2))
        return out

    def wait_job(self, job_id: str, states: "tuple[str, ...]", timeout: float = 60.0,
                 restarts: Optional[int] = None) -> Dict[str, str]:
        """Poll until the job is in one of `states` (and, if given, has been restarted that many times)."""
        deadline = time.monotonic() + timeout
        info: Dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states and (restarts is None or int(info.get("Restarts", "0")) >= restarts):
                return info
            time.sleep(0.2)
        raise AssertionError("job %s not in %s (restarts>=%s) within %.0fs: %s" % (job_id, states, restarts,
                                                                                   timeout, info))

    def cancel_all(self, timeout: float = 30.0) -> None:
        cp = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=15)
        ids = [x for x in cp.stdout.split() if x.strip()]
        if not ids:
            return
        self.run(["scancel", "--full", *ids], check=False, timeout=15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=15).stdout.strip():
                return
            time.sleep(0.2)

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        root = self.root
        os.chmod(root, 0o755)  # munged refuses a socket dir that is not 755, and runs as `munge`
        munge = pwd.getpwnam("munge")
        mdir = os.path.join(root, "munge")
        for d in ("munge", "munge/key", "munge/log", "munge/seed"):
            p = os.path.join(root, d)
            os.makedirs(p, exist_ok=True)
            os.chown(p, munge.pw_uid, munge.pw_gid)
            os.chmod(p, 0o755 if d == "munge" else 0o700)
        key = os.path.join(mdir, "key", "munge.key")
        self.munge_socket = os.path.join(mdir, "munge.socket")
        subprocess.run([os.path.join(SBIN, "mungekey"), "--create", "--keyfile=" + key], check=True, timeout=30,
                       user=munge.pw_uid, group=munge.pw_gid, stdout=subprocess.DEVNULL)
        self._spawn([os.path.join(SBIN, "munged"), "-F", "--socket=" + self.munge_socket, "--key-file=" + key,
                     "--pid-file=" + os.path.join(mdir, "seed", "munged.pid"),
                     "--seed-file=" + os.path.join(mdir, "seed", "munged.seed"),
                     "--log-file=" + os.path.join(mdir, "log", "munged.log")],
                    "munged.out", user=munge.pw_uid, group=munge.pw_gid)
        self._wait(lambda: os.path.exists(self.munge_socket), timeout, "munged socket")
        for d in ("state", "spool", "log"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        self.write_conf()
        self._spawn([os.path.join(SBIN, "slurmctld"), "-D", "-f", self.conf], "slurmctld.out")
        self._spawn([os.path.join(SBIN, "slurmd"), "-D", "-f", self.conf], "slurmd.out")

        def idle() -> bool:
            cp = self.run(["sinfo", "-h", "-o", "%T"], check=False, timeout=10)
            return cp.returncode == 0 and cp.stdout.strip() == "idle"

        self._wait(idle, timeout, "slurm node idle")

    def write_conf(self) -> None:
        r = self.root
        conf = f"""\
ClusterName=onboxtest
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
InactiveLimit=0
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as f:
            f.write(conf)

    def _spawn(self, argv: List[str], out_name: str, **kw) -> None:
        with open(os.path.join(self.root, out_name), "wb") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self.env(), **kw)
        self.procs.append(p)

    def _wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError("%s exited with %s while waiting for %s; logs in %s"
                                       % (p.args[0], p.returncode, what, self.root))
            if cond():
                return
            time.sleep(0.05)
        raise RuntimeError("timed out waiting for %s; logs in %s" % (what, self.root))

    def stop(self) -> None:
        try:
            self.cancel_all()
        except Exception as e:  # teardown must still stop the daemons
            print("slurm fixture: cancel_all failed: %s" % e, file=sys.stderr)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged: exactly the PIDs we started
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node Slurm; skipped (with the reason) where Slurm/munge are not installed or not root."""
    missing = _missing_tools()
    if missing:
        pytest.skip("Slurm not installed (%s): run `bash build/sysdeps.sh`" % ", ".join(missing))
    if os.geteuid() != 0:
        pytest.skip("the Slurm fixture runs slurmd as root (SlurmdUser=root)")
    root = tempfile.mkdtemp(prefix="onbox-slurm-")
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        if os.environ.get("ONBOX_KEEP_SLURM_LOGS") is None:
            shutil.rmtree(root, ignore_errors=True)
