"""One Kaggle-shaped session on this machine, for a kernel's script: what Kaggle gives a kernel, shrunk.

A fresh PID namespace (PID 1 starts with the session: what the kaggle profile counts its [session] hours from), a
temp root (ONBOX_KAGGLE_ROOT) with `input/`, `working/` and `temp/`, each kernel source's output copied under
`input/<slug>` and bind-mounted read-only in the session's own mount namespace (read-only even for root, as Kaggle
mounts inputs), KAGGLE_KERNEL_RUN_TYPE=Batch, and the profile's session hours shrunk to `seconds` by a user profile in
the session's ONBOX_HOME. The script runs with the system's python3, which has no onbox installed: as on Kaggle, the
script must stand alone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Dict, Optional, Tuple

import pytest

from tests.processes import kill_test_processes

SYSTEM_PYTHON = "/usr/bin/python3"
# a grace, margin, quiet period and sync interval of seconds: the session's stop fits in a session of seconds
KNOBS = {"ONBOX_GRACE": "2", "ONBOX_DEADLINE_MARGIN": "1", "ONBOX_SETTLE_SECONDS": "0.3",
         "ONBOX_SYNC_INTERVAL": "0.5", "ONBOX_TICK_INTERVAL": "0.1", "KAGGLE_KERNEL_RUN_TYPE": "Batch"}


def need_namespaces() -> None:
    """Skip (saying what is missing) where a Kaggle-shaped session cannot be made."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("needs root, unshare (util-linux) and %s for a Kaggle-shaped session" % SYSTEM_PYTHON)
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip("this machine cannot make a PID namespace: %s" % probe.stderr.decode()[-200:])


def run_session(base: str, script: str, name: str, seconds: float,
                inputs: Optional[Dict[str, str]] = None) -> Tuple[int, str, str]:
    """Run `script` as one session under base/name; returns (exit code, its output, its root)."""
    root = os.path.join(base, name)
    for d in ("input", "working", "temp"):
        os.makedirs(os.path.join(root, d))
    home = os.path.join(base, "home-" + name)
    os.makedirs(os.path.join(home, "profiles"))
    with open(os.path.join(home, "profiles", "kaggle.toml"), "w") as f:
        f.write("[session]\nhours = %r\n" % (seconds / 3600.0))
    mount_ro = ""
    for slug, output in sorted((inputs or {}).items()):
        shutil.copytree(output, os.path.join(root, "input", slug))
        mount_ro = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && '
    env = dict(os.environ, ONBOX_KAGGLE_ROOT=root, ONBOX_HOME=home, **KNOBS)
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", mount_ro + 'exec "$2" "$3"', "sh",
            os.path.join(root, "input"), SYSTEM_PYTHON, script]
    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    finally:
        kill_test_processes(home, settle=0.0)
    return r.returncode, r.stdout + r.stderr, root


def committed(root: str, run: str) -> Dict[str, int]:
    """{checkpoint name: step} of what a session left committed in its output."""
    import json

    out = {}
    ckpts = os.path.join(root, "working", "onbox-durable", run, "checkpoints")
    for name in sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else []:
        manifest = os.path.join(ckpts, name, "MANIFEST.json")
        if os.path.isfile(manifest):
            with open(manifest) as f:
                out[name] = json.load(f)["step"]
    return out
