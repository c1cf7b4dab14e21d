"""onbox.pyz, built once per session: runs under every pyenv CPython 3.8-3.13, rebuilds byte-identically, copes
with a read-only $HOME and a noexec extraction root, cleans old extractions; the aarch64 file holds aarch64 code."""
from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile

import pytest

from tests.integration.conftest import build_zipapps

pytestmark = pytest.mark.integration

VERSIONS = ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13"]
EM_X86_64, EM_AARCH64 = 62, 183


@pytest.fixture(scope="session")
def pyz(dist):
    return str(dist / "onbox.pyz")


def pyenv_pythons():
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = {}
    for exe in sorted(glob.glob(os.path.join(root, "versions", "*", "bin", "python3"))):
        ver = os.path.basename(os.path.dirname(os.path.dirname(exe)))
        found.setdefault(".".join(ver.split(".")[:2]), exe)
    return found


def clean_env(tmp_path, **extra):
    """A box-like environment: no venv, no PYTHONPATH, a private HOME and extraction root."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path / "home"),
           "ONBOX_HOME": str(tmp_path / "onbox-home")}
    os.makedirs(env["HOME"], exist_ok=True)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_pyz(python, pyz, args, env, timeout=120):
    return subprocess.run([python, pyz, *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("version", VERSIONS)
def test_runs_under_each_pyenv_python(version, pyz, tmp_path):
    python = pyenv_pythons().get(version)
    if python is None:
        pytest.skip("no pyenv CPython %s on this machine (looked in $(pyenv root)/versions)" % version)
    env = clean_env(tmp_path, SHIV_ROOT=tmp_path / "shiv")
    r = run_pyz(python, pyz, ["--version"], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("onbox, version ")
    r = run_pyz(python, pyz, ["audit", "--json", "--profile", "local", "--min-free-gb", "0",
                              "--ckpt-dir", str(tmp_path / "ckpt")], env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    py = {c["name"]: c for c in doc["checks"]}["python"]
    assert py["data"]["version"].startswith(version + ".")
    assert doc["fit"] is True
    # TOML profiles from inside the pyz (tomli below 3.11, tomllib above)
    r = run_pyz(python, pyz, ["profiles", "show", "china/gpushare", "--json"], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["paths"]["fast"] == "/hy-tmp"


def test_two_builds_are_byte_identical(dist, wheel_cache, tmp_path):
    again = build_zipapps(tmp_path / "again", wheel_cache)
    for name in ("onbox.pyz", "onbox-aarch64.pyz"):
        with open(str(dist / name), "rb") as a, open(str(again / name), "rb") as b:
            assert a.read() == b.read(), name


def _elf_machine(data):
    assert data[:4] == b"\x7fELF"
    return struct.unpack("<H", data[18:20])[0]


@pytest.mark.parametrize("name,machine", [("onbox-aarch64.pyz", EM_AARCH64), ("onbox.pyz", EM_X86_64)])
def test_native_code_matches_the_target_arch(dist, name, machine):
    with zipfile.ZipFile(str(dist / name)) as zf:
        names = zf.namelist()
        libs = [n for n in names if n.endswith(".so")]
        assert any("psutil/_psutil_linux" in n for n in libs), libs
        assert {_elf_machine(zf.read(n)) for n in libs} == {machine}
        assert "site-packages/tomli/__init__.py" in names  # needed below 3.11, shipped unconditionally
        assert "site-packages/onbox/_profiles/slurm.toml" in names
        assert not [n for n in names if n.endswith(".pyc")]


def test_size_is_a_few_megabytes(pyz):
    assert os.path.getsize(pyz) <= 5 * 1024 * 1024


def _need_mounts():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a read-only / noexec tmpfs in a private mount namespace")


def _in_mount_ns(mount_cmds, argv, env, timeout=120):
    """Run argv in a private mount namespace after `mount_cmds` (so nothing leaks to the host)."""
    script = " && ".join(mount_cmds) + ' && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_read_only_home_falls_back_with_one_line(pyz, tmp_path):
    _need_mounts()
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    env = clean_env(tmp_path, XDG_RUNTIME_DIR=xdg)
    home = env["HOME"]
    r = _in_mount_ns(["mount -t tmpfs -o ro tmpfs %s" % home],
                     [sys.executable, pyz, "audit", "--json", "--profile", "local", "--min-free-gb", "0",
                      "--ckpt-dir", str(tmp_path / "ckpt")], env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["onbox: %s/.shiv is not usable (Read-only file system); extracting to "
                                     "%s/onbox-shiv (set SHIV_ROOT to choose)" % (home, xdg)]
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["disk.extract"]["data"]["path"] == str(xdg / "onbox-shiv")
    assert checks["disk.home"]["verdict"] == "warn" and checks["disk.home"]["data"]["writable"] is False
    assert glob.glob(str(xdg / "onbox-shiv" / "onbox.pyz_*" / "site-packages" / "psutil"))


def test_noexec_extraction_root_falls_back(pyz, tmp_path):
    _need_mounts()
    noexec = tmp_path / "noexec"
    noexec.mkdir()
    env = clean_env(tmp_path, SHIV_ROOT=noexec)
    # psutil's native library must load from wherever it was extracted: import it through the pyz's python
    r = _in_mount_ns(["mount -t tmpfs -o noexec tmpfs %s" % noexec],
                     [sys.executable, pyz, "--version"], env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["onbox: %s is not usable (mounted noexec); extracting to %s/.shiv (set "
                                     "SHIV_ROOT to choose)" % (noexec, env["HOME"])]
    extracted = glob.glob(os.path.join(env["HOME"], ".shiv", "onbox.pyz_*", "site-packages", "psutil",
                                       "_psutil_linux*.so"))
    assert extracted
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import psutil; "
                            "print(psutil.cpu_count())", os.path.dirname(os.path.dirname(extracted[0]))],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr


def _fake_extraction(root, name, onbox=True):
    sp = root / name / "site-packages"
    (sp / ("onbox" if onbox else "other")).mkdir(parents=True)
    (sp / ("onbox" if onbox else "other") / "__init__.py").write_text("")
    return root / name


def test_old_extractions_are_removed_unless_in_use(pyz, tmp_path):
    shiv_root = tmp_path / "shiv"
    shiv_root.mkdir()
    old = _fake_extraction(shiv_root, "onbox.pyz_" + "a" * 64)
    busy = _fake_extraction(shiv_root, "onbox-old.pyz_" + "b" * 64)
    foreign = _fake_extraction(shiv_root, "tool.pyz_" + "c" * 64, onbox=False)
    fd = os.open(str(busy / ".onbox-inuse"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a running agent of that build holds it
    try:
        r = run_pyz(sys.executable, pyz, ["--version"], clean_env(tmp_path, SHIV_ROOT=shiv_root))
    finally:
        os.close(fd)
    assert r.returncode == 0, r.stderr
    assert not old.exists()
    assert busy.exists() and foreign.exists()
    current = [p for p in os.listdir(str(shiv_root)) if p.startswith("onbox.pyz_") and not p.endswith("a" * 64)]
    assert len(current) == 1


@pytest.mark.parametrize("version", ["3.6", "3.7"])
def test_too_old_python_gets_one_clear_line(version, pyz, tmp_path):
    python = pyenv_pythons().get(version)
    if python is None:
        pytest.skip("no pyenv CPython %s on this machine" % version)
    r = run_pyz(python, pyz, ["--version"], clean_env(tmp_path, SHIV_ROOT=tmp_path / "shiv"))
    assert r.returncode == 3
    assert r.stderr.startswith("onbox: needs Python 3.8 or newer, not %s." % version)


def test_warm_start_cleans_too_and_caches_bytecode(pyz, tmp_path):
    """The second start takes extractroot.start()'s direct path: it must also clean up and write bytecode caches
    into its private extraction even under PYTHONDONTWRITEBYTECODE (set by many container images)."""
    shiv_root = tmp_path / "shiv"
    env = clean_env(tmp_path, SHIV_ROOT=shiv_root, PYTHONDONTWRITEBYTECODE="1")
    assert run_pyz(sys.executable, pyz, ["--version"], env).returncode == 0  # first start: shiv extracts
    old = _fake_extraction(shiv_root, "onbox.pyz_" + "d" * 64)
    r = run_pyz(sys.executable, pyz, ["--version"], env)  # warm start
    assert r.returncode == 0 and r.stdout.startswith("onbox, version"), r.stderr
    assert not old.exists()
    assert glob.glob(str(shiv_root / "onbox.pyz_*" / "site-packages" / "click" / "__pycache__" / "core.*.pyc"))
    # a shiv override still goes through shiv's own bootstrap
    r = run_pyz(sys.executable, pyz, ["--version"], dict(env, SHIV_FORCE_EXTRACT="1"))
    assert r.returncode == 0 and r.stdout.startswith("onbox, version"), r.stderr


IMPORT_ALL = """
import importlib, pkgutil, sys
import onbox
bad = []
for m in pkgutil.walk_packages(onbox.__path__, "onbox."):
    try:
        importlib.import_module(m.name)
    except Exception as e:
        bad.append("%s: %s: %s" % (m.name, type(e).__name__, e))
