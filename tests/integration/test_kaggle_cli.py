"""`onboxctl kaggle` end to end through the real `kaggle` CLI (the pinned kaggle package of the controller extra),
pointed at a local server that answers like Kaggle's kernels API (tests/hosts/kaggle_api.py: kagglesdk's
KAGGLE_API_ENVIRONMENT=LOCALHOST, reached through http_proxy). The server runs each pushed version's script the way
Kaggle would, Kaggle-shaped (tests/hosts/kaggle_session.py), with the kernel's sources mounted read-only: a chain
of two pushes trains to the end with no person copying files, and `onboxctl kaggle pull` brings the result home
verified. Kaggle itself cannot be reached from here.

The same two sessions are the test of the script itself: the first is stopped by its deadline after a commit, the
second restores from the first's output (read-only, untouched) and finishes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from controller.kaggle import cli as kaggle_cli
from tests.hosts.kaggle_api import FakeKaggle
from tests.hosts.kaggle_session import committed, need_namespaces, run_session

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, INTERVAL = 120, 0.1
REF = "tester/onbox-chain"


def need_kaggle_cli() -> str:
    exe = kaggle_cli.executable()
    if not (os.path.isabs(exe) and os.access(exe, os.X_OK)):
        pytest.skip("the kaggle CLI is not installed (the controller extra pins it; it needs Python 3.11+)")
    return exe


@pytest.fixture
def kaggle(tmp_path):
    fake = FakeKaggle(str(tmp_path / "kaggle-server")).start()
    try:
        yield fake
    finally:
        fake.stop()


def outcome(working):
    with open(os.path.join(working, "onbox-kaggle.json")) as f:
        return json.load(f)


def tree(path):
    return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                  for d, _, files in os.walk(path) for f in files)


def onboxctl(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "controller", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_chain_of_pushes_trains_to_the_end_through_the_kaggle_cli_and_pull_verifies_it(
        tmp_path, kaggle, onbox_pyz):
    need_kaggle_cli()
    need_namespaces()
    code = tmp_path / "code"
    code.mkdir()
    for name in ("keep_trainer.py", "slurm_trainer.py"):
        shutil.copy(os.path.join(HERE, name), code / name)
    env = dict(os.environ, ONBOX_CONFIG_DIR=str(tmp_path / "cfg"), ONBOX_PYZ=onbox_pyz,
               **kaggle.client_env(str(tmp_path / "kaggle-config")))
    env.pop("KAGGLE_USERNAME", None)
    env.pop("KAGGLE_KEY", None)
    push = ["kaggle", "push", str(tmp_path / "kernel"), "--name", "chain", "--accelerator", "NvidiaTeslaT4",
            "--code", str(code), "--json", "--", "python3", "keep_trainer.py", "--steps", str(STEPS),
            "--interval", str(INTERVAL), "--save-every", "5", "--trace", str(tmp_path / "trace.jsonl")]

    def session(name, seconds):
        def runner(text, inputs):
            script = tmp_path / ("script-" + name + ".py")
            script.write_text(text)
            rc, out, root = run_session(str(tmp_path), str(script), name, seconds, inputs)
            return rc, out, os.path.join(root, "working")
        return runner

    r = onboxctl(env, *push)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["version"], doc["kernel"], doc["continuing"], doc["resumes_from"]) == (1, REF, False, None)
    saved = kaggle.newest(REF)["request"]
    assert saved["enableGpu"] is True and saved["machineShape"] == "NvidiaTeslaT4" and saved["kernelType"] == "script"
    assert saved.get("kernelDataSources", []) == [] and saved["newTitle"] == "onbox chain" and saved["isPrivate"] is True
    assert all(c["user"] == "tester" for c in kaggle.calls)  # the key travelled in the auth header, from kaggle.json

    st = onboxctl(env, "kaggle", "status", "chain", "--json")
    assert st.returncode == 0 and json.loads(st.stdout)["state"] == "queued", st.stdout + st.stderr
    again = onboxctl(env, *push)
    assert again.returncode == 2 and "is queued on Kaggle" in again.stderr, again.stdout + again.stderr
    assert len(kaggle.kernels[REF]) == 1  # refused before anything was pushed

    t0 = time.time()
    v1 = kaggle.run_newest(REF, session("s1", 10))
    assert v1["status"] == "COMPLETE", v1["log"][-2000:]  # stopped by its clock: the kernel succeeds
    assert time.time() - t0 < 10 + 5, "the first session outlived its clock"
    first = outcome(v1["output"])
    assert (first["outcome"], first["exit_code"], first["last_exit"]["classification"]) == (
        "session_limit", 75, "session_limit")
    st = json.loads(onboxctl(env, "kaggle", "status", "chain", "--json").stdout)
    assert st["state"] == "complete" and st["onbox"]["outcome"] == "session_limit"
    assert st["next"].startswith("push again to continue")
    stopped_at = max(committed(os.path.dirname(v1["output"]), "chain").values())

    r = onboxctl(env, *push)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert (doc["version"], doc["continuing"], doc["resumes_from"]) == (2, True, "previous_output")
    assert kaggle.newest(REF)["request"]["kernelDataSources"] == [REF]  # the previous output, mounted

    v2 = kaggle.run_newest(REF, session("s2", 45))
    assert v2["status"] == "COMPLETE", v2["log"][-2000:]
    second = outcome(v2["output"])
    assert second["outcome"] == "done" and second["seed"]["seeded"] and second["seed"]["step"] == stopped_at
    mounted = os.path.join(os.path.dirname(v2["output"]), "input", "onbox-chain")
    assert second["seed"]["from"] == os.path.join(mounted, "onbox-durable", "chain")
    assert tree(mounted) == tree(v1["output"])  # the read-only input was only read
    assert max(committed(os.path.dirname(v2["output"]), "chain").values()) == STEPS  # in the output too
    text = onboxctl(env, "kaggle", "status", "chain")
    assert text.returncode == 0 and "complete; onbox: done (exit 0)" in text.stdout, text.stdout + text.stderr
    logs = onboxctl(env, "kaggle", "logs", "chain")
    assert "copied run chain from the previous output" in logs.stdout, logs.stdout + logs.stderr
    starts = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines() if "start" in line]
    assert [s["start"] for s in starts] == [0, stopped_at]  # the second began where the first's commit ended
    assert os.path.basename(starts[1]["resume"]) in committed(os.path.dirname(v1["output"]), "chain")

    pulled = onboxctl(env, "kaggle", "pull", "chain", str(tmp_path / "home"), "--json")
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    report = json.loads(pulled.stdout)
    assert report["ok"] and report["box"] == "kaggle:tester" and len(report["checkpoints"]) >= 1
    newest = max(report["checkpoints"], key=lambda c: c["step"])
    assert newest["step"] == STEPS and newest["name"] == report["newest"] and "against MANIFEST.json" in newest["checked"]
    with open(tmp_path / "cfg" / "pulls.json") as f:
        record = json.load(f)["pulls"]["kaggle:tester/chain"]["checkpoints"]
    assert record[report["newest"]]["ok"] is True
    assert os.path.isfile(tmp_path / "home" / "chain" / "onbox-kaggle.json")
    assert not [n for n in os.listdir(tmp_path / "home") if n.startswith(".onbox-kaggle")]  # no staging left
