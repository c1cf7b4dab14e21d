"""The provision command's output and processes are outside input (issue 30, items 6, 9, 10, 11), run for real:
tiny shell scripts, short timeouts.

- its JSON line may set only the ssh options on the keeper's allow-list: ProxyCommand, LocalCommand, Include,
  Match, ProxyJump and the like are refused naming the option (beside each refusal, the legitimate options pass);
  an identity or known-hosts file lies under the onboxctl config dir or ~/.ssh;
- whatever it leaves running (a child of a command that exited 0, a setsid grandchild of one killed at its
  timeout, one that ignores TERM, one that scrubbed its environment) is stopped after every try, and said;
- at most 64 KiB of its stdout and of its stderr are kept, in memory (no temp file: a small or missing TMPDIR
  changes nothing), the rest drained, and a cut is said;
- what it prints reaches the keeper's messages with its control characters shown as escapes.
"""
from __future__ import annotations

import os
import stat
import tempfile
import uuid
from typing import Any, Dict, List

import pytest

from controller.keeper.provision import ProvisionFailed, box_from_line, run_provision
from tests.processes import kill_exact, pid_alive, start_ticks, with_env

GRACE = 0.5  # seconds a leftover gets between TERM and KILL in these tests


@pytest.fixture
def home(tmp_path, monkeypatch):
    """HOME and the onboxctl config dir of the keeper, both under tmp_path."""
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True)
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(cfg))
    return h


def line(**kw: Any) -> str:
    import json

    return json.dumps(dict({"name": "gpu-7", "host": "203.0.113.7"}, **kw))


# -- item 6: the ssh options a provision may set ------------------------------------------------------------------
REFUSED = [
    ("ProxyCommand=touch pwned", "ProxyCommand", "runs a command on this machine"),
    ("proxycommand=touch pwned", "proxycommand", "runs a command on this machine"),
    ("LocalCommand=touch pwned", "LocalCommand", "runs a command on this machine"),
    ("PermitLocalCommand=yes", "PermitLocalCommand", "runs a command on this machine"),
    ("KnownHostsCommand=/bin/sh -c x", "KnownHostsCommand", "runs a command on this machine"),
    ("Match=exec \"touch pwned\"", "Match", "runs a command on this machine"),
    ("Include=/tmp/evil.conf", "Include", "another ssh config"),
    ("ProxyJump=attacker@203.0.113.66", "ProxyJump", "~/.ssh/config"),
    ("RemoteCommand=sh", "RemoteCommand", "replaces the command"),
    ("ForwardAgent=yes", "ForwardAgent", "your ssh agent"),
    ("SendEnv=*", "SendEnv", "environment"),
    ("SetEnv=A=b", "SetEnv", "environment"),
    ("RemoteForward=8787 127.0.0.1:8787", "RemoteForward", "forwards"),
    ("LocalForward=2222 10.0.0.1:22", "LocalForward", "forwards"),
    ("DynamicForward=1080", "DynamicForward", "forwards"),
    ("ControlPath=/tmp/other-host.sock", "ControlPath", "connection"),
    ("ControlMaster=yes", "ControlMaster", "connection"),
    ("PKCS11Provider=/tmp/evil.so", "PKCS11Provider", "library"),
    ("SecurityKeyProvider=/tmp/evil.so", "SecurityKeyProvider", "library"),
    ("IdentityAgent=/tmp/other-agent.sock", "IdentityAgent", "agent"),
    ("Hostname=203.0.113.66", "Hostname", "host"),
    ("Frobnicate=1", "Frobnicate", "not one a provision may set"),
    ("IdentityFile=/etc/shadow", "IdentityFile", "under"),
    ("IdentityFile=~/../../etc/ssh/ssh_host_ed25519_key", "IdentityFile", "under"),
    ("IdentityFile=%d/.ssh/id", "IdentityFile", "token"),
    ("UserKnownHostsFile=/root/.bashrc", "UserKnownHostsFile", "under"),
    ("Port=22 ProxyCommand touch pwned", "Port", "not a port"),
    ("ServerAliveInterval=soon", "ServerAliveInterval", "whole number"),
    ("StrictHostKeyChecking=maybe", "StrictHostKeyChecking", "one of"),
    ("User=-oProxyCommand=x", "User", "must not start with '-'"),
    ("Compression=yes\rProxyCommand=x", "Compression", "control characters"),
]


@pytest.mark.parametrize("option, names, why", REFUSED, ids=[r[0][:28] for r in REFUSED])
def test_an_ssh_option_a_provision_may_not_set_is_refused_naming_it(home, option, names, why):
    with pytest.raises(ProvisionFailed) as e:
        box_from_line(line(options=["StrictHostKeyChecking=accept-new", option]), "a100", "./new-box.sh")
    msg = e.value.message
    assert "ssh option %s" % names in msg and why in msg and "\n" not in msg and "\r" not in msg, msg


