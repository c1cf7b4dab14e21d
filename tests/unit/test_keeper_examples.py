"""The example provision scripts (profiles/keeper/) keep the keeper's contract: run against stand-ins for the
platforms' CLIs and ssh on PATH, each prints one JSON line the keeper accepts, names the box after
ONBOX_PROVISION_KEY, and run again finds the box it rented instead of renting another."""
from __future__ import annotations

import os
import subprocess

import pytest

from controller.keeper.provision import box_from_line
from tests.conftest import REPO_ROOT

EXAMPLES = os.path.join(REPO_ROOT, "profiles", "keeper")

VASTAI = r"""#!/bin/sh
log=%(log)s
echo "vastai $*" >> "$log"
case "$1 $2" in
  "show instances") if grep -q "create instance" "$log"; then echo '[{"id": 77, "label": "gpt-r1-n0"}]'; else echo '[]'; fi ;;
  "search offers") echo '[{"id": 4242, "dph_total": 0.9}]' ;;
  "create instance") echo '{"success": true, "new_contract": 77}' ;;
  "show instance") echo '{"id": 77, "actual_status": "running", "public_ipaddr": "198.51.100.7", "ports": {"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": "40022"}]}}' ;;
esac
"""

RUNPODCTL = r"""#!/bin/sh
log=%(log)s
echo "runpodctl $*" >> "$log"
case "$1 $2" in
  "get pod")
    echo "ID              NAME       GPU  IMAGE NAME  STATUS   PORTS"
    if grep -q "create pod" "$log"; then
      echo "abc123xyz       gpt-r1-n0  1 A100  runpod/x    RUNNING  198.51.100.8:22105->22 (Pub,TCP)"
    fi ;;
  "create pod") echo 'pod "abc123xyz" created for $0.79 / hr' ;;
esac
"""

SSH = "#!/bin/sh\necho \"ssh $*\" >> %(log)s\nexit 0\n"


def stand_ins(tmp_path, name, text):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    for tool, body in ((name, text), ("ssh", SSH)):
        p = bin_dir / tool
        p.write_text(body % {"log": log})
        p.chmod(0o755)
    return str(bin_dir), log


@pytest.mark.parametrize("script, tool, text, host, port", [
    ("vastai-provision.sh", "vastai", VASTAI, "198.51.100.7", 40022),
    ("runpod-provision.sh", "runpodctl", RUNPODCTL, "198.51.100.8", 22105),
])
def test_an_example_provision_script_keeps_the_contract(tmp_path, script, tool, text, host, port):
    bin_dir, log = stand_ins(tmp_path, tool, text)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], ONBOX_RUN="gpt", ONBOX_POOL="a100",
               ONBOX_NODE="0", ONBOX_PROVISION_KEY="gpt-r1-n0")
    for _ in (1, 2):  # the second run (a keeper restarted mid-provision) finds the same box
        r = subprocess.run(["bash", os.path.join(EXAMPLES, script)], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        box = box_from_line(r.stdout.strip().splitlines()[-1], "a100")
        assert (box.name, box.host, box.port, box.user) == ("gpt-r1-n0", host, port, "root")
    calls = log.read_text()
    assert calls.count("create") == 1, calls  # rented once
    assert "-p %d root@%s true" % (port, host) in calls  # waited for ssh before saying so


def test_the_examples_say_the_keeper_never_tears_down():
    for name in ("vastai-provision.sh", "runpod-provision.sh"):
        with open(os.path.join(EXAMPLES, name)) as f:
            assert "The keeper never tears a box down" in f.read()
