"""ssh's own failures read as their causes (controller/boxes/ssh.py `classify`, `unreachable`), and the host-key options an
inventory box gets (onbox's known_hosts, accept-new) or keeps (its own)."""
from __future__ import annotations

import pytest

from controller.boxes.inventory import Box, Inventory
from controller.boxes.ssh import Ssh, SshSettings, Target, config_path, manages_host_keys
from controller.boxes.sshfail import classify, unreachable

CHANGED = """@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!
Someone could be eavesdropping on you right now (man-in-the-middle attack)!
It is also possible that a host key has just been changed.
The fingerprint for the ED25519 key sent by the remote host is
SHA256:1YJu8r51z3pPhU5g1HsHkajUq7+NnqaEPlvf4iucIeA.
Please contact your system administrator.
Add correct host key in /home/me/.ssh/known_hosts to get rid of this message.
Offending ED25519 key in /home/me/.ssh/known_hosts:3
  remove with:
  ssh-keygen -f "/home/me/.ssh/known_hosts" -R "[10.231.0.2]:2222"
Host key for [10.231.0.2]:2222 has changed and you have requested strict checking.
Host key verification failed.
"""

# What OpenSSH 9 prints for each failure (exit 255), and the kind it is read as.
SAYS = [
    (CHANGED, "host_key_changed"),
    ("No ED25519 host key is known for [10.231.0.2]:2222 and you have requested strict checking.\n"
     "Host key verification failed.\n", "host_key_unknown"),
    ("Host key verification failed.\n", "host_key_unknown"),
    ("root@10.231.0.2: Permission denied (publickey).\n", "auth"),
    ("Received disconnect from 10.231.0.2 port 22:2: Too many authentication failures\n", "auth"),
    ("ssh: connect to host 10.231.0.2 port 22: Connection refused\n", "refused"),
    ("ssh: connect to host 10.231.0.2 port 22: Connection timed out\n", "timeout"),
    ("Connection timed out during banner exchange\nConnection to 10.231.0.2 port 22 timed out\n", "timeout"),
    ("ssh: connect to host 10.231.0.2 port 22: No route to host\n", "no_route"),
    ("ssh: connect to host 10.231.0.2 port 22: Network is unreachable\n", "no_route"),
    ("ssh: Could not resolve hostname gpu1: Name or service not known\n", "resolve"),
    ("ssh: Could not resolve hostname gpu1: Temporary failure in name resolution\n", "resolve"),
    ("kex_exchange_identification: read: Connection reset by peer\n", "closed"),
    ("Connection closed by 10.231.0.2 port 22\n", "closed"),
    ("something else entirely\n", "other"),
    ("", "other"),
]


@pytest.mark.parametrize("stderr,kind", SAYS, ids=[k + str(i) for i, (_, k) in enumerate(SAYS)])
def test_ssh_stderr_is_read_as_its_cause(stderr, kind):
    assert classify(stderr).kind == kind


def test_a_changed_key_keeps_sshs_own_removal_command():
    f = classify(CHANGED)
    assert f.line == "Host key for [10.231.0.2]:2222 has changed and you have requested strict checking."
    assert f.remove_with == 'ssh-keygen -f "/home/me/.ssh/known_hosts" -R "[10.231.0.2]:2222"'


INV = Target(name="gpu1", host="10.231.0.2", user="root", known_hosts="/cfg/known_hosts")
OWN = Target(name="gpu1", host="10.231.0.2", user="root", options=("StrictHostKeyChecking=yes",))
ALIAS = Target(name="gpu1", host="gpu1", alias=True)


def test_an_inventory_box_is_never_called_an_ssh_alias():
    for stderr, _kind in SAYS:
        e = unreachable(INV, stderr)
        text = e.message + " " + (e.hint or "")
        assert "gpu1 (root@10.231.0.2)" in e.message and "alias" not in text and "ssh gpu1" not in text, text
    assert "`ssh root@10.231.0.2` works by hand" in (unreachable(INV, "weird").hint or "")
    e = unreachable(ALIAS, "weird")
    assert "`ssh gpu1` works by hand" in (e.hint or "") and "not in the inventory" in (e.hint or "")


