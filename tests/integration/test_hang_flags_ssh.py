"""`onboxctl run --hang-after DUR --on-hang ACTION` reaches the agent on a real sshd box: the run's config.json there
records them; a bad --hang-after is refused on this machine before any ssh (exit 2, naming the flag)."""
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
    cm = tempfile.mkdtemp(prefix="oh", dir="/tmp")
    yield subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def ctl(env, *args):
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_onboxctl_run_passes_the_hang_flags_to_the_agent(sshd_box, ctl_env, onbox_pyz):
    e = sshd_box.inventory_entry()
    add = ["box", "add", "hb", "--host", e["host"], "--port", str(e["port"]), "--user", "root",
           "--identity", e["identity"], "--python", e["python"]]
    for o in e["options"]:
        add += ["--ssh-option", o]
    assert ctl(ctl_env, *add).returncode == 0
    bad = ctl(ctl_env, "run", "hb", "--hang-after", "5 minutes", "--", "sleep", "30")
    assert bad.returncode == 2 and "--hang-after" in bad.stderr and "Traceback" not in bad.stderr
    assert ctl(ctl_env, "push", "hb", "--pyz", onbox_pyz).returncode == 0
    r = ctl(ctl_env, "run", "hb", "--name", "hangflags", "--hang-after", "5m", "--on-hang", "stop", "--json", "--",
            "sleep", "30")
    assert r.returncode == 0, r.stderr
    try:
        record = subprocess.run(["ssh", *sshd_box.client_options_argv(), "-p", str(sshd_box.port), "root@127.0.0.1",
                                 "cat .onbox/runs/hangflags/config.json"], capture_output=True, text=True, timeout=60)
        cfg = json.loads(record.stdout)
        assert (cfg["hang_after"], cfg["on_hang"]) == (300.0, "stop")
    finally:
        ctl(ctl_env, "stop", "hb", "hangflags")