print("\\n".join(bad) or "ok %d" % len([m for m in pkgutil.walk_packages(onbox.__path__, "onbox.")]))
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("version", VERSIONS)
def test_every_onbox_module_imports_under_each_pyenv_python(version, pyz, tmp_path):
    # --version and audit import a handful of modules; a 3.9+ construct in the supervisor, the committer or the
    # heartbeat (a runtime `list[int]`, str.removeprefix at import) would only blow up on the box, mid-run
    python = pyenv_pythons().get(version)
    if python is None:
        pytest.skip("no pyenv CPython %s on this machine (looked in $(pyenv root)/versions)" % version)
    script = tmp_path / "import_all.py"
    script.write_text(IMPORT_ALL)
    env = clean_env(tmp_path, SHIV_ROOT=tmp_path / "shiv", SHIV_INTERPRETER="1")
    r = run_pyz(python, pyz, [str(script)], env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok ")


def test_the_oldest_python_runs_a_job_and_reads_its_checkpoints(pyz, tmp_path):
    # the code paths a user hits on a box with only python3.8: a foreground run that saves a checkpoint and has
    # it committed, then checkpoints/verify/gpu/reap/status with --json
    python = pyenv_pythons().get("3.8")
    if python is None:
        pytest.skip("no pyenv CPython 3.8 on this machine")
    env = clean_env(tmp_path, SHIV_ROOT=tmp_path / "shiv", ONBOX_NOTICE_SOURCE="none", ONBOX_TICK_INTERVAL="0.05")
    ck, dur = tmp_path / "ck", tmp_path / "dur"
    job = ("import json, os, struct; h = json.dumps({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}})"
           ".encode(); open(os.path.join(os.environ['ONBOX_CKPT_DIR'], 'step_10.safetensors'), 'wb').write("
           "struct.pack('<Q', len(h)) + h + bytes(8)); print('step 10: loss 1.5', flush=True)")
    r = run_pyz(python, pyz, ["run", "--foreground", "--name", "old", "--ckpt-dir", str(ck), "--durable", str(dur),
                              "--", python, "-c", job], env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_pyz(python, pyz, ["checkpoints", "old", "--json"], env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(c["name"], c["verified"]) for c in doc["committed"]] == [("step_10.safetensors", True)]
    r = run_pyz(python, pyz, ["verify", str(dur / "old" / "checkpoints" / "step_10.safetensors"), "--json"], env)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True, r.stdout + r.stderr
    for args in (["gpu", "--json"], ["reap", "--json"], ["status", "old", "--json"], ["ls", "--json"]):
        r = run_pyz(python, pyz, args, env)
        assert r.returncode == 0, (args, r.stderr)
        json.loads(r.stdout)


INIT_PROBE = r"""
import os, sys
d = sys.argv[1]
sys.path.insert(0, d)
import onbox_trainkit as kit   # the shared code of every template, on the oldest Python a box may have
cfg = kit.read_flat_yaml(os.path.join(d, "training_config.yaml"))
assert cfg["optimizer.betas"] == [0.9, 0.95] and cfg["train.min_lr"] == 4e-05, cfg
assert abs(kit.lr_at(25, 1.0, 50, 100, 0.0) - 0.5) < 1e-12
print("ok")
"""


def test_onbox_init_from_the_pyz_under_python38(pyz, tmp_path):
    """The templates are package data inside onbox.pyz: `onbox init` writes them under the oldest supported
    Python, byte for byte what the checkout has, and what it writes is Python 3.8 code."""
    python = pyenv_pythons().get("3.8")
    if python is None:
        pytest.skip("no pyenv CPython 3.8 on this machine (looked in $(pyenv root)/versions)")
    from onbox.templates import KINDS, render

    env = clean_env(tmp_path, SHIV_ROOT=tmp_path / "shiv")
    for kind in KINDS:
        dest = tmp_path / kind
        r = run_pyz(python, pyz, ["init", kind, str(dest), "--name", "r-" + kind], env)
        assert r.returncode == 0, r.stderr
        want = render(kind, "r-" + kind)
        assert {fn: (dest / fn).read_bytes() for fn in os.listdir(str(dest))} == want
        assert os.access(str(dest / "train.sh"), os.X_OK)
        r = subprocess.run([python, "-m", "py_compile", str(dest / "train.py"), str(dest / "onbox_trainkit.py")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([python, "-c", INIT_PROBE, str(tmp_path / "litgpt")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