def test_a_changed_host_key_names_the_cause_and_the_fix():
    """onbox's file with accept-new: any host-key refusal is a key that changed (a new one would be accepted)."""
    for stderr in (CHANGED, "Host key verification failed.\n"):
        e = unreachable(INV, stderr)
        assert e.kind == "host_key_changed" and e.exit_code == 3
        assert e.message.startswith("refusing to connect to box gpu1 (root@10.231.0.2): its host key CHANGED since "
                                    "onbox recorded it in /cfg/known_hosts, so nothing was run there"), e.message
        assert "re-rented or rebuilt" in e.message and "someone is in the middle" in e.message
        assert "`onboxctl box forget-key gpu1`" in (e.hint or "") and "ssh-keygen -R '10.231.0.2' -f " \
            "/cfg/known_hosts" in (e.hint or ""), e.hint
    e = unreachable(OWN, CHANGED)  # the box's own files: ssh's own removal command, never forget-key
    assert e.kind == "host_key_changed" and "forget-key" not in (e.hint or "")
    assert 'ssh-keygen -f "/home/me/.ssh/known_hosts" -R "[10.231.0.2]:2222"' in (e.hint or "")
    e = unreachable(OWN, "Host key verification failed.\n")  # their StrictHostKeyChecking=yes, a key never seen
    assert e.kind == "host_key_unknown" and "--ssh-option settings manage its host keys" in (e.hint or "")


def test_login_refused_names_the_key_not_the_network():
    e = unreachable(INV, "root@10.231.0.2: Permission denied (publickey).\n")
    assert "refused the login of root" in e.message and "--identity" in (e.hint or "") and "ssh-add" in (e.hint or "")
    e = unreachable(Target(name="gpu1", host="10.231.0.2", port=2222, user="root"),
                    "ssh: connect to host 10.231.0.2 port 2222: Connection refused\n")
    assert "(root@10.231.0.2:2222): nothing accepts ssh connections there" in e.message
    assert "port is wrong" in (e.hint or "")


def test_inventory_boxes_get_onbox_known_hosts_unless_their_options_decide(tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOX_CONFIG_DIR", str(tmp_path))
    inv = Inventory()
    inv.add(Box(name="plain", host="10.0.0.5"))
    inv.add(Box(name="own", host="10.0.0.6", options=["userknownhostsfile=/k", "LogLevel=ERROR"]))
    inv.add(Box(name="strict", host="10.0.0.7", options=["StrictHostKeyChecking=no"]))
    boxes = inv.load()
    s = Ssh(SshSettings(control_dir="/run/x"))
    plain = s.options(boxes["plain"].target())
    assert plain[-4:] == ["-o", "StrictHostKeyChecking=accept-new", "-o",
                          "UserKnownHostsFile=%s" % (tmp_path / "known_hosts")]
    for name in ("own", "strict"):
        opts = " ".join(s.options(boxes[name].target()))
        assert "accept-new" not in opts and str(tmp_path / "known_hosts") not in opts, opts
    assert "UserKnownHostsFile" not in " ".join(s.options(inv.resolve("an-alias").target()))
    assert inv.resolve("an-alias").target().alias and not boxes["plain"].target().alias
    assert "known_hosts" not in (tmp_path / "boxes.toml").read_text()  # never written to the inventory
    assert manages_host_keys(["KnownHostsCommand=/bin/x"]) and not manages_host_keys(["HostKeyAlias=a"])


def test_a_known_hosts_path_survives_ssh_option_parsing():
    assert config_path("/home/me/.config/onbox/known_hosts") == "/home/me/.config/onbox/known_hosts"
    assert config_path("/tmp/100%/kh") == "/tmp/100%%/kh"  # % is a token in ssh's file options
    assert config_path("/My Files/onbox/known_hosts") == '"/My Files/onbox/known_hosts"'
    assert config_path('/a"b\\c/kh') == '"/a\\"b\\\\c/kh"'
