"""onboxctl against a real OpenSSH box (tests/hosts/sshd_box.py): push, secrets, a dead box, pull and the gate."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from controller.boxes.agent import REMOTE_PYZ
from controller.boxes.inventory import Box, Inventory
from controller.boxes.ssh import Ssh, SshSettings
from controller.launch.push import push, verify_pushed
from controller.results.pull import PARTIAL_DIR, PullsRecord, Transfer, pull_run
from onbox.errors import JobFailed
from tests.conftest import default_sigint, subprocess_env
from tests.hosts.sshd_box import close_masters
from tests.hosts.terminal import down_on_a_terminal

pytestmark = pytest.mark.integration


def _read(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def ctl(tmp_path, request):
    """Environment for onboxctl subprocesses: a private config dir and a short ControlPath dir."""
    cm = tempfile.mkdtemp(prefix="oc", dir="/tmp")
    env = subprocess_env({"ONBOX_CONFIG_DIR": str(tmp_path / "cfg"), "ONBOX_SSH_CONTROL_DIR": cm})
    yield env
    close_masters(cm)
    shutil.rmtree(cm, ignore_errors=True)


def add_box(env, name, box):
    e = box.inventory_entry()
    argv = [sys.executable, "-m", "controller", "box", "add", name, "--host", e["host"], "--port", str(e["port"]),
            "--user", "root", "--identity", e["identity"], "--python", e["python"]]
    for o in e["options"]:
        argv += ["--ssh-option", o]
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=30)
    return Inventory(env["ONBOX_CONFIG_DIR"]).resolve(name)


def onboxctl(env, *args, input_bytes=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, input=input_bytes,
                          capture_output=True, timeout=timeout)


def test_push_copies_once_honours_gitignore_and_verifies(sshd_box, ctl, tmp_path, onbox_pyz):
    box = add_box(ctl, "b1", sshd_box)
    pyz = onbox_pyz
    code = tmp_path / "proj"
    (code / "data").mkdir(parents=True)
    (code / "train.py").write_text("print('hi')\n")
    (code / ".gitignore").write_text("data/\n*.log\n")
    (code / "data" / "big.bin").write_bytes(b"x" * 1000)
    (code / "run.log").write_text("noise")
    r = onboxctl(ctl, "run", "b1", "--", "python", "train.py")  # nothing pushed yet
    assert r.returncode == 2 and b"push it first: onboxctl push b1" in r.stderr, r.stderr
    r = onboxctl(ctl, "push", "b1", "--code", str(code), "--pyz", pyz, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["pyz_copied"] and rep["code_files_changed"] >= 2 and rep["remote_version"]
    remote = sshd_box.home / ".onbox" if hasattr(sshd_box.home, "joinpath") else os.path.join(sshd_box.home, ".onbox")
    assert hashlib.sha256(_read(os.path.join(remote, "onbox.pyz"))).hexdigest() == rep["pyz_sha256"]
    landed = sorted(os.listdir(os.path.join(remote, "code", "proj")))
    assert landed == [".gitignore", "train.py"]  # data/ and *.log stayed home
    r = onboxctl(ctl, "push", "b1", "--code", str(code), "--pyz", pyz, "--json")
    rep2 = json.loads(r.stdout)
    assert not rep2["pyz_copied"] and rep2["code_files_changed"] == 0

    # drift on the box (U42): the verification notices
    with open(os.path.join(remote, "code", "proj", "train.py"), "a") as f:
        f.write("# edited on the box\n")
    ssh = Ssh(SshSettings(control_dir=ctl["ONBOX_SSH_CONTROL_DIR"]))
    with pytest.raises(JobFailed, match="differs"):
        verify_pushed(ssh, box, rep["pyz_sha256"], str(code), ".onbox/code/proj", 30)
    with open(os.path.join(remote, "onbox.pyz"), "ab") as f:
        f.write(b"tampered")
    with pytest.raises(JobFailed, match="sha256"):
        verify_pushed(ssh, box, rep["pyz_sha256"], None, None, 30)
    ssh.close(box.target())


def test_secret_never_in_ps_argv_or_logs(sshd_box, ctl, tmp_path):
    add_box(ctl, "b1", sshd_box)
    secret = "s3cr3t-" + os.urandom(8).hex()
    samples = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout)
            time.sleep(0.01)

    t = threading.Thread(target=sample)
    t.start()
    try:
        p = subprocess.Popen([sys.executable, "-m", "controller", "secrets", "push", "b1", "wandb"], env=ctl,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdin.write(secret[:5].encode())  # half the value now, half later: ssh streams it meanwhile
        p.stdin.flush()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("umask 077" in s for s in samples[-3:]):
            time.sleep(0.05)
        n = len(samples)
        while time.monotonic() < deadline and len(samples) < n + 3:
            time.sleep(0.05)
        out, err = p.communicate(secret[5:].encode(), timeout=60)
    finally:
        stop.set()
        t.join()
    assert p.returncode == 0, err
    assert len(samples) >= 3
    assert any("umask 077" in s for s in samples)  # we did sample while the remote command ran
    assert not [s for s in samples if secret in s]
    assert secret not in out.decode() + err.decode()
    path = os.path.join(sshd_box.home, ".onbox", "secrets", "wandb")
    assert _read(path).decode() == secret
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    for root, _dirs, files in os.walk(str(tmp_path)):
        for fn in files:
            full = os.path.join(root, fn)
            if full == path:
                continue
            with open(full, "rb") as f:
                assert secret.encode() not in f.read(), full


def test_dead_box_fails_fast_with_a_clear_message(netns_box, ctl, tmp_path, onbox_pyz):
    add_box(ctl, "dead", netns_box)
    pyz = onbox_pyz
    netns_box.netns.cut()  # packets silently dropped: the worst case, no RST
    env = dict(ctl, ONBOX_SSH_CONNECT_TIMEOUT="2")
    for args in (["push", "dead", "--pyz", pyz], ["run", "dead", "--", "python", "x.py"],
                 ["status", "--box", "dead"]):
        t0 = time.monotonic()
        r = onboxctl(env, *args, timeout=60)
        took = time.monotonic() - t0
        text = (r.stdout + r.stderr).decode()
        assert took < 20, (args, took)
        if args[0] == "status":  # the table still shows, the box marked UNREACHABLE, and the exit code says so
            assert r.returncode == 3 and "UNREACHABLE" in text and "cannot reach box dead" in text, text
        else:
            assert r.returncode == 3, (args, text)
            assert "cannot reach box dead" in text and "hint:" in text, text


def _fabricate_run(home, run, payload_bytes):
    """A run as the agent leaves it (the durable layout): config.json naming the durable dir, one committed ckpt."""
    rd = os.path.join(home, ".onbox", "runs", run)
    os.makedirs(rd)
    with open(os.path.join(rd, "config.json"), "w") as f:
        json.dump({"name": run, "durable": "/root/durable"}, f)
    with open(os.path.join(rd, "state.json"), "w") as f:
        json.dump({"run": run, "state": "preempted"}, f)
    ck = os.path.join(home, "durable", run, "checkpoints", "step_000100")
    os.makedirs(ck)
    data = os.urandom(payload_bytes)
    with open(os.path.join(ck, "model.dat"), "wb") as f:
        f.write(data)
    manifest = {"step": 100, "created": 1767225600.0,  # 2026-01-01T00:00:00Z, as onbox writes it
                "files": [{"path": "model.dat", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]}
    with open(os.path.join(ck, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f)
    os.makedirs(os.path.join(home, "durable", run, "logs"))
    with open(os.path.join(home, "durable", run, "logs", "output.log"), "w") as f:
        f.write("step 100\n")
    with open(os.path.join(home, "durable", run, "checkpoints_index.json"), "w") as f:
        json.dump({"checkpoints": [{"name": "step_000100", "step": 100}]}, f)


@pytest.mark.slow
def test_pull_interrupted_resumes_then_gate_allows(sshd_box, ctl, tmp_path, onbox_pyz):
    box = add_box(ctl, "b1", sshd_box)
    r = onboxctl(ctl, "down", "b1", "--yes")  # the gate asks the box's agent (`onbox checkpoints --all --json`)
    assert r.returncode == 2 and b"can't open file" in r.stderr and b"no onbox.pyz there" in r.stderr, r.stderr
    assert onboxctl(ctl, "push", "b1", "--pyz", onbox_pyz).returncode == 0
    _fabricate_run(sshd_box.home, "r1", 6 << 20)
    r = onboxctl(ctl, "down", "b1", "--yes", "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert not doc["allowed"] and doc["runs"][0]["newest"] == "step_000100"
    assert "refusing to tear down b1" in r.stderr.decode() and "onboxctl pull b1 r1" in r.stderr.decode()

    # an interrupted pull: slow it down, interrupt it (Ctrl-C) once part of the file has arrived
    dest = tmp_path / "pulled"
    p = subprocess.Popen([sys.executable, "-m", "controller", "pull", "b1", "r1", str(dest), "--bwlimit", "1500",
                          "--no-verify"], env=ctl, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True, preexec_fn=default_sigint)
    ckdir = dest / "r1" / "checkpoints" / "step_000100"
    partial = ckdir / PARTIAL_DIR / "model.dat"

    def arrived():
        temps = [f for f in ckdir.glob(".model.dat.*")] if ckdir.exists() else []
        return temps and temps[0].stat().st_size > (1 << 20)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not arrived():
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    p.wait(timeout=20)
    assert partial.exists() and 0 < partial.stat().st_size < (6 << 20)
    assert not (dest / "r1" / "checkpoints" / "step_000100" / "MANIFEST.json").exists()

    ssh = Ssh(SshSettings(control_dir=ctl["ONBOX_SSH_CONTROL_DIR"]))
    rec = PullsRecord(os.path.join(ctl["ONBOX_CONFIG_DIR"], "pulls.json"))
    report = pull_run(ssh, box, "r1", str(dest), transfer=Transfer(ssh, box, attempts=2, io_timeout=10),
                      record=rec)  # verified by onbox's own verifier (manifest sizes and sha256)
    assert report.ok and report.newest == "step_000100"
    # what the verification says is what it checked: model.dat has no format onbox checks and nothing loads with
    # torch (installed here or not), so no load is claimed
    got_rec = report.checkpoints[0]
    assert got_rec["loaded"] is None and got_rec["checked"].startswith(
        "size and sha256 of 1 file(s) against MANIFEST.json; 1 file(s) of no format onbox checks (hash only); "
        "not loaded: "), got_rec
    got = dest / "r1" / "checkpoints" / "step_000100"
    assert (got / "model.dat").read_bytes() == _read(os.path.join(sshd_box.home, "durable", "r1", "checkpoints",
                                                                   "step_000100", "model.dat"))
    assert not (got / PARTIAL_DIR).exists()
    assert (dest / "r1" / "logs" / "output.log").exists() and (dest / "r1" / "checkpoints_index.json").exists()

    r = onboxctl(ctl, "pull", "b1", "r1", str(dest), "--load")  # the CLI's words for it, a load asked for
    said = [ln for ln in r.stdout.decode().splitlines() if ln.startswith("pull: verified ")]
    assert r.returncode == 0 and said == [
        "pull: verified step_000100: OK (checked: size and sha256 of 1 file(s) against MANIFEST.json; 1 file(s) of no "
        "format onbox checks (hash only); not loaded: no torch or safetensors file to load)"], r.stdout
    assert b"loaded with torch" not in r.stdout

    r = onboxctl(ctl, "down", "b1")  # allowed, but nobody typed the box name back (no terminal): refused
    assert r.returncode == 2 and "confirmation needed" in r.stderr.decode()
    r = onboxctl(ctl, "down", "b1", "--yes")
    assert r.returncode == 0, r.stderr
    assert "Gate passed" in r.stdout.decode() and "Meter stop" in r.stdout.decode()
    # on a terminal the box name must be typed back: a wrong name does nothing, the right one passes
    assert down_on_a_terminal(ctl, "b1", "b2")[0] == 2
    rc, screen = down_on_a_terminal(ctl, "b1", "b1")
    assert rc == 0 and "Type the box name (b1)" in screen and "Gate passed" in screen

    # a new commit on the box after the pull: the gate refuses again
    _newer = os.path.join(sshd_box.home, "durable", "r1", "checkpoints", "step_000200")
    shutil.copytree(os.path.join(sshd_box.home, "durable", "r1", "checkpoints", "step_000100"), _newer)
    m = json.loads(_read(os.path.join(_newer, "MANIFEST.json")))
    m["step"] = 200
    with open(os.path.join(_newer, "MANIFEST.json"), "w") as f:
        json.dump(m, f)
    r = onboxctl(ctl, "down", "b1", "--yes")
    assert r.returncode == 1 and "step_000200" in r.stdout.decode()

    # ... and a damaged copy on the box fails verification after the pull: still refused, saying why
    with open(os.path.join(_newer, "model.dat"), "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = onboxctl(ctl, "pull", "b1", "r1", str(dest), "--latest")
    assert r.returncode == 1 and "verification failed for step_000200" in r.stderr.decode(), r.stderr
    r = onboxctl(ctl, "down", "b1", "--yes")
    assert r.returncode == 1 and "verification failed" in r.stdout.decode()
    ssh.close(box.target())


def test_remote_pyz_path_is_relative_to_home():
    assert REMOTE_PYZ == ".onbox/onbox.pyz"
    assert Box(name="x", host="h").python == "python3"
    assert push  # imported for the CLI path above


def test_down_with_abandon_names_the_abandoned_run_and_how_to_stop_the_meter(sshd_box, ctl, tmp_path, onbox_pyz):
    """`down --abandon RUN` passes, and says which run is pulled and verified and which was abandoned (never "every
    run's newest checkpoint is pulled and verified"); the meter line is the profile's own sentence."""
    add_box(ctl, "b1", sshd_box)
    assert onboxctl(ctl, "push", "b1", "--pyz", onbox_pyz).returncode == 0
    _fabricate_run(sshd_box.home, "r1", 4096)
    _fabricate_run(sshd_box.home, "r2", 4096)
    r = onboxctl(ctl, "pull", "b1", "r1", str(tmp_path / "pulled"))
    assert r.returncode == 0, r.stderr
    r = onboxctl(ctl, "down", "b1", "--yes", "--abandon", "r2")
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    assert "every run's newest checkpoint" not in out
    lines = out.splitlines()
    assert lines[-2] == ("Gate passed for b1: newest checkpoint pulled and verified: r1; ABANDONED with --abandon, "
                         "newest state not home: r2."), out
    assert lines[-1] == ("To stop the meter, stop or delete the box the way its provider does: onbox knows no "
                         "platform for it, and deleting the box deletes its disk."), out  # generic-ssh, the default
    doc = json.loads(onboxctl(ctl, "down", "b1", "--yes", "--abandon", "r2", "--json").stdout)
    assert {v["run"]: v["kind"] for v in doc["runs"]} == {"r1": "verified", "r2": "abandoned"}
    assert doc["meter_stop"]["how"].startswith("To stop the meter, stop or delete the box")
    Ssh(SshSettings(control_dir=ctl["ONBOX_SSH_CONTROL_DIR"])).close(Inventory(ctl["ONBOX_CONFIG_DIR"]).resolve(
        "b1").target())


def test_down_execute_meter_stop_runs_the_profiles_command_only_when_asked_and_says_each_failure(
        sshd_box, ctl, tmp_path, onbox_pyz):
    """`down --execute-meter-stop` runs the profile's meter-stop command (a list argv, {box} filled in) once the gate
    passed; without the flag nothing runs. A command that is not installed (exit 3), that fails (exit 1, its stderr
    said), or that does not split into words (exit 2, refused before anything is done) is a message that says the box
    may still bill, never a traceback; with --json the command's own output stays off stdout."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    marker = tmp_path / "meter-stopped"
    stopper = tmp_path / "stop_meter.py"
    stopper.write_text("import sys\nopen(%r, 'a').write(sys.argv[1] + '\\n')\nprint('stopping', sys.argv[1])\n"
                       % str(marker))

    def profile(command):
        (profiles / "mycloud.toml").write_text('[meter_stop]\nverb = "stop"\ncommand = %s\n' % json.dumps(command))

    env = dict(ctl, ONBOX_PROFILES_DIR=str(profiles))
    profile("%s %s {box}" % (sys.executable, stopper))
    e = sshd_box.inventory_entry()
    argv = [sys.executable, "-m", "controller", "box", "add", "b1", "--host", e["host"], "--port", str(e["port"]),
            "--user", "root", "--identity", e["identity"], "--python", e["python"], "--profile", "mycloud"]
    for o in e["options"]:
        argv += ["--ssh-option", o]
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=30)
    assert onboxctl(env, "push", "b1", "--pyz", onbox_pyz).returncode == 0

    r = onboxctl(env, "down", "b1", "--yes")  # no runs on the box: the gate passes; the command is only named
    assert r.returncode == 0, r.stderr
    assert "stop_meter.py b1" in r.stdout.decode() and not marker.exists()

    r = onboxctl(env, "down", "b1", "--yes", "--execute-meter-stop")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert marker.read_text() == "b1\n"
    assert "running the meter-stop command of profile mycloud" in err and "stopping b1" in err, err
    assert "finished (exit 0)" in err

    r = onboxctl(env, "down", "b1", "--yes", "--execute-meter-stop", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["meter_stop_command"].endswith("stop_meter.py b1")  # stdout: the document only
    assert marker.read_text() == "b1\nb1\n"

    profile("no-such-meter-tool-for-onbox stop {box}")
    r = onboxctl(env, "down", "b1", "--yes", "--execute-meter-stop")
    err = r.stderr.decode()
    assert r.returncode == 3, err
    assert "no-such-meter-tool-for-onbox is not installed" in err and "nothing was stopped" in err, err
    assert "Traceback" not in err

    profile("%s -c \"import sys; sys.stderr.write('quota exceeded'); sys.exit(7)\"" % sys.executable)
    r = onboxctl(env, "down", "b1", "--yes", "--execute-meter-stop")
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "failed (exit 7): quota exceeded" in err and "may still bill" in err, err

    profile("%s %s '{box}" % (sys.executable, stopper))  # an unbalanced quote
    r = onboxctl(env, "down", "b1", "--yes", "--execute-meter-stop")
    err = r.stderr.decode()
    assert r.returncode == 2 and "does not split into words" in err and "Traceback" not in err, err
    assert "Gate passed" not in r.stdout.decode()  # refused before anything was done
    assert marker.read_text() == "b1\nb1\n"
    Ssh(SshSettings(control_dir=ctl["ONBOX_SSH_CONTROL_DIR"])).close(Inventory(ctl["ONBOX_CONFIG_DIR"]).resolve(
        "b1").target())
