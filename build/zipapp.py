#!/usr/bin/env python3
"""Build onbox.pyz (Linux x86_64) and onbox-aarch64.pyz: shiv zipapps that run with any CPython 3.8-3.13.

    python build/zipapp.py --out dist [--arch x86_64 --arch aarch64] [--offline]

- Wheels are downloaded for the TARGET platform and the OLDEST supported Python (manylinux2014_<arch>, 3.8), never
  the build host's, pinned with hashes in build/pyz-requirements.txt, and cached in
  build/out/wheels/<arch>/ so rebuilds are offline and fast.
- Reproducible: wheels are unpacked (not pip-installed: no RECORD/INSTALLER/bin noise) into a staging
  site-packages with fixed file modes; the onbox package is copied the same way (a wheel would only be unpacked
  again), profiles/*.toml go in as package data onbox/_profiles/; shiv then writes entries sorted, stamped with
  SOURCE_DATE_EPOCH (the commit time of HEAD, or shiv's default outside git).
- The pyz's __main__.py embeds onbox/platform/extractroot.py: it picks the extraction root before shiv's bootstrap
  (read-only $HOME, noexec /tmp) and starts onbox directly when this build is already extracted (warm starts
  skip the bootstrap's heavy imports); on a first start shiv extracts and the preamble (build/preamble.py) holds
  the extraction and removes old ones.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
REQUIREMENTS = os.path.join(HERE, "pyz-requirements.txt")
PREAMBLE = os.path.join(HERE, "preamble.py")
ARCHES = {"x86_64": "onbox.pyz", "aarch64": "onbox-aarch64.pyz"}
TARGET_PYTHON = "3.8"
SHIV_VERSION = "1.0.8"
SHEBANG = "/usr/bin/env python3"
ENTRY_POINT = "onbox.cli:main"
DOWNLOAD_TIMEOUT = 600

MAIN_TEMPLATE = """\
# -*- coding: utf-8 -*-
# onbox.pyz entry point (build/zipapp.py): choose the extraction root, then hand over to shiv's bootstrap.
import sys
if sys.version_info < (3, 8):
    sys.stderr.write("onbox: needs Python 3.8 or newer, not %s (%s)\\n" % (sys.version.split()[0], sys.executable))
    sys.exit(3)
{extractroot}

start(sys.argv[0], "{build_id}", "{entry}")
import {{module}}
{{module}}.{{fn}}()
"""


def log(msg: str) -> None:
    print("zipapp: %s" % msg, flush=True)


def source_date_epoch() -> str:
    """SOURCE_DATE_EPOCH if set, else HEAD's commit time: two builds of one commit get the same timestamps."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return os.environ["SOURCE_DATE_EPOCH"]
    try:
        out = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%ct"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        if out.isdigit() and int(out) >= 315532800:  # zip timestamps start in 1980
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    return "315554400"  # shiv's own default


def requirements_digest() -> str:
    with open(REQUIREMENTS, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fetch_wheels(arch: str, cache: str, offline: bool) -> str:
    """Wheels for `arch` and Python 3.8 in cache/wheels/<arch>/, downloaded once per requirements file.
    Concurrent builds (pytest-xdist workers) serialise on a lock file."""
    import fcntl

    os.makedirs(os.path.join(cache, "wheels"), exist_ok=True)
    with open(os.path.join(cache, "wheels", ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch_wheels_locked(arch, cache, offline)


def _fetch_wheels_locked(arch: str, cache: str, offline: bool) -> str:
    dest = os.path.join(cache, "wheels", arch)
    stamp = os.path.join(dest, ".requirements.sha256")
    digest = requirements_digest()
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == digest:
                return dest
    if offline:
        raise SystemExit("zipapp: no cached wheels for %s in %s and --offline given" % (arch, dest))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    log("downloading wheels for manylinux2014_%s, CPython %s" % (arch, TARGET_PYTHON))
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                    "--only-binary=:all:", "--platform", "manylinux2014_%s" % arch,
                    "--python-version", TARGET_PYTHON, "--implementation", "cp", "--no-deps",
                    "--require-hashes", "-r", REQUIREMENTS, "-d", dest],
                   check=True, timeout=DOWNLOAD_TIMEOUT)
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    return dest


def _write(path: str, data: bytes, executable: bool = False) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o755 if executable else 0o644)  # fixed modes: the zip records them


