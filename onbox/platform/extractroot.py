"""Where onbox.pyz extracts itself (shiv's SHIV_ROOT), chosen deliberately BEFORE shiv's bootstrap runs.

shiv extracts site-packages to ~/.shiv/<pyz-name>_<build-id>/ on first start. That breaks on rented boxes:
$HOME can be read-only (some container images, NFS homes), and a noexec mount (a hardened /tmp) makes the
native libraries (psutil's .so) fail to load. So the pyz's __main__.py runs `prepare()` first: it walks
$SHIV_ROOT (when the user set one), ~/.shiv, $XDG_RUNTIME_DIR/onbox-shiv, /tmp/onbox-shiv-<uid>,
/dev/shm/onbox-shiv-<uid>, takes the first writable, exec-capable one, exports it as SHIV_ROOT (children that run
the pyz again agree), and prints one line when it had to fall back. When this build is already extracted
there, `start()` runs onbox directly (a warm start); otherwise shiv's bootstrap extracts and its preamble calls
`hold_and_clean()`: this process holds a shared lock on its extraction while it runs, and extractions of other
onbox builds that nobody holds are removed (they otherwise pile up, one per version).

Stdlib only and no onbox imports: build/zipapp.py embeds this file's source in the pyz's __main__.py, where the
onbox package is not importable yet. Runs on CPython 3.8-3.13.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional, Tuple

INUSE_FILE = ".onbox-inuse"
HEX = frozenset("0123456789abcdef")
_held_fds: List[int] = []  # shared locks on our own extraction, held for the life of the process


def candidate_roots(environ: Mapping[str, str], uid: Optional[int] = None) -> List[Tuple[str, bool]]:
    """(path, private) in order of preference; `private` dirs are ours to create with mode 0700."""
    uid = os.getuid() if uid is None else uid
    out: List[Tuple[str, bool]] = []
    if environ.get("SHIV_ROOT"):
        out.append((os.path.expanduser(environ["SHIV_ROOT"]), False))
    home = environ.get("HOME") or os.path.expanduser("~")
    if home and home != "~":
        out.append((os.path.join(home, ".shiv"), False))
    if environ.get("XDG_RUNTIME_DIR"):
        out.append((os.path.join(environ["XDG_RUNTIME_DIR"], "onbox-shiv"), True))
    out.append(("/tmp/onbox-shiv-%d" % uid, True))
    out.append(("/dev/shm/onbox-shiv-%d" % uid, True))
    return out


def is_noexec(path: str) -> bool:
    """True when `path` sits on a filesystem mounted noexec (statvfs ST_NOEXEC): native libraries won't load."""
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_NOEXEC", 8))
    except OSError:
        return False


def unusable_reason(root: str, extraction: Optional[str] = None, private: bool = False) -> Optional[str]:
    """Why `root` cannot hold an extraction (None when it can). Creates `root` if needed."""
    if extraction and os.path.isdir(os.path.join(root, extraction, "site-packages")):
        # Already extracted: reading is enough (a root made read-only after the first start still works).
        return "mounted noexec" if is_noexec(root) else None
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    if private:
        st = os.lstat(root)
        if not os.path.isdir(root) or os.path.islink(root) or st.st_uid != os.getuid():
            return "not a directory owned by uid %d" % os.getuid()  # a shared /tmp: never trust another's dir
    if is_noexec(root):
        return "mounted noexec"
    import tempfile  # start-up cost matters here (issue 2 benchmark): import only when probing

    try:  # access(2) lies on read-only mounts and for root: really create a file
        fd, probe = tempfile.mkstemp(prefix=".onbox-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def choose_root(environ: Mapping[str, str], extraction: Optional[str] = None
                ) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """(chosen root or None, [(rejected root, why), ...])."""
    rejected: List[Tuple[str, str]] = []
    for root, private in candidate_roots(environ):
        why = unusable_reason(root, extraction, private)
        if why is None:
            return root, rejected
        rejected.append((root, why))
    return None, rejected


def is_extraction_name(name: str) -> bool:
    """shiv names an extraction <pyz file name>_<64 hex build id> (no regex: this runs at every start)."""
    return len(name) > 65 and name[-65] == "_" and set(name[-64:]) <= HEX


def extraction_name(archive: str, build_id: str) -> str:
    """shiv's extraction dir name: <resolved pyz file name>_<build id>."""
    return "%s_%s" % (os.path.basename(os.path.realpath(archive)), build_id)


