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


def _serve_and_read_banner(tmp_path, *args, env=None):
    """Start `tracker serve` with `args`, wait (bounded) for its two start-up lines on stderr, fetch the dashboard URL
    it names, then stop it (SIGTERM to our own child, reaped). Returns (the two lines, the dashboard's status)."""
    import re
    import signal
    import urllib.request

    from tests.polling import wait_for

    err = tmp_path / "serve.err"
    with open(err, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "controller", "tracker", "serve", "--port", "0", *args],
                             env=subprocess_env(env), stdout=subprocess.DEVNULL, stderr=f, stdin=subprocess.DEVNULL)
    try:
        def banner():
            lines = [ln for ln in err.read_text().splitlines() if ln.startswith("onboxctl tracker: ")]
            if p.poll() is not None:
                raise AssertionError("tracker exited %s: %s" % (p.returncode, err.read_text()))
            return lines if any(" dashboard " in ln for ln in lines) else None

        lines = wait_for(banner, 30, "the tracker's start-up lines", 0.05)
        url = re.search(r"dashboard (\S+?);", lines[-1]).group(1)
        with urllib.request.urlopen(url, timeout=10) as r:
            status = r.status
        return lines, status, p.pid
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def test_serve_says_where_it_listens_the_dashboard_and_where_the_token_is(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken-value-not-to-be-printed\n")
    token.chmod(0o600)
    db = tmp_path / "t.db"
    lines, status, pid = _serve_and_read_banner(tmp_path, "--db", str(db), "--token-file", str(token))
    assert status == 200  # the URL it gave is the dashboard (its login page without a cookie)
    port = int(lines[0].split("http://127.0.0.1:")[1].split(" ")[0])
    assert lines == ["onboxctl tracker: listening on http://127.0.0.1:%d (pid %d, database %s)" % (port, pid, db),
                     "onboxctl tracker: dashboard http://127.0.0.1:%d/; log in with the token in %s" % (port, token)]
    assert "t0ken-value" not in (tmp_path / "serve.err").read_text()  # where the token is, never the token


def test_serve_says_where_a_generated_or_environment_token_is(tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    lines, status, _ = _serve_and_read_banner(gen, "--db", str(gen / "t.db"), "--public-read")
    assert status == 200
    assert lines[0].startswith("onboxctl tracker: generated a token in %s" % (gen / "tracker.token"))
    assert lines[-1].endswith("; reads need no token (--public-read), writes need the one in %s"
                              % (gen / "tracker.token")), lines
    env = tmp_path / "env"
    env.mkdir()
    lines, _, _ = _serve_and_read_banner(env, "--db", str(env / "t.db"), env={"ONBOX_TRACKER_TOKEN": "from-env-1"})
    assert lines[-1].endswith("; log in with the token from $ONBOX_TRACKER_TOKEN"), lines
    assert not (env / "tracker.token").exists()
