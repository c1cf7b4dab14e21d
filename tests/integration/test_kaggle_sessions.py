"""The script `onboxctl kaggle push` writes, run here in a Kaggle-shaped layout through two sessions, with the real
onbox.pyz inside it and the system's python3 (no onbox installed: the script must stand alone, as on Kaggle).

Each session is what Kaggle gives a kernel, shrunk: a fresh PID namespace (PID 1 starts with the session, which is
what the kaggle profile counts its [session] hours from), `<root>/input` (read-only: bind-mounted read-only in the
session's own mount namespace) and `<root>/working` under a temp root (ONBOX_KAGGLE_ROOT), KAGGLE_KERNEL_RUN_TYPE
set, and the profile's session hours shrunk to seconds by a user profile in ONBOX_HOME. The first session is stopped
by its deadline after a commit; its working dir becomes the second session's input (as Kaggle mounts the previous
version's output when the kernel lists itself as a source); the second restores from it and trains to the end.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from controller.kaggle import folder
from tests.processes import kill_test_processes

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEM_PYTHON = "/usr/bin/python3"
STEPS, INTERVAL = 120, 0.1  # 12 s of training: more than the first session leaves, less than the second
KNOBS = {"ONBOX_GRACE": "2", "ONBOX_DEADLINE_MARGIN": "1", "ONBOX_SETTLE_SECONDS": "0.3",
         "ONBOX_SYNC_INTERVAL": "0.5", "ONBOX_TICK_INTERVAL": "0.1", "KAGGLE_KERNEL_RUN_TYPE": "Batch"}


def _need_namespaces() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("needs root, unshare (util-linux) and %s for a Kaggle-shaped session" % SYSTEM_PYTHON)
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip("this machine cannot make a PID namespace: %s" % probe.stderr.decode()[-200:])


def kernel_folder(tmp_path, pyz: str) -> str:
    code = tmp_path / "code"
    code.mkdir()
    for name in ("keep_trainer.py", "slurm_trainer.py"):
        shutil.copy(os.path.join(HERE, name), code / name)
    spec = folder.KernelSpec(owner="tester", run="chain", command=[
        "python3", "keep_trainer.py", "--steps", str(STEPS), "--interval", str(INTERVAL), "--save-every", "5",
        "--trace", str(tmp_path / "trace.jsonl")])
    with open(pyz, "rb") as f:
        folder.write(str(tmp_path / "kernel"), spec, f.read(), folder.pack_code(str(code)))
    return str(tmp_path / "kernel" / folder.SCRIPT_FILE)


def session(tmp_path, script: str, name: str, seconds: float, previous_output=None):
    """One Kaggle-shaped session; returns (exit code, output, its root)."""
    root = tmp_path / name
    for d in ("input", "working", "temp"):
        (root / d).mkdir(parents=True)
    home = tmp_path / ("home-" + name)
    (home / "profiles").mkdir(parents=True)
    (home / "profiles" / "kaggle.toml").write_text("[session]\nhours = %r\n" % (seconds / 3600.0))
    mount_ro = ""
    if previous_output is not None:
        shutil.copytree(previous_output, root / "input" / folder.slug_of("chain"))
        # Kaggle mounts inputs read-only: so does this session's own mount namespace (root or not)
        mount_ro = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && '
    env = dict(os.environ, ONBOX_KAGGLE_ROOT=str(root), ONBOX_HOME=str(home), **KNOBS)
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", mount_ro + 'exec "$2" "$3"', "sh",
            str(root / "input"), SYSTEM_PYTHON, script]
    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    finally:
        kill_test_processes(str(home), settle=0.0)
    return r.returncode, r.stdout + r.stderr, root


def outcome(root):
    with open(root / "working" / "onbox-kaggle.json") as f:
        return json.load(f)


def committed(root):
    """{checkpoint name: step} of what the session left committed in its output."""
    out = {}
    ckpts = root / "working" / "onbox-durable" / "chain" / "checkpoints"
    for name in sorted(os.listdir(ckpts)) if ckpts.is_dir() else []:
        manifest = ckpts / name / "MANIFEST.json"
        if manifest.is_file():
            out[name] = json.loads(manifest.read_text())["step"]
    return out


def tree(path):
    return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(path) for f in files)


def test_two_sessions_a_deadline_stops_the_first_after_a_commit_and_the_second_resumes_from_its_output(
        tmp_path, onbox_pyz):
    _need_namespaces()
    script = kernel_folder(tmp_path, onbox_pyz)

    t0 = time.time()
    rc, out, first = session(tmp_path, script, "s1", seconds=10)
    assert rc == 0, out  # stopped by its clock: the kernel succeeds, the chain goes on
    doc = outcome(first)
    assert doc["outcome"] == "session_limit" and doc["exit_code"] == 75, doc
    assert doc["last_exit"]["classification"] == "session_limit"
    assert time.time() - t0 < 10 + 5, "the first session outlived its clock"
    kept = committed(first)
    assert kept, "nothing was committed before the session's end: %s" % out
    stopped_at = max(kept.values())
    assert 0 < stopped_at < STEPS
    assert "push again to continue" in out

    rc, out, second = session(tmp_path, script, "s2", seconds=45, previous_output=first / "working")
    assert rc == 0, out
    doc = outcome(second)
    assert doc["outcome"] == "done" and doc["exit_code"] == 0, doc
    assert doc["seed"]["seeded"] and doc["seed"]["step"] == stopped_at
    assert doc["seed"]["from"] == str(second / "input" / "onbox-chain" / "onbox-durable" / "chain")
    starts = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines() if "start" in line]
    assert [s["start"] for s in starts] == [0, stopped_at]  # the second started where the first's commit ended
    assert os.path.basename(starts[1]["resume"]) in kept
    assert max(committed(second).values()) == STEPS  # trained to the end, and that too is in the output
    assert tree(second / "input" / "onbox-chain") == tree(first / "working")  # the read-only input was only read
