"""Builds the root filesystem of a small Docker image that runs Python, from Debian packages already installed on
this machine, for the tests that run container jobs against a real Docker daemon (tests/hosts/docker.py): the
image comes from `docker import` of this tar, so no registry is ever asked for one.

What goes in: every file of Debian's python3.11-minimal, libpython3.11-minimal and libpython3.11-stdlib (the
interpreter and its standard library, docs left out), the shared libraries `ldd` names for the interpreter and its
extension modules, the dynamic loader, and the /bin, /lib, /lib64, /sbin links of a merged-/usr system; plus
/usr/bin/python3 and an empty /tmp. About 37 MB; the tests' trainers need nothing beyond the standard library.

The tar is cached under build/out/docker-image/, named by a key over this file's text and the name, size and
mtime of every file that goes in: a changed recipe or an upgraded package builds a new one (in under a second),
and the older tars are removed.

usage: python build/python_image.py [--out DIR]
Prints one JSON line: {"tar": PATH, "tag": "onbox-test/python:<key>", "built": true|false, "bytes": N}.
Exit 3 (with a one-line reason) when a package or tool the recipe needs is missing.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from typing import Dict, Iterable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "out", "docker-image")
PACKAGES = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib")
PYTHON = "/usr/bin/python3.11"
SKIP_PREFIXES = ("/usr/share/doc/", "/usr/share/man/", "/usr/share/lintian/", "/usr/share/binfmts/",
                 "/usr/share/applications/", "/usr/share/pixmaps/")
MERGED_USR = ("bin", "lib", "lib64", "sbin")  # top-level links to usr/ on a merged-/usr Debian
IMAGE_PATH = "/usr/local/bin:/usr/bin:/bin"
TIMEOUT = 60.0


class Missing(Exception):
    """Something the recipe takes its files from is not on this machine."""


def _run(argv: List[str]) -> str:
    try:
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT)
    except FileNotFoundError:
        raise Missing("%s is not installed" % argv[0])
    if cp.returncode != 0:
        raise Missing("`%s` failed: %s" % (" ".join(argv), (cp.stderr.strip().splitlines() or ["exit %d"
                                                                                          % cp.returncode])[-1]))
    return cp.stdout


def package_files(packages: Iterable[str]) -> List[str]:
    """Every regular file and link the packages installed, docs and manuals left out."""
    out = []
    for pkg in packages:
        try:
            listing = _run(["dpkg-query", "-L", pkg])
        except Missing:
            raise Missing("Debian package %s is not installed (bash build/sysdeps.sh installs it)" % pkg)
        for path in listing.splitlines():
            if path.startswith("/") and not path.startswith(SKIP_PREFIXES) and (
                    os.path.islink(path) or os.path.isfile(path)):
                out.append(path)
    return out


def libraries(binaries: List[str]) -> List[str]:
    """The shared libraries (and the loader) `ldd` names for the binaries, as the paths it resolved."""
    text = _run(["ldd", *binaries])
    found = set()
    for line in text.splitlines():
        m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if m:
            found.add(m.group(1))
    return sorted(found)


def closure(paths: Iterable[str]) -> Dict[str, str]:
    """image path -> "file" or "link:<target>", for each path and every link on the way to its real file.
    Kept as the host has them, so the loader path baked into the binary (/lib64/ld-linux-x86-64.so.2) resolves."""
    entries: Dict[str, str] = {}
    for top in MERGED_USR:
        if os.path.islink("/" + top):
            entries["/" + top] = "link:" + os.readlink("/" + top)
    for path in paths:
        seen = 0
        while path not in entries and seen < 40:
            seen += 1
            parent = os.path.realpath(os.path.dirname(path))  # /lib/x -> /usr/lib/x on a merged-/usr system
            path = os.path.join(parent, os.path.basename(path))
            if os.path.islink(path):
                target = os.readlink(path)
                entries[path] = "link:" + target
                path = os.path.normpath(os.path.join(parent, target))
            elif os.path.isfile(path):
                entries[path] = "file"
            else:
                break
    entries.setdefault("/usr/bin/python3", "link:python3.11")
    return entries


def cache_key(entries: Dict[str, str]) -> str:
    h = hashlib.sha256()
    with open(os.path.abspath(__file__), "rb") as f:
        h.update(f.read())
    for path in sorted(entries):
        kind = entries[path]
        h.update(("%s\0%s\0" % (path, kind)).encode())
        if kind == "file":
            st = os.stat(path)
            h.update(("%d\0%d\0" % (st.st_size, st.st_mtime_ns)).encode())
    return h.hexdigest()[:16]


def write_tar(entries: Dict[str, str], dest: str) -> None:
    dirs = set()
    for path in entries:
        d = os.path.dirname(path)
        while d not in ("/", ""):
            dirs.add(d)
            d = os.path.dirname(d)
    tmp = dest + ".tmp-%d" % os.getpid()
    with tarfile.open(tmp, "w") as tar:
        modes = dict.fromkeys(dirs, 0o755)
        modes.update({"/tmp": 0o1777, "/root": 0o700, "/etc": 0o755})
        for d in sorted(modes):
            if d not in entries:  # /lib is a link, not a directory
                _add_dir(tar, d.lstrip("/"), modes[d])
        for path in sorted(entries):
            kind = entries[path]
            if kind == "file":
                tar.add(path, arcname=path.lstrip("/"), recursive=False, filter=_root_owned)
            else:
                info = tarfile.TarInfo(path.lstrip("/"))
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, kind[len("link:"):], 0o777
                tar.addfile(info)
        info = tarfile.TarInfo("etc/passwd")
        passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        info.size, info.mode = len(passwd), 0o644
        tar.addfile(info, io.BytesIO(passwd))
    os.replace(tmp, dest)


def _add_dir(tar: tarfile.TarFile, name: str, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def build(out_dir: str) -> Tuple[str, str, bool]:
    """(tar path, image tag, whether it was built now): the cached tar when the key matches."""
    files = package_files(PACKAGES)
    if not os.access(PYTHON, os.X_OK):
        raise Missing("%s is not installed (Debian's python3.11-minimal)" % PYTHON)
    dynload = sorted(glob.glob("/usr/lib/python3.11/lib-dynload/*.so"))
    entries = closure(files + libraries([PYTHON, *dynload]))
    key = cache_key(entries)
    os.makedirs(out_dir, exist_ok=True)
    dest = os.path.join(out_dir, "python-%s.tar" % key)
    built = not os.path.exists(dest)
    if built:
        write_tar(entries, dest)
        for old in glob.glob(os.path.join(out_dir, "python-*.tar")):
            if old != dest:
                os.unlink(old)
    return dest, "onbox-test/python:%s" % key, built


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="cache directory (default build/out/docker-image)")
    args = ap.parse_args(argv)
    try:
        tar, tag, built = build(args.out)
    except Missing as e:
        print("python_image: %s" % e, file=sys.stderr)
        return 3
    print(json.dumps({"tar": tar, "tag": tag, "built": built, "bytes": os.path.getsize(tar),
                      "path_env": IMAGE_PATH}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
