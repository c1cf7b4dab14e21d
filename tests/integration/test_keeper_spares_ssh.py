"""What `onboxctl run --recover` records and says about the boxes that would take the run (issue 31, also found; issue
30's review), on two real sshd boxes on loopback (tests/hosts/sshd_box.py) with the real onbox.pyz:

- a pool whose every spare fails `onbox audit` for the run (its --ckpt-dir is under a file there) is said at once,
  on stderr and in recovery.json (`spares_unfit`), not 114 s after the first loss; a pool with a fit spare says
  nothing;
- a file the user sends on purpose with `--code DIR --include-secret .env` is in the launch record (its path, never
  its content), and the keeper's push to a replacement box sends it; a secret-looking file not named stays home.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.hosts.keeper_rig import Rig
from tests.hosts.sshd_box import SshdBox, _need_root_tools

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def two_boxes(tmp_path):
    _need_root_tools()
    boxes = [SshdBox(str(tmp_path / name)) for name in ("b", "s")]
    try:
        for box in boxes:
            box.start()
        yield boxes
    finally:
        for box in boxes:
            box.stop()


@pytest.fixture
def rig(tmp_path, onbox_pyz, two_boxes):
    r = Rig(tmp_path / "ctl", onbox_pyz)
    r.add("b", two_boxes[0])
    r.add("s0", two_boxes[1], pool="p")
    for name in ("b", "s0"):
        r.ctl("push", name, "--pyz", r.pyz)
    yield r
    r.close()


def launch(rig: Rig, run: str, *extra: str):
    return rig.ctl("run", "b", "--name", run, "--durable", rig.durable, "--recover", "pool:p", "--ckpt-dir",
                   "/root/ckpt/%s" % run, "--workdir", str(rig.tmp), *extra, "--", *SLEEPER)


def test_a_pool_whose_every_spare_fails_audit_is_said_at_run_and_a_fit_one_is_not(rig, two_boxes):
    spare = two_boxes[1]
    with open(os.path.join(spare.home, "ckpt"), "w") as f:  # the runs' --ckpt-dir is under a file there
        f.write("not a directory\n")
    r = launch(rig, "kp")
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("onboxctl: warning:")]
    assert "no spare of pool p can take run kp now" in line and "s0 fails `onbox audit`" in line, line
    assert "checkpoint dir /root/ckpt/kp is not writable" in line and "failed_no_resource" in line, line
    assert "--provision" in line and "Traceback" not in r.stderr
    kinds = [e["kind"] for e in rig.record()["events"]]
    assert kinds == ["launched", "spares_unfit"], kinds
    assert not os.path.exists(os.path.join(spare.home, ".onbox", "runs"))  # asked, nothing written there
    # beside it: the spare fixed, the next run's pool can take it: nothing is said
    os.unlink(os.path.join(spare.home, "ckpt"))
    with rig.named("kq"):
        r = launch(rig, "kq")
        assert "warning" not in r.stderr, r.stderr
        assert [e["kind"] for e in rig.record()["events"]] == ["launched"]
        rig.kill_run("b")


def test_a_secret_sent_on_purpose_is_recorded_and_sent_to_a_replacement_box(rig, two_boxes, tmp_path, monkeypatch):
    from controller.boxes.inventory import Inventory
    from controller.boxes.ssh import Ssh, settings_from_env
    from controller.keeper.records import RecordStore
    from controller.keeper.world import World

    code = tmp_path / "train"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")
    (code / ".env").write_text("WANDB_API_KEY=k-123\n")
    (code / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    launch(rig, "kp", "--code", str(code), "--include-secret", ".env")
    with open(os.path.join(rig.cfg, "runs", "kp", "launch.json")) as f:
        doc = json.load(f)
    assert doc["include_secrets"] == [".env"] and "k-123" not in json.dumps(doc)
    for key, value in rig.env.items():
        if key.startswith("ONBOX_"):
            monkeypatch.setenv(key, value)
    rec = RecordStore().load_launch("kp")
    world = World(Ssh(settings_from_env()), Inventory())
    world.push(world.box("s0"), rec)  # what the keeper does to a replacement box
    sent = os.path.join(two_boxes[1].home, ".onbox", "code", "train")
    with open(os.path.join(sent, ".env")) as f:
        assert f.read() == "WANDB_API_KEY=k-123\n"
    assert os.path.exists(os.path.join(sent, "train.py")) and not os.path.exists(os.path.join(sent, "id_rsa"))
