"""`onboxctl queue BOX` reads a box's queue over real ssh (a loopback sshd whose /root is a temp dir)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import subprocess_env
from tests.hosts.sshd_box import close_masters

pytestmark = pytest.mark.integration


@pytest.fixture
def ctl_env(tmp_path):
    cm = tempfile.mkdtemp(prefix="oq", dir="/tmp")
    yield subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def ctl(env, *args):
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_onboxctl_shows_a_boxs_queue(sshd_box, ctl_env, onbox_pyz):
    e = sshd_box.inventory_entry()
    add = ["box", "add", "b1", "--host", e["host"], "--port", str(e["port"]), "--user", "root", "--identity",
           e["identity"], "--python", e["python"]]
    for o in e["options"]:
        add += ["--ssh-option", o]
    assert ctl(ctl_env, *add).returncode == 0
    r = ctl(ctl_env, "queue", "b1")
    assert r.returncode == 3 and "did not answer with its queue" in r.stderr  # no onbox on the box yet
    assert ctl(ctl_env, "push", "b1", "--pyz", onbox_pyz).returncode == 0
    script = ("{py} .onbox/onbox.pyz queue add --name ablate-lr -- sleep 1 && "
              "{py} .onbox/onbox.pyz queue add -- sleep 2 && {py} .onbox/onbox.pyz queue rm ablate-lr"
              ).format(py=e["python"])
    r = subprocess.run(["ssh", *sshd_box.client_options_argv(), "-p", str(sshd_box.port), "root@127.0.0.1", script],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = ctl(ctl_env, "queue", "b1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["box"] == "b1" and doc["runner"]["alive"] is False
    assert [(x["id"], x["name"], x["state"], x["command"]) for x in doc["entries"]] == [
        (2, "q2-sleep", "pending", ["sleep", "2"])]
    assert doc["entries"][0]["run_dir"] == "/root/.onbox/runs/q2-sleep"  # the box's path, not this machine's
    r = ctl(ctl_env, "queue", "b1")
    assert r.returncode == 0 and r.stdout.startswith("box b1 · runner: never started")
    assert "q2-sleep" in r.stdout and "ablate-lr" not in r.stdout
