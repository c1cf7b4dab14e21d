"""A "rented box" for controller tests: a real OpenSSH server, on loopback or inside a network
namespace with its own address, whose /root is a private temp directory (a mount namespace), so the box's
~/.onbox never touches this machine's real home.

Fixtures: `sshd_box` (loopback), `netns_box` (own address, cuttable network). Both stop exactly the PIDs they
start and remove exactly the namespace and route they add.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from typing import List, Optional, Tuple

import pytest

from tests.hosts import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SSHD = "/usr/sbin/sshd"


def have_sshd() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh") is not None and shutil.which("rsync") is not None


class Netns:
    """A network namespace with its own address on a veth pair; cut() drops packets like a real partition."""

    def __init__(self, tag: Optional[str] = None) -> None:
        pid = os.getpid()
        self.tag = tag or "c%d" % (pid % 100000)
        self.ns = "onbox-%s" % self.tag
        self.host_if = ("v%sh" % self.tag)[:15]
        self.ns_if = ("v%sn" % self.tag)[:15]
        third = 100 + pid % 150  # a /24 in 10.200.0.0/16 derived from the pid ...
        for i in range(150):  # ... skipping any /24 another fixture already routes
            cand = 100 + (pid + i) % 150
            used = subprocess.run(["ip", "route", "show", "10.200.%d.0/24" % cand], capture_output=True,
                                  text=True).stdout.strip()
            if not used:
                third = cand
                break
        self.subnet = "10.200.%d.0/24" % third
        self.host_addr = "10.200.%d.1" % third
        self.box_addr = "10.200.%d.2" % third
        self.up = False

    def create(self) -> "Netns":
        ip = ["ip"]
        # U: the unreachable route first, so a cut never sends packets out of the machine (tests/hosts/netns.py)
        subprocess.run([*ip, "route", "replace", "unreachable", self.subnet, "metric", "4242"], check=True)
        self.up = True
        subprocess.run([*ip, "netns", "add", self.ns], check=True)
        subprocess.run([*ip, "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if], check=True)
        subprocess.run([*ip, "link", "set", self.ns_if, "netns", self.ns], check=True)
        subprocess.run([*ip, "addr", "add", self.host_addr + "/24", "dev", self.host_if], check=True)
        subprocess.run([*ip, "link", "set", self.host_if, "up"], check=True)
        subprocess.run([*ip, "-n", self.ns, "addr", "add", self.box_addr + "/24", "dev", self.ns_if], check=True)
        subprocess.run([*ip, "-n", self.ns, "link", "set", self.ns_if, "up"], check=True)
        subprocess.run([*ip, "-n", self.ns, "link", "set", "lo", "up"], check=True)
        self.check_route()
        return self

    def check_route(self) -> None:
        out = subprocess.run(["ip", "route", "get", self.box_addr], capture_output=True, text=True).stdout
        assert "dev %s" % self.host_if in out or "unreachable" in out, out

    def cut(self) -> None:
        self.check_route()
        subprocess.run(["ip", "-n", self.ns, "link", "set", self.ns_if, "down"], check=True)

    def restore(self) -> None:
        subprocess.run(["ip", "-n", self.ns, "link", "set", self.ns_if, "up"], check=True)

    def destroy(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], check=False)
        # the kernel removes the veth pair asynchronously: wait for it (a next box of this process reuses the names),
        # and drop the unreachable route only once the link is gone
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and subprocess.run(["ip", "link", "show", self.host_if],
                                                             capture_output=True).returncode == 0:
            time.sleep(0.02)
        if self.up:
            subprocess.run(["ip", "route", "del", "unreachable", self.subnet, "metric", "4242"], check=False)
            self.up = False

    def exec_prefix(self) -> List[str]:
        return ["ip", "netns", "exec", self.ns]


class BridgeNet:
    """N boxes on one subnet: a bridge on this machine (10.201.X.1) and one network namespace per box
    (10.201.X.2, .3, ...), each on a veth pair whose host end is a port of the bridge, so the boxes reach each
    other (and this machine reaches them) like nodes of one cluster network."""

    IFNAME = "mn0"  # the box's NIC, the same name in every box

    def __init__(self, n: int) -> None:
        self.n = n
        pid = os.getpid()
        self.tag = "%d" % (pid % 100000)
        self.bridge = ("obb%s" % self.tag)[:15]
        self.namespaces = ["onbox-%sn%d" % (self.tag, k) for k in range(n)]
        self.host_ifs = [("ob%sh%d" % (self.tag, k))[:15] for k in range(n)]
        self.ns_ifs = [("ob%sb%d" % (self.tag, k))[:15] for k in range(n)]
        self._third = pid % 250 + 1
        self.subnet = ""
        self._route = False
        self._made: List[str] = []

    def addr(self, k: int) -> str:
        return "10.201.%d.%d" % (self._third, k + 2)

    def _claim(self) -> None:
        for i in range(250):  # FIRST the unreachable route: whatever link goes down, nothing for this /24 leaves the machine
            third = (self._third - 1 + i) % 250 + 1
            subnet = "10.201.%d.0/24" % third
            r = subprocess.run(["ip", "route", "add", "unreachable", subnet, "metric", "4242"], capture_output=True,
                               text=True)
            if r.returncode == 0:
                self._third, self.subnet, self._route = third, subnet, True
                return
        raise RuntimeError("no free /24 in 10.201.0.0/16 for the test boxes")

    def create(self) -> "BridgeNet":
        ip = ["ip"]
        try:
            self._claim()
            subprocess.run([*ip, "link", "add", self.bridge, "type", "bridge"], check=True)
            self._made.append("bridge")
            subprocess.run([*ip, "addr", "add", "10.201.%d.1/24" % self._third, "dev", self.bridge], check=True)
            subprocess.run([*ip, "link", "set", self.bridge, "up"], check=True)
            for k in range(self.n):
                ns, h, b = self.namespaces[k], self.host_ifs[k], self.ns_ifs[k]
                subprocess.run([*ip, "netns", "add", ns], check=True)
                self._made.append(ns)
                subprocess.run([*ip, "link", "add", h, "type", "veth", "peer", "name", b], check=True)
                subprocess.run([*ip, "link", "set", b, "netns", ns], check=True)
                subprocess.run([*ip, "link", "set", h, "master", self.bridge], check=True)
                subprocess.run([*ip, "link", "set", h, "up"], check=True)
                # one name inside every box (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME name the NIC, as on real nodes)
                subprocess.run([*ip, "-n", ns, "link", "set", b, "name", self.IFNAME], check=True)
                subprocess.run([*ip, "-n", ns, "addr", "add", self.addr(k) + "/24", "dev", self.IFNAME], check=True)
                subprocess.run([*ip, "-n", ns, "link", "set", self.IFNAME, "up"], check=True)
                subprocess.run([*ip, "-n", ns, "link", "set", "lo", "up"], check=True)
            for k in range(self.n):
                out = subprocess.run(["ip", "route", "get", self.addr(k)], capture_output=True, text=True).stdout
                assert "dev %s" % self.bridge in out, out
                # `ip netns exec` mounts /etc/netns/<ns>/* over /etc: the box resolves its peers by name and fails
                # DNS at once (this machine's resolver is unreachable from the box: torch's reverse lookups would
                # wait out their timeouts)
                etc = os.path.join("/etc/netns", self.namespaces[k])
                os.makedirs(etc, exist_ok=True)
                self._made.append(etc)
                with open(os.path.join(etc, "resolv.conf"), "w") as f:
                    f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
                with open(os.path.join(etc, "hosts"), "w") as f:
                    f.write("127.0.0.1 localhost\n" + "".join("%s node%d\n" % (self.addr(j), j) for j in range(self.n)))
        except BaseException:
            self.destroy()
            raise
        return self

    def netns(self, k: int) -> "Netns":
        """Box k as a Netns (exec_prefix, addresses) for SshdBox."""
        ns = Netns.__new__(Netns)
        ns.tag, ns.ns, ns.host_if, ns.ns_if = self.tag, self.namespaces[k], self.host_ifs[k], self.ns_ifs[k]
        ns.subnet, ns.host_addr, ns.box_addr, ns.up = self.subnet, "10.201.%d.1" % self._third, self.addr(k), False
        return ns

    @staticmethod
    def _exists(ifname: str) -> bool:
        return subprocess.run(["ip", "link", "show", ifname], capture_output=True).returncode == 0

    def destroy(self) -> None:
        for ns in self.namespaces:
            if ns in self._made:
                subprocess.run(["ip", "netns", "del", ns], check=False)  # its veth pair goes with it
            etc = os.path.join("/etc/netns", ns)
            if etc in self._made:
                shutil.rmtree(etc, ignore_errors=True)
        # a namespace goes (and its veth pair with it) only once the last process in it has ended, and the kernel
        # removes the pair after `ip netns del` returns: wait for the host ends, then delete any left ourselves,
        # so the next test in this process (the same names) never meets them
        deadline = time.monotonic() + 10.0
        left = [h for h in self.host_ifs if self._exists(h)]
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [h for h in left if self._exists(h)]
        for h in left:
            subprocess.run(["ip", "link", "del", h], check=False, capture_output=True)
        if "bridge" in self._made:
            subprocess.run(["ip", "link", "del", self.bridge], check=False)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and subprocess.run(
                    ["ip", "link", "show", self.bridge], capture_output=True).returncode == 0:
                time.sleep(0.02)
        self._made = []
        if self._route:
            subprocess.run(["ip", "route", "del", "unreachable", self.subnet, "metric", "4242"], check=False)
            self._route = False


class SshdBox:
    """One sshd in the foreground (-D), its keys and config in `root`; the box's /root is `root/home`."""

    def __init__(self, root: str, listen: str = "127.0.0.1", netns: Optional[Netns] = None) -> None:
        self.root = root
        self.listen = listen
        self.netns = netns
        self.port = free_port()
        self.home = os.path.join(root, "home")
        self.client_key = os.path.join(root, "client_key")
        self.known_hosts = os.path.join(root, "known_hosts")
        self.log = os.path.join(root, "sshd.log")
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 20.0) -> "SshdBox":
        os.makedirs(self.home, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)
        host_key = os.path.join(self.root, "host_key")
        for key in (host_key, self.client_key):
            if not os.path.exists(key):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        auth = os.path.join(self.root, "authorized_keys")
        shutil.copy(self.client_key + ".pub", auth)
        cfg = os.path.join(self.root, "sshd_config")
        with open(cfg, "w") as f:
            f.write("\n".join([
                "ListenAddress %s" % self.listen, "Port %d" % self.port, "HostKey %s" % host_key,
                "PidFile %s" % os.path.join(self.root, "sshd.pid"), "AuthorizedKeysFile %s" % auth,
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                "PermitRootLogin prohibit-password", "Subsystem sftp internal-sftp", "MaxStartups 100:30:200",
                "MaxSessions 50", "LogLevel ERROR", ""]))
        # /root of the box is our temp home: a private mount namespace around sshd (sessions inherit it)
        # the test interpreter may live under the real /root (pyenv): keep that one directory visible in the box
        keep = ""
        real = os.path.realpath(sys.executable)
        if real.startswith("/root/"):
            top = "/root/" + real.split("/")[2]
            os.makedirs(os.path.join(self.home, top[len("/root/"):]), exist_ok=True)
            keep = "mount --bind %s %s/%s && " % (top, self.home, top[len("/root/"):])
        inner = "%smount --rbind %s /root && exec %s -D -f %s -E %s" % (keep, self.home, SSHD, cfg, self.log)
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner]
        if self.netns:
            argv = self.netns.exec_prefix() + argv
        with open(os.path.join(self.root, "sshd.stderr"), "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("sshd exited %s: %s" % (self.proc.returncode, self._logs()))
            if self.probe():
                return self
            time.sleep(0.05)
        raise RuntimeError("sshd did not answer within %.0f s: %s" % (timeout, self._logs()))

    def _logs(self) -> str:
        out = ""
        for name in ("sshd.log", "sshd.stderr"):
            p = os.path.join(self.root, name)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    out += f.read()[-2000:]
        return out

    def probe(self) -> bool:
        r = subprocess.run(["ssh", *self.client_options_argv(), "-p", str(self.port), "root@" + self.listen, "true"],
                           capture_output=True, timeout=15)
        return r.returncode == 0

    def ssh_options(self) -> List[str]:
        """`-o` values for a client (the inventory's `options`): never touch ~/.ssh."""
        return ["StrictHostKeyChecking=no", "UserKnownHostsFile=%s" % self.known_hosts, "LogLevel=ERROR",
                "ConnectTimeout=5"]

    def client_options_argv(self) -> List[str]:
        out = ["-i", self.client_key, "-o", "BatchMode=yes"]
        for o in self.ssh_options():
            out += ["-o", o]
        return out

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            # the per-connection sshd processes are our sshd's children: they go with it (a plain TERM to the
            # listener leaves them serving their sessions)
            try:
                import psutil

                kids = psutil.Process(self.proc.pid).children(recursive=True)
            except Exception:
                kids = []
            for k in kids:
                try:
                    k.terminate()
                except Exception:
                    pass
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def inventory_entry(self) -> dict:
        return {"host": self.listen, "port": self.port, "user": "root", "identity": self.client_key,
                "options": self.ssh_options(), "python": sys.executable}


def close_masters(control_dir: str) -> None:
    """Stop every ssh master connection whose socket is in `control_dir` (the ones a test's onboxctl started)."""
    if not os.path.isdir(control_dir):
        return
    for name in os.listdir(control_dir):
        sock = os.path.join(control_dir, name)
        subprocess.run(["ssh", "-o", "ControlPath=%s" % sock, "-O", "exit", "onbox-test-master"],
                       capture_output=True, timeout=10)


def tunnel_supervisors(config_dir: str) -> List[Tuple[int, int]]:
    """(pid, start time) of each tunnel supervisor (controller/boxes/tunnelwatch.py) running for `config_dir`: onboxctl
    starts them with ONBOX_CONFIG_DIR=<config_dir> in their environment."""
    from tests.processes import with_env

    return with_env("ONBOX_CONFIG_DIR", config_dir, argv_has="controller.boxes.tunnelwatch")


def stop_tunnel_supervisors(config_dir: str, timeout: float = 15.0) -> None:
    """SIGTERM every tunnel supervisor a test's onboxctl started for `config_dir` (by pid and start time), wait for
    each to end (it leaves its record as it goes), SIGKILL what is left after `timeout` s."""
    from tests.processes import kill_exact, pid_alive, start_ticks

    found = tunnel_supervisors(config_dir)
    for pid, start in found:
        kill_exact(pid, start, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) and start_ticks(p) == s for p, s in found):
        time.sleep(0.05)
    for pid, start in found:
        kill_exact(pid, start, signal.SIGKILL)


