"""`onboxctl tracker serve` on bad input: one clear line, exit 2, nothing served."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.integration


def serve(*args, tmp_path, timeout=60):
    return subprocess.run([sys.executable, "-m", "controller", "tracker", "serve", "--db", str(tmp_path / "t.db"),
                           *args], env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def test_missing_token_file_is_usage_error(tmp_path):
    res = serve("--token-file", str(tmp_path / "nope"), "--port", "0", tmp_path=tmp_path)
    assert res.returncode == 2
    assert "cannot read the token file" in res.stderr and "hint:" in res.stderr


def test_port_in_use_is_usage_error(tmp_path):
    token = tmp_path / "token"
    token.write_text("t\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        res = serve("--token-file", str(token), "--port", str(taken.getsockname()[1]), tmp_path=tmp_path)
    finally:
        taken.close()
    assert res.returncode == 2 and "cannot listen" in res.stderr


def test_generated_token_is_private(tmp_path):
    # without --token-file and ONBOX_TRACKER_TOKEN (conftest clears ONBOX_*), a token is generated beside the DB
    from controller.commands.tracker import resolve_token

    db = tmp_path / "gen" / "t.db"
    db.parent.mkdir()
    token = resolve_token(None, str(db))
    path = db.parent / "tracker.token"
    assert path.read_text().strip() == token and len(token) >= 32
    assert (path.stat().st_mode & 0o777) == 0o600
    assert resolve_token(None, str(db)) == token  # stable across restarts