def prepare(extraction: str, environ: Optional[Dict[str, str]] = None) -> str:
    """Pick the extraction root, export it as SHIV_ROOT and return it; exit 3 with one line when none is usable."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    root, rejected = choose_root(environ, extraction)  # type: ignore[arg-type]
    if root is None:
        sys.stderr.write("onbox: no usable extraction root (%s)\nhint: set SHIV_ROOT to a writable directory on "
                         "a filesystem not mounted noexec\n" % "; ".join("%s: %s" % r for r in rejected))
        sys.exit(3)
    environ["SHIV_ROOT"] = root  # type: ignore[index]
    if rejected and not os.path.isdir(os.path.join(root, extraction)):
        first, why = rejected[0]
        sys.stderr.write("onbox: %s is not usable (%s); extracting to %s (set SHIV_ROOT to choose)\n"
                         % (first, why, root))
    return root


# Variables that change what shiv's bootstrap does: with any of them set, shiv handles the start.
SHIV_OVERRIDES = ("SHIV_FORCE_EXTRACT", "SHIV_COMPILE_PYC", "SHIV_COMPILE_WORKERS", "SHIV_EXTEND_PYTHONPATH",
                  "SHIV_PREPEND_PYTHONPATH", "SHIV_INTERPRETER", "SHIV_ENTRY_POINT", "SHIV_CONSOLE_SCRIPT",
                  "SHIV_MODULE")


def start(argv0: str, build_id: str, entry: str) -> None:
    """The pyz's first move: choose the root; when this build is already extracted there, start `entry` directly.

    Returns (to shiv's bootstrap) on a first start or when a SHIV_* override is set. The direct path does what
    shiv's bootstrap does for a warm start (site.addsitedir of the extraction, placed before other site dirs;
    the preamble's hold_and_clean) without its imports of subprocess, pathlib and compileall, which cost more
    than importing click itself (issue 2: warm `--version` <= 1.5x a bare `import click`).
    """
    extraction = extraction_name(argv0, build_id)
    root = prepare(extraction)
    site_packages = os.path.join(root, extraction, "site-packages")
    if any(os.environ.get(k) for k in SHIV_OVERRIDES) or not os.path.isdir(site_packages):
        return
    import site

    length = len(sys.path)
    index = next((i for i, p in enumerate(sys.path)
                  if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")), None) or length
    site.addsitedir(site_packages)
    sys.path = sys.path[:index] + sys.path[length:] + sys.path[index:length]  # as shiv orders it
    # Our own private extraction: write bytecode caches there even under PYTHONDONTWRITEBYTECODE (set by many
    # container images), or every start recompiles click from source.
    sys.dont_write_bytecode = False
    hold_and_clean(os.path.dirname(site_packages))
    import importlib

    module, _, attr = entry.partition(":")
    sys.exit(getattr(importlib.import_module(module), attr)())


def current_root() -> Optional[str]:
    """The extraction root this onbox runs from, or None when it runs from a source checkout."""
    # this file is <site-packages>/onbox/platform/extractroot.py
    sp = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    extraction = os.path.dirname(sp)
    if os.path.basename(sp) == "site-packages" and is_extraction_name(os.path.basename(extraction)):
        return os.path.dirname(extraction)
    return None


def _try_lock(path: str, exclusive: bool) -> Optional[int]:
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if exclusive else fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_onbox(extraction_dir: str) -> bool:
    return os.path.exists(os.path.join(extraction_dir, "site-packages", "onbox", "__init__.py"))


def hold_and_clean(current: str) -> List[str]:
    """Hold a shared lock on our extraction `current`; remove other onbox builds' extractions nobody holds.

    Returns the removed paths. Other shiv apps' extractions are never touched. A removal renames first, so a
    starting process of that build re-extracts instead of using a half-deleted tree.
    """
    fd = _try_lock(os.path.join(current, INUSE_FILE), exclusive=False)
    if fd is not None:
        _held_fds.append(fd)
    root = os.path.dirname(current)
    removed: List[str] = []
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return removed
    for entry in entries:
        path = os.path.join(root, entry)
        if path == current or not os.path.isdir(path):
            continue
        if entry.startswith(".onbox-deleting-"):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            continue
        stale_tmp = entry.endswith(".tmp") and is_extraction_name(entry[:-4])
        if not (is_extraction_name(entry) or stale_tmp) or not _is_onbox(path):
            continue
        name = entry[:-4] if stale_tmp else entry
        # shiv's own extraction lock (.<name>_lock) guards a running extraction; our in-use lock guards users.
        guard = os.path.join(root, ".%s_lock" % name) if stale_tmp else os.path.join(path, INUSE_FILE)
        lock = _try_lock(guard, exclusive=True)
        if lock is None:
            continue  # in use (or unlockable): keep it
        import shutil

        try:
            doomed = os.path.join(root, ".onbox-deleting-%s-%d" % (entry, os.getpid()))
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(path)
            if not stale_tmp:
                try:
                    os.unlink(os.path.join(root, ".%s_lock" % name))
                except OSError:
                    pass
        except OSError:
            pass
        finally:
            os.close(lock)
    return removed
