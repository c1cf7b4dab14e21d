"""`onboxctl push --code` to a real OpenSSH box (tests/hosts/sshd_box.py) leaves the code dir's secret-looking files
at home and names them (issue 30, item 7): a box is someone else's machine; `--include-secret PATH` sends one on
purpose, and the push still verifies (the same filters on both sides). Look-alikes go like any file."""
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

pytestmark = pytest.mark.integration

LEGIT = {"train.py": "print(1)\n", "src/keyboard.py": "x\n", "environment.py": "x\n", "tokenizer.json": "{}\n",
         "id_map.csv": "1\n", "id_rsa.pub": "ssh-ed25519 AAAA\n", ".env.example": "WANDB_API_KEY=\n",
         ".gitignore": "data/\n"}
SECRET = {".env": "WANDB_API_KEY=hunter2\n", "kaggle.json": '{"username": "me", "key": "k"}\n',
          ".ssh/id_rsa": "k\n", ".git/config": "[remote]\n", "notes/deploy": "-----BEGIN RSA PRIVATE KEY-----\n" + "MIIEpAIBAAKCAQEA" * 4 + "\n"}
IGNORED = {"data/.env": "x\n"}  # .gitignore'd: never sent, so never named either


@pytest.fixture
def ctl(tmp_path):
    cm = tempfile.mkdtemp(prefix="oc", dir="/tmp")
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    yield env
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def onboxctl(env, *args):
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def landed(box_home):
    root = os.path.join(box_home, ".onbox", "code", "proj")
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_a_push_to_a_box_leaves_secret_looking_files_home_and_names_them(sshd_box, ctl, tmp_path, onbox_pyz):
    e = sshd_box.inventory_entry()
    add = ["box", "add", "b1", "--host", e["host"], "--port", str(e["port"]), "--user", "root", "--identity",
           e["identity"], "--python", e["python"]]
    for o in e["options"]:
        add += ["--ssh-option", o]
    assert onboxctl(ctl, *add).returncode == 0
    code = tmp_path / "proj"
    for rel, text in {**LEGIT, **SECRET, **IGNORED}.items():
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(text)

    r = onboxctl(ctl, "push", "b1", "--code", str(code), "--pyz", onbox_pyz, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert landed(str(sshd_box.home)) == sorted(LEGIT)
    rep = json.loads(r.stdout)
    assert sorted(f["path"] for f in rep["secrets_left_out"]) == [".env", ".git/", ".ssh/", "kaggle.json",
                                                                  "notes/deploy"]
    (warning,) = [ln for ln in r.stderr.splitlines() if ln.startswith("onboxctl: warning: ")]
    assert "left out 5 secret-looking path(s)" in warning and "notes/deploy (holds a private key (PEM))" in warning
    assert "data/" not in warning

    r = onboxctl(ctl, "push", "b1", "--code", str(code), "--pyz", onbox_pyz, "--include-secret", ".env",
                 "--delete")
    assert r.returncode == 0, r.stdout + r.stderr  # verified on the box with the same filters
    assert landed(str(sshd_box.home)) == sorted([*LEGIT, ".env"])
    assert "sending secret-looking path(s) of --code %s as asked" % code in r.stderr

    r = onboxctl(ctl, "push", "b1", "--code", str(code), "--pyz", onbox_pyz, "--include-secret", "data/.env")
    assert r.returncode == 2 and "names no secret-looking file that would be sent" in r.stderr, r.stderr
