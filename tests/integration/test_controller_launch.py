"""`onboxctl run` on several boxes at once (and from a fan-out file), and `status` reading a tracker over HTTP."""
from __future__ import annotations

import http.server
import json
import os
import pty
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from tests.conftest import subprocess_env
from tests.hosts.sshd_box import close_masters
from tests.polling import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def ctl_env(tmp_path):
    cm = tempfile.mkdtemp(prefix="ol", dir="/tmp")
    yield subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def ctl(env, *args, check=True):
    r = subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                       timeout=120)
    if check:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


@pytest.mark.slow
def test_run_on_several_boxes_with_bounded_concurrency_and_fanout(sshd_box, ctl_env, tmp_path, onbox_pyz):
    e = sshd_box.inventory_entry()
    for name in ("b1", "b2", "b3"):  # three inventory names for one sshd: three "boxes" as far as ssh knows
        add = ["box", "add", name, "--host", e["host"], "--port", str(e["port"]), "--user", "root",
               "--identity", e["identity"], "--python", e["python"]]
        for o in e["options"]:
            add += ["--ssh-option", o]
        ctl(ctl_env, *add)
    ctl(ctl_env, "push", "b1", "--pyz", onbox_pyz)
    r = ctl(ctl_env, "run", "b1", "b2", "--name", "sweep", "--parallel", "2", "--json", "--", "sleep", "30")
    runs = json.loads(r.stdout)["runs"]
    assert [(x["box"], x["name"], x["ok"]) for x in runs] == [("b1", "sweep-b1", True), ("b2", "sweep-b2", True)]
    assert all(x["state"] == "running" and x["pid"] for x in runs)
    fan = tmp_path / "fan.txt"
    got = tmp_path / "got"  # the job writes what it was given (the box is this machine, behind a real sshd)
    fan.write_text("# one box a line\nb3 -- sh -c 'printf %%s \"$WANDB:$BATCH\" > %s.tmp && mv %s.tmp %s; sleep 31'\n"
                   % (got, got, got))
    secret = "wandb-" + os.urandom(8).hex()
    subprocess.run([sys.executable, "-m", "controller", "secrets", "push", "b3", "wandbkey"], env=ctl_env,
                   input=secret.encode(), capture_output=True, timeout=60, check=True)
    env_file = tmp_path / "job.env"
    env_file.write_text("BATCH=32\n")
    r = ctl(ctl_env, "run", "--fanout", str(fan), "--name", "solo", "--json", "--secret", "WANDB=wandbkey",
            "--env-file", str(env_file))
    assert json.loads(r.stdout)["runs"][0]["name"] == "solo"
    wait_for(got.exists, 30, "the job's output")
    assert got.read_text() == secret + ":32"  # the secret reached the job, through the box's secrets dir
    record = subprocess.run(["ssh", *sshd_box.client_options_argv(), "-p", str(sshd_box.port), "root@127.0.0.1",
                             "cat .onbox/runs/solo/config.json"], capture_output=True, text=True, timeout=60)
    assert '"WANDB=wandbkey"' in record.stdout and secret not in record.stdout  # recorded by name, never by value
    # a second launch under a live name is refused by the agent (no double launch), reported per box
    r = ctl(ctl_env, "run", "b1", "--name", "sweep-b1", "--", "sleep", "1", check=False)
    assert r.returncode == 2 and r.stderr.startswith("b1: refused, nothing started: ") and "sweep-b1" in r.stderr
    # without a tracker, status asks each box over ssh
    r = ctl(ctl_env, "status", "--json")
    names = {(x["box"], x["run"]) for x in json.loads(r.stdout)["runs"]}
    assert {("b1", "sweep-b1"), ("b1", "sweep-b2"), ("b1", "solo")} <= names
    # stop what we started, through the agents, in one call
    script = " ".join("%s .onbox/onbox.pyz stop %s --grace 2 >/dev/null 2>&1 &" % (e["python"], run)
                      for run in ("sweep-b1", "sweep-b2", "solo")) + " wait"
    subprocess.run(["ssh", *sshd_box.client_options_argv(), "-p", str(sshd_box.port), "root@127.0.0.1", script],
                   capture_output=True, timeout=60)