def unpack_wheel(wheel: str, site: str) -> None:
    """Install a wheel by unpacking it (purelib/platlib data dirs merged; scripts, headers, data dropped)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            name = info.filename
            if name.endswith("/"):
                continue
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = "/".join(parts[2:])
            executable = bool((info.external_attr >> 16) & 0o111)
            _write(os.path.join(site, name), zf.read(info), executable)


def copy_onbox(site: str, version: str) -> None:
    """The onbox package (no caches), its profiles as package data, and a minimal dist-info."""
    src = os.path.join(REPO, "onbox")
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and d != "_profiles")
        for fn in sorted(filenames):
            if fn.endswith((".pyc", ".pyo")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), REPO)
            with open(os.path.join(dirpath, fn), "rb") as f:
                _write(os.path.join(site, rel), f.read())
    profiles = os.path.join(REPO, "profiles")
    for fn in sorted(os.listdir(profiles)):
        if fn.endswith(".toml"):
            with open(os.path.join(profiles, fn), "rb") as f:
                _write(os.path.join(site, "onbox", "_profiles", fn), f.read())
    info = os.path.join(site, "onbox-%s.dist-info" % version)
    _write(os.path.join(info, "METADATA"),
           ("Metadata-Version: 2.1\nName: onbox\nVersion: %s\nRequires-Python: >=3.8\n" % version).encode())
    _write(os.path.join(info, "entry_points.txt"), b"[console_scripts]\nonbox = onbox.cli:main\n")
    _write(os.path.join(info, "top_level.txt"), b"onbox\n")


def onbox_version() -> str:
    ns: dict = {}
    with open(os.path.join(REPO, "onbox", "__init__.py")) as f:
        exec(f.read(), ns)
    return str(ns["__version__"])


def stage(arch: str, wheels: str, work: str) -> str:
    site = os.path.join(work, "stage-%s" % arch, "site-packages")
    shutil.rmtree(os.path.dirname(site), ignore_errors=True)
    os.makedirs(site)
    for wheel in sorted(os.listdir(wheels)):
        if wheel.endswith(".whl"):
            unpack_wheel(os.path.join(wheels, wheel), site)
    copy_onbox(site, onbox_version())
    return site


def content_id(site: str, preamble: str) -> str:
    """The build id: a hash of every shipped file and its path (what shiv computes, made explicit so that
    __main__.py can know its extraction's name without opening the zip)."""
    h = hashlib.sha256()
    files = []
    for dirpath, dirnames, filenames in os.walk(site):
        dirnames.sort()
        files.extend(os.path.join(dirpath, f) for f in filenames)
    for path in [*sorted(files, key=lambda p: os.path.relpath(p, site)), preamble]:
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(os.path.relpath(path, site).encode() if path != preamble else b"bin/preamble.py")
    return h.hexdigest()


def main_template(build_id: str) -> str:
    with open(os.path.join(REPO, "onbox", "platform", "extractroot.py"), encoding="utf-8") as f:
        source = f.read()
    # Without its __future__ import the module also compiles on old Pythons, which then get the message above.
    source = source.replace("from __future__ import annotations\n", "", 1)
    return MAIN_TEMPLATE.format(extractroot=source.replace("{", "{{").replace("}", "}}"), build_id=build_id,
                                entry=ENTRY_POINT)


def run_shiv(site: str, preamble: str, output: str, epoch: str) -> None:
    """shiv, in process, with our __main__.py template (the root must be chosen BEFORE its bootstrap runs;
    shiv's --preamble runs only after extraction)."""
    import shiv
    from shiv import builder
    from shiv import cli as shiv_cli

    if shiv.__version__ != SHIV_VERSION:
        raise SystemExit("zipapp: shiv %s is required (found %s): pip install shiv==%s"
                         % (SHIV_VERSION, shiv.__version__, SHIV_VERSION))
    build_id = content_id(site, preamble)
    builder.MAIN_TEMPLATE = main_template(build_id)  # type: ignore[attr-defined]
    os.environ["SOURCE_DATE_EPOCH"] = epoch
    out = io.StringIO()
    try:
        # --build-id: shiv warns that a custom id must be unique per build; ours is the content hash, so it is.
        with contextlib.redirect_stdout(out):
            shiv_cli.main.main(args=["--site-packages", site, "--entry-point", ENTRY_POINT, "--build-id", build_id,
                                     "--output-file", output, "--python", SHEBANG, "--reproducible",
                                     "--compressed", "--preamble", preamble], standalone_mode=False)
    except SystemExit as e:  # shiv exits with a message string on bad input
        if e.code not in (None, 0):
            raise
    finally:
        for line in out.getvalue().splitlines():
            if "overridden the default build-id" not in line:
                print(line)


def build(out: str, arches: List[str], cache: str, offline: bool) -> List[str]:
    epoch = source_date_epoch()
    os.makedirs(out, exist_ok=True)
    os.makedirs(cache, exist_ok=True)
    work = tempfile.mkdtemp(prefix="work-", dir=cache)  # per build: parallel builds don't share staging
    try:
        preamble = os.path.join(work, "preamble.py")
        with open(PREAMBLE, "rb") as f:
            _write(preamble, f.read())
        built = []
        for arch in arches:
            wheels = fetch_wheels(arch, cache, offline)
            site = stage(arch, wheels, work)
            target = os.path.join(out, ARCHES[arch])
            tmp = "%s.part-%d" % (target, os.getpid())
            run_shiv(site, preamble, tmp, epoch)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
            with open(target, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            log("built %s (%d bytes, sha256 %s)" % (target, os.path.getsize(target), digest[:16]))
            built.append(target)
        return built
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, "dist"), help="output directory (default: dist)")
    p.add_argument("--arch", action="append", choices=sorted(ARCHES), help="build only this arch (repeatable)")
    p.add_argument("--cache", default=os.path.join(HERE, "out"), help="wheel cache and staging (build/out)")
    p.add_argument("--offline", action="store_true", help="fail instead of downloading missing wheels")
    args = p.parse_args(argv)
    build(os.path.abspath(args.out), args.arch or sorted(ARCHES, reverse=True), os.path.abspath(args.cache),
          args.offline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