def build_pyz(out_dir: str) -> str:
    """The real onbox.pyz (build/zipapp.py, x86_64 only): what `make zipapp` ships, profiles included."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "build", "zipapp.py"), "--arch", "x86_64", "--out", out_dir],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError("zipapp build failed: %s" % (r.stdout[-1500:] + r.stderr[-1500:]))
    return os.path.join(out_dir, "onbox.pyz")


@pytest.fixture(scope="session")
def onbox_pyz(tmp_path_factory):
    """dist-quality onbox.pyz built once per test session."""
    if not os.path.exists(os.path.join(REPO, "build", "zipapp.py")):
        pytest.skip("build/zipapp.py not in this checkout")
    return build_pyz(str(tmp_path_factory.mktemp("pyz")))


def dev_pyz(dest: str) -> str:
    """A zipapp of this checkout's onbox package (stdlib zipapp, no bundled deps): run by an interpreter that
    has click/psutil (the venv). The real shiv build is `make zipapp`; tests that need it build it there."""
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as z:
        z.writestr("__main__.py", "import sys\nfrom onbox.cli import main\nsys.exit(main())\n")
        pkg = os.path.join(REPO, "onbox")
        for dirpath, dirnames, filenames in sorted(os.walk(pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for fn in sorted(filenames):
                if fn.endswith((".pyc",)):
                    continue
                full = os.path.join(dirpath, fn)
                info = zipfile.ZipInfo(os.path.relpath(full, REPO), date_time=(2020, 1, 1, 0, 0, 0))
                with open(full, "rb") as f:
                    z.writestr(info, f.read())
    return dest


def _need_root_tools() -> None:
    if not have_sshd():
        pytest.skip("OpenSSH server/client or rsync missing: run `make sysdeps`")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("the box fixture needs root and unshare (mount namespace for the box's /root)")


@pytest.fixture
def sshd_box(tmp_path):
    """A loopback box: real sshd on 127.0.0.1, the box's /root a temp dir."""
    _need_root_tools()
    box = SshdBox(str(tmp_path / "box")).start()
    try:
        yield box
    finally:
        box.stop()


