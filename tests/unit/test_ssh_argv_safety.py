"""A host, user or alias can never become an ssh option: refused where a Target is made, and `--` before the
destination in every argv onboxctl builds (checked against the real ssh client's own parser with `ssh -G`)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from controller.boxes.ssh import Ssh, SshSettings, Target
from onbox.errors import UsageError

BAD = ["-oProxyCommand=touch /tmp/x", "-F/tmp/evil", "-", "", "host name", "host\nname", "a\x00b"]


@pytest.mark.parametrize("host", BAD)
def test_a_target_refuses_a_host_ssh_could_read_as_an_option(host):
    with pytest.raises(UsageError):
        Target(name="x", host=host)


@pytest.mark.parametrize("user", ["-oProxyCommand=x", "-l", "", "ro ot"])
def test_a_target_refuses_such_a_user(user):
    with pytest.raises(UsageError):
        Target(name="x", host="203.0.113.7", user=user)


def test_every_argv_puts_the_destination_after_double_dash():
    s = Ssh(SshSettings(control_dir="/run/x"))
    t = Target(name="x", host="203.0.113.7", user="root", port=22)
    for argv in (s.ssh_argv(t, ["true"]), s.master_argv(t), s.master_argv(t, persist=True),
                 s.control_argv(t, "check"), s.control_argv(t, "forward", "-R", "127.0.0.1:0:127.0.0.1:8787")):
        i = argv.index("--")
        assert argv[i + 1] == "root@203.0.113.7", argv
        assert "root@203.0.113.7" not in argv[:i]


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client")
def test_the_real_ssh_reads_what_follows_double_dash_as_the_host(tmp_path):
    """What `--` buys, shown by ssh's own parser (`-G` prints the configuration and connects nowhere)."""
    marker = tmp_path / "ran"
    evil = "-oProxyCommand=touch %s" % marker
    without = subprocess.run(["ssh", "-G", evil, "somehost"], capture_output=True, text=True, timeout=30)
    assert "proxycommand touch" in without.stdout  # without `--` the "host" is an option ...
    with_dd = subprocess.run(["ssh", "-G", "--", evil], capture_output=True, text=True, timeout=30)
    assert "proxycommand touch" not in with_dd.stdout  # ... after it, a (bad) host name
    assert not marker.exists()