@pytest.mark.parametrize("doc, says", [
    ({"identity": "/etc/shadow"}, "identity /etc/shadow"),
    ({"identity": "~/../outside/key"}, "identity"),
    ({"identity": "~/.ssh/key\u0000"}, "control character"),  # found by tests/unit/test_keeper_fuzz.py
    ({"profile": "../../../tmp/evil"}, "profile"),
    ({"profile": "nosuch-platform"}, "unknown profile"),
    ({"options": "ProxyCommand=x"}, 'options must be a list of "Key=Value"'),
])
def test_other_fields_that_reach_ssh_or_a_local_file_are_checked_too(home, doc, says):
    with pytest.raises(ProvisionFailed) as e:
        box_from_line(line(**doc), "a100")
    assert says in e.value.message


def test_the_options_a_provision_legitimately_sets_pass(home, tmp_path):
    cfg = os.environ["ONBOX_CONFIG_DIR"]
    opts = ["Port=2222", "User=root", "IdentityFile=~/.ssh/id_ed25519", "IdentityFile=%s/keys/gpu-7" % cfg,
            "IdentitiesOnly=yes", "ConnectTimeout=5", "ServerAliveInterval=10", "ServerAliveCountMax=3",
            "Compression=yes", "StrictHostKeyChecking=accept-new", "userknownhostsfile=/dev/null",
            "UserKnownHostsFile=~/.ssh/known_hosts_rented", "LogLevel=ERROR", "HostKeyAlias=gpu-7",
            "TCPKeepAlive=yes", "ConnectionAttempts=3", "AddressFamily=inet", "CheckHostIP=no",
            "HostKeyAlgorithms=ssh-ed25519,rsa-sha2-512", "PubkeyAcceptedAlgorithms=+ssh-rsa", "BatchMode=yes"]
    box = box_from_line(line(options=opts, identity="~/.ssh/rented", profile="runpod", user="root", port=2222),
                        "a100")
    assert box.options == opts and box.identity == "~/.ssh/rented" and box.profile == "runpod"


# -- items 9, 10, 11: running it -----------------------------------------------------------------------------------
def script(tmp_path, body: str) -> List[str]:
    path = tmp_path / ("prov-%s.sh" % uuid.uuid4().hex[:6])
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return [str(path)]


class Marked:
    """The provision's environment carries a mark unique to this test: every process it started that kept its
    environment is found by it (tests/processes.py), the ones that scrubbed it by the pids the script wrote."""

    def __init__(self, tmp_path) -> None:
        self.value = uuid.uuid4().hex
        self.pids = str(tmp_path / "pids")
        self.env = {"KEEPER_TEST_MARK": self.value, "PIDS": self.pids}

    def alive(self) -> List[int]:
        found = {pid for pid, _ in with_env("KEEPER_TEST_MARK", self.value)}
        if os.path.exists(self.pids):
            with open(self.pids) as f:
                found |= {int(x) for x in f.read().split() if pid_alive(int(x))}
        return sorted(found)

    def cleanup(self) -> None:
        """Whatever the code under test left: the test caused it, the test stops it (by pid and start time)."""
        for pid in self.alive():
            start = start_ticks(pid)
            if start is not None:
                kill_exact(pid, start)


@pytest.fixture
def marked(tmp_path):
    m = Marked(tmp_path)
    yield m
    m.cleanup()


OK_LINE = "echo '{\"name\": \"gpu-7\", \"host\": \"203.0.113.7\"}'"
LEAVE = ("sleep 300 & echo $! >> $PIDS\n"  # a child, holding the provision's stdout
         "(setsid sleep 301 & echo $! >> $PIDS)\n"  # a grandchild in a session of its own, its parent gone
         "(setsid env -i sleep 302 & echo $! >> $PIDS)\n"  # ... and an environment scrubbed of the mark
         "sh -c 'trap \"\" TERM; sleep 303' & echo $! >> $PIDS\n")  # one that ignores TERM


def test_what_a_provision_that_succeeded_left_running_is_stopped_and_said(tmp_path, marked):
    notes: List[Dict[str, Any]] = []
    argv = script(tmp_path, LEAVE + "sleep 0.2\n" + OK_LINE)  # time for the setsid ones to take
    box = run_provision(argv, 30, marked.env, "a100", note=lambda kind, text: notes.append({"kind": kind,
                                                                                           "text": text}),
                        grace=GRACE)
    assert box.name == "gpu-7"
    assert marked.alive() == []  # nothing of it runs on: not the child, not the setsid ones, not the TERM-deaf one
    with open(marked.pids) as f:
        assert len(f.read().split()) == 4
    [note] = [n for n in notes if n["kind"] == "provision_leftovers"]  # the 4, and the TERM-deaf shell's sleep
    assert "stopped 5 process(es) the provision command left running" in note["text"] and "(sleep 302)" in note["text"]


def test_what_a_provision_killed_at_its_timeout_started_is_stopped_too(tmp_path, marked):
    notes: List[Dict[str, Any]] = []
    argv = script(tmp_path, LEAVE + "exec sleep 60")
    with pytest.raises(ProvisionFailed, match="did not print a box within 1 s"):
        run_provision(argv, 1.0, marked.env, "a100", note=lambda kind, text: notes.append({"kind": kind}),
                      grace=GRACE)
    assert marked.alive() == []
    assert [n["kind"] for n in notes] == ["provision_leftovers"]