@pytest.fixture
def netns_box(tmp_path):
    """A rental-like box with its own address in a network namespace; `.netns.cut()` partitions it."""
    _need_root_tools()
    if shutil.which("ip") is None:
        pytest.skip("iproute2 missing")
    ns = Netns()
    try:
        ns.create()
    except subprocess.CalledProcessError as e:
        ns.destroy()
        pytest.skip("cannot create a network namespace here: %s" % e)
    box = SshdBox(str(tmp_path / "box"), listen=ns.box_addr, netns=ns)
    try:
        box.start()
        yield box
    finally:
        box.stop()
        ns.destroy()


class BridgedBoxes:
    """Boxes with real sshd on bridged subnets (BridgeNet), under `root`: `network(n)` makes the subnet (a
    CalledProcessError or RuntimeError where this machine cannot), `start(net)` one box per address on it; `close()`
    stops every sshd and removes every namespace, link and route it made. For the `netns_boxes` fixture and the
    benchmarks, which cannot use a fixture."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.made: list = []

    def network(self, n: int) -> BridgeNet:
        net = BridgeNet(n)
        net.create()  # removes what it made when it fails
        self.made.append(net)
        return net

    def start(self, net: BridgeNet) -> List[SshdBox]:
        boxes = []
        first = sum(isinstance(b, SshdBox) for b in self.made)  # node0, node1, ... across calls
        for k in range(net.n):
            box = SshdBox(os.path.join(self.root, "node%d" % (first + k)), listen=net.addr(k), netns=net.netns(k))
            self.made.append(box)
            boxes.append(box.start())
        return boxes

    def close(self) -> None:
        for thing in reversed(self.made):
            if isinstance(thing, SshdBox):
                thing.stop()
        for thing in self.made:
            if isinstance(thing, BridgeNet):
                thing.destroy()
        self.made = []


@pytest.fixture
def netns_boxes(tmp_path):
    """`netns_boxes(n)`: n boxes with real sshd on one bridged subnet; they reach each other and this machine
    reaches them. Every namespace, link, route and sshd is removed / stopped at teardown."""
    _need_root_tools()
    made = BridgedBoxes(str(tmp_path))

    def make(n: int) -> List[SshdBox]:
        try:
            net = made.network(n)
        except (subprocess.CalledProcessError, RuntimeError) as e:
            pytest.skip("cannot create bridged network namespaces here: %s" % e)
        return made.start(net)

    try:
        yield make
    finally:
        made.close()