class _Tracker(http.server.BaseHTTPRequestHandler):
    doc: dict = {}
    auth: list = []

    def do_GET(self):
        self.auth.append(self.headers.get("Authorization"))
        body = json.dumps(self.doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_status_reads_the_tracker_and_watch_refreshes(ctl_env, tmp_path):
    _Tracker.doc = {"runs": [{"run": "r1", "box": "gpu1", "liveness": "silent", "age_s": 400,
                              "latest": {"run": "r1", "box": "gpu1", "state": "running", "attempt": 0,
                                         "progress": {"step": 7, "loss": 3.5}}}]}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Tracker)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    token = tmp_path / "tok"
    token.write_text("sekret\n")
    try:
        url = "http://127.0.0.1:%d" % srv.server_address[1]
        r = ctl(ctl_env, "status", "--tracker", url, "--tracker-token-file", str(token), "--watch",
                "--interval", "0.2", "--count", "2")
        assert r.stdout.count("6m SILENT") == 2 and r.stdout.count("BOX") == 2
        assert _Tracker.auth[-1] == "Bearer sekret"
        r = ctl(ctl_env, "status", "--json", "--tracker", url, "--tracker-token-file", str(token))
        assert json.loads(r.stdout)["runs"][0]["liveness"] == "silent"
        # on a terminal, --watch redraws in place: cursor home + clear-to-end each frame, no scrolling copies
        master, slave = pty.openpty()
        p = subprocess.Popen([sys.executable, "-m", "controller", "status", "--tracker", url, "--tracker-token-file",
                              str(token), "--watch", "--interval", "0.2", "--count", "3"], env=ctl_env, stdout=slave,
                             stderr=subprocess.PIPE)
        os.close(slave)
        screen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            screen += chunk
        p.wait(timeout=30)
        os.close(master)
        assert p.returncode == 0
        assert screen.count(b"\x1b[H") == 3 and screen.count(b"\x1b[2J") == 1 and screen.count(b"6m SILENT") == 3
    finally:
        srv.shutdown()
        srv.server_close()
    r = ctl(ctl_env, "status", "--tracker", url, check=False)
    assert r.returncode == 3 and "cannot read the tracker" in r.stderr


class _RawTracker(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        try:
            self.wfile.write(self.body)
        except OSError:  # the client stopped reading at its bound
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def raw_tracker():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RawTracker)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield "http://127.0.0.1:%d" % srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_a_tracker_answer_nested_100000_deep_is_one_clear_line_not_a_traceback(ctl_env, raw_tracker):
    _RawTracker.body = b'{"runs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = ctl(ctl_env, "status", "--tracker", raw_tracker, check=False)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 3, r.stderr
    assert r.stderr.splitlines()[0] == ("onboxctl: the tracker at %s answered something unreadable: it nests more "
                                        "than 64 levels deep" % raw_tracker), r.stderr


def test_a_tracker_answer_is_read_no_further_than_its_bound(raw_tracker):
    from controller.tracker.runview import fetch_tracker_runs
    from onbox.errors import UnfitError

    _RawTracker.body = b'{"runs": []}' + b" " * 4096
    with pytest.raises(UnfitError, match="answered more than 1 KiB for its run list"):
        fetch_tracker_runs(raw_tracker, None, limit=1024)
    assert fetch_tracker_runs(raw_tracker, None, limit=8192) == {"runs": []}


def test_a_tracker_that_does_not_speak_http_is_one_clear_line(ctl_env, garbage_metadata_server):
    r = ctl(ctl_env, "status", "--tracker", garbage_metadata_server, check=False)  # answers "NOT HTTP AT ALL"
    assert "Traceback" not in r.stderr and r.returncode == 3, r.stderr
    assert r.stderr.startswith("onboxctl: cannot read the tracker at %s" % garbage_metadata_server), r.stderr


def test_status_from_a_real_tracker_hints_at_heartbeat_interval_only_when_it_lags(ctl_env, tracker):
    """A real tracker (tests/hosts/tracker.py) and beats posted to it: a run beating every 30 s (the agent's default)
    gets the one-line note naming --heartbeat-interval, in the text and in --json's notes; a run beating every 5 s
    with a fresh beat gets none."""
    import time

    def beat(run, interval):
        return {"schema": "onbox.heartbeat/1", "run": run, "box": "gpu1", "attempt": 0, "seq": 1, "time": time.time(),
                "state": "running", "interval_s": interval, "progress": {"step": 7, "loss": 2.0}}

    assert tracker.post([beat("often", 5.0)]).status_code == 200
    args = ["status", "--tracker", tracker.url, "--tracker-token-file", tracker.token_file]
    r = ctl(ctl_env, *args)
    assert "often" in r.stdout and "note:" not in r.stdout and "--heartbeat-interval" not in r.stdout, r.stdout
    assert tracker.post([beat("slow", 30.0)]).status_code == 200
    r = ctl(ctl_env, *args)
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("note: ")]
    assert notes == ["note: the table is as old as each run's newest beat: gpu1/slow beats every 30 s, so its step "
                     "and loss can be that far behind; `onboxctl run --heartbeat-interval 5` beats more often"], r.stdout
    doc = json.loads(ctl(ctl_env, *args, "--json").stdout)
    assert [x for x in doc["notes"] if "--heartbeat-interval" in x] == [notes[0][len("note: "):]]
    assert {x["run"]: x["interval_s"] for x in doc["runs"]} == {"often": 5.0, "slow": 30.0}