def test_a_failed_provision_leaves_nothing_either_and_a_clean_one_says_nothing(tmp_path, marked):
    notes: List[str] = []
    with pytest.raises(ProvisionFailed, match="exited 3: no capacity"):
        run_provision(script(tmp_path, "sleep 300 & echo $! >> $PIDS\necho 'no capacity' >&2; exit 3"), 30,
                      marked.env, "a100", note=lambda kind, text: notes.append(kind), grace=GRACE)
    assert marked.alive() == [] and notes == ["provision_leftovers"]
    notes.clear()
    run_provision(script(tmp_path, OK_LINE), 30, marked.env, "a100", note=lambda kind, text: notes.append(kind))
    assert notes == []


def test_a_chatty_provision_is_read_to_its_last_64_kib_in_memory_and_the_cut_said(tmp_path, marked, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))  # a temp file would fail here
    notes: List[str] = []
    argv = script(tmp_path, "yes 'progress....' | head -c 20000000; echo\n" + OK_LINE)
    box = run_provision(argv, 60, marked.env, "a100", note=lambda kind, text: notes.append(text))
    assert box.name == "gpu-7"
    assert any("only its last 64 KiB" in n and "20.0 MB" in n for n in notes), notes


def test_a_provision_that_fails_after_printing_much_on_stderr_says_its_last_line_and_the_cut(tmp_path, marked,
                                                                                            monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    argv = script(tmp_path, "yes 'retrying....' | head -c 20000000 >&2; echo >&2; echo 'out of capacity' >&2; exit 1")
    with pytest.raises(ProvisionFailed) as e:
        run_provision(argv, 60, marked.env, "a100")
    msg = e.value.message
    assert "exited 1: out of capacity" in msg and "(nothing on stderr)" not in msg
    assert "stderr cut to its last 64 KiB of 20.0 MB" in msg


def test_a_last_line_longer_than_what_is_read_is_refused_saying_it_was_cut(tmp_path, marked):
    pad = "x" * (100 * 1024)
    argv = script(tmp_path, "echo '{\"name\": \"gpu-7\", \"host\": \"203.0.113.7\", \"profile\": \"%s\"}'" % pad)
    with pytest.raises(ProvisionFailed) as e:
        run_provision(argv, 30, marked.env, "a100")
    assert "not a JSON object" in e.value.message and "cut to its last 64 KiB" in e.value.message


def test_terminal_escapes_in_what_a_provision_prints_reach_no_message(tmp_path, marked):
    argv = script(tmp_path, "printf 'ok\\n\\033]0;PWNED-TITLE\\007\\033[2J evil\\n' >&2; exit 1")
    with pytest.raises(ProvisionFailed) as e:
        run_provision(argv, 30, marked.env, "a100")
    msg = e.value.message
    assert "\x1b" not in msg and "\x07" not in msg and "PWNED-TITLE" in msg and "\\x1b" in msg
    argv = script(tmp_path, "printf '\\033]0;PWNED\\007{not json\\n'")
    with pytest.raises(ProvisionFailed) as e:
        run_provision(argv, 30, marked.env, "a100")
    assert "\x1b" not in e.value.message and "\x07" not in e.value.message


def test_the_provision_runs_in_a_session_and_group_of_its_own(tmp_path, marked):
    """Its own session (a terminal's Ctrl-C never reaches it half-way; its group is stopped as one), and stdin
    closed. The script reports its sid/pgid against its pid."""
    out = str(tmp_path / "ids")
    argv = script(tmp_path, "ps -o sid=,pgid= -p $$ > %s; echo $$ >> %s; read x && echo stdin-open >> %s\n%s"
                  % (out, out, out, OK_LINE))
    run_provision(argv, 30, marked.env, "a100")
    with open(out) as f:
        words = f.read().split()
    sid, pgid, pid = words[:3]
    assert sid == pgid == pid and "stdin-open" not in words



def test_a_keeper_killed_mid_provision_takes_the_command_and_what_it_started_along(tmp_path, marked):
    """SIGKILL to the keeper while its provision command runs: the reaper between them gets its parent-death
    signal and stops the command and what it left (a /proc walk in the keeper would have died with it)."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env
    from tests.polling import wait_for

    argv = script(tmp_path, "sleep 300 & echo $! >> $PIDS\n(setsid sleep 301 & echo $! >> $PIDS)\nexec sleep 302")
    code = "import sys\nfrom controller.keeper.provision import run_provision\nrun_provision(sys.argv[1:], 60, {}, 'p')"
    keeper = subprocess.Popen([sys.executable, "-c", code, *argv], env=subprocess_env(marked.env),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def both_started():
            if not os.path.exists(marked.pids):
                return False
            with open(marked.pids) as f:
                return len(f.read().split()) == 2
        wait_for(both_started, 30, "the provision command's two children")
        assert len(marked.alive()) >= 4  # the keeper, its reaper, the command, its children
        keeper.kill()
        keeper.wait(timeout=10)
        wait_for(lambda: marked.alive() == [], 20, "the command and what it started, stopped by the reaper")
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()
