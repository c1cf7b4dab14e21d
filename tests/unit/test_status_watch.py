"""`onboxctl status --watch` waits its --interval through the clock seam (controller/commands/status.py's WAITS):
a FakeClock takes the waits, so the test runs three frames without waiting 2 x 60 s."""
from __future__ import annotations

from click.testing import CliRunner

import controller.commands.status as status_mod
from controller.cli import cli
from onbox.clock import FakeClock


def test_status_watch_waits_its_interval_on_the_clock_seam(monkeypatch, tmp_path):
    clock = FakeClock()
    monkeypatch.setattr(status_mod, "WAITS", clock)
    monkeypatch.setattr(status_mod, "collect", lambda url, token, boxes, ssh: ([], [], []))
    env = {"ONBOX_CONFIG_DIR": str(tmp_path), "ONBOX_TRACKER": "", "ONBOX_SSH_CONTROL_DIR": str(tmp_path / "ctl")}
    r = CliRunner().invoke(cli, ["status", "--watch", "--interval", "60", "--count", "3"], env=env)
    assert r.exit_code == 0, r.output
    assert clock.sleeps == [60.0, 60.0]  # between the three frames, none after the last
    assert r.output.count("(every 60s, Ctrl-C to stop)") == 3
