"""Host keys of inventory boxes, against a real sshd (tests/hosts/sshd_box.py): a box never seen before is reached on
first contact and its key lands in onbox's own known_hosts ($ONBOX_CONFIG_DIR/known_hosts, never ~/.ssh); the box's
sshd restarted with a NEW host key (a re-rented machine at the same address) is refused with a message that names
the cause and the fix, and nothing runs there, with or without the ssh master; after `onboxctl box forget-key` the
next contact accepts and records the new key. A box whose own ssh options manage host keys keeps them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import subprocess_env
from tests.hosts.sshd_box import close_masters

pytestmark = [pytest.mark.integration, pytest.mark.root]


@pytest.fixture
def ctl(tmp_path):
    cm = tempfile.mkdtemp(prefix="ok", dir="/tmp")
    # a space and a `%` in the path: ssh reads its -o values as words with %-tokens (controller/boxes/ssh.py config_path)
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "my cfg 100%"), "ONBOX_SSH_CONTROL_DIR": cm,
                          "ONBOX_SSH_CONNECT_TIMEOUT": "5"})
    yield env
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def onboxctl(env, *args, stdin=None):
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, input=stdin, capture_output=True,
                          text=True, timeout=60)


def fingerprint(pub):
    out = subprocess.run(["ssh-keygen", "-l", "-f", pub], capture_output=True, text=True, check=True).stdout
    return out.split()[1]  # SHA256:...


def recorded(known_hosts, name):
    """The fingerprints ssh-keygen finds for `name` in `known_hosts` (hashed or not)."""
    r = subprocess.run(["ssh-keygen", "-l", "-F", name, "-f", known_hosts], capture_output=True, text=True)
    return [ln.split()[2] for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("#")]


def user_known_hosts():
    path = os.path.expanduser("~/.ssh/known_hosts")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def test_a_new_box_is_accepted_a_changed_key_refused_and_forget_key_lets_it_in(sshd_box, ctl, onbox_pyz):
    """No StrictHostKeyChecking or UserKnownHostsFile of the test's own: onbox's defaults decide."""
    cfg = ctl["ONBOX_CONFIG_DIR"]
    known = os.path.join(cfg, "known_hosts")
    name = "[127.0.0.1]:%d" % sshd_box.port
    r = onboxctl(ctl, "box", "add", "b1", "--host", "127.0.0.1", "--port", str(sshd_box.port), "--user", "root",
                 "--identity", sshd_box.client_key, "--python", sys.executable)
    assert r.returncode == 0, r.stderr
    mine_before = user_known_hosts()
    first_key = fingerprint(os.path.join(sshd_box.root, "host_key.pub"))
    secrets = os.path.join(sshd_box.home, ".onbox", "secrets")

    # first contact: accepted, and the key is recorded in onbox's file
    r = onboxctl(ctl, "secrets", "push", "b1", "first", stdin="v1")
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(os.path.join(secrets, "first"))
    assert recorded(known, name) == [first_key]
    assert user_known_hosts() == mine_before  # ~/.ssh/known_hosts untouched

    # the same address, a new machine: sshd restarted with a new host key
    close_masters(ctl["ONBOX_SSH_CONTROL_DIR"])
    sshd_box.stop()
    for f in ("host_key", "host_key.pub"):
        os.unlink(os.path.join(sshd_box.root, f))
    sshd_box.start()
    new_key = fingerprint(os.path.join(sshd_box.root, "host_key.pub"))
    assert new_key != first_key
    for env in (ctl, dict(ctl, ONBOX_SSH_MULTIPLEX="0")):  # through the master's start, and a plain ssh call
        r = onboxctl(env, "secrets", "push", "b1", "second", stdin="v2")
        assert r.returncode == 3, (r.stdout, r.stderr)
        lines = r.stderr.splitlines()
        assert lines[0].startswith("onboxctl: refusing to connect to box b1 (root@127.0.0.1:%d): its host key CHANGED "
                                   "since onbox recorded it in %s, so nothing was run there: either the box was "
                                   "re-rented or rebuilt at the same address, or someone is in the middle"
                                   % (sshd_box.port, known)), r.stderr
        assert "`onboxctl box forget-key b1`" in lines[1] and "do not connect" in lines[1], r.stderr
        assert "ssh b1" not in r.stderr and "alias" not in r.stderr
        assert not os.path.exists(os.path.join(secrets, "second"))  # nothing ran on the box
        assert recorded(known, name) == [first_key]  # never replaced silently
    r = onboxctl(ctl, "push", "b1", "--pyz", sys.executable)  # push and rsync go through the same check
    assert r.returncode == 3 and "host key CHANGED" in r.stderr, r.stderr

    # the user knows it is a new machine: forget the old key, and the next contact records the new one
    r = onboxctl(ctl, "box", "forget-key", "b1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["box"] == "b1" and doc["known_hosts"] == known and doc["hosts"] == [name], doc
    assert doc["forgotten"] == 1 and first_key in doc["fingerprints"][0], doc
    assert recorded(known, name) == []
    r = onboxctl(ctl, "secrets", "push", "b1", "second", stdin="v2")
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(os.path.join(secrets, "second"))
    assert recorded(known, name) == [new_key]
    # rsync's ssh (`-e`) reads the same options, the quoted path included; without a master it checks the key itself
    r = onboxctl(dict(ctl, ONBOX_SSH_MULTIPLEX="0"), "push", "b1", "--pyz", onbox_pyz)
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(os.path.join(sshd_box.home, ".onbox", "onbox.pyz"))
    r = onboxctl(ctl, "box", "forget-key", "b1")
    assert r.returncode == 0 and "forgot the host key of box b1: %s ED25519 %s" % (name, new_key) in r.stdout, r.stdout
    r = onboxctl(ctl, "box", "forget-key", "b1")
    assert r.returncode == 0 and "nothing to forget" in r.stdout, r.stdout
    assert user_known_hosts() == mine_before


def test_a_box_with_its_own_host_key_options_keeps_them(sshd_box, ctl, tmp_path):
    """StrictHostKeyChecking=yes with the box's own known_hosts file: onbox adds nothing, writes nothing, and the
    refusal of an unknown key says whose settings refused it; forget-key points at the box's own file."""
    cfg = ctl["ONBOX_CONFIG_DIR"]
    own = str(tmp_path / "own_known_hosts")
    r = onboxctl(ctl, "box", "add", "b2", "--host", "127.0.0.1", "--port", str(sshd_box.port), "--user", "root",
                 "--identity", sshd_box.client_key, "--ssh-option", "StrictHostKeyChecking=yes",
                 "--ssh-option", "UserKnownHostsFile=%s" % own)
    assert r.returncode == 0, r.stderr
    r = onboxctl(ctl, "secrets", "push", "b2", "x", stdin="v")
    assert r.returncode == 3, r.stderr
    assert r.stderr.startswith("onboxctl: cannot reach box b2 (root@127.0.0.1:%d): ssh does not know its host key "
                               "and was told to refuse unknown ones" % sshd_box.port), r.stderr
    assert "--ssh-option settings manage its host keys" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(cfg, "known_hosts")) and not os.path.exists(own)
    r = onboxctl(ctl, "box", "forget-key", "b2")
    assert r.returncode == 2 and "keeps its host keys where its own ssh options say" in r.stderr, r.stderr
    assert "-f %s" % own in r.stderr, r.stderr
