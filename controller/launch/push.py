"""Push onbox.pyz and the user's code to a box, then prove that what landed is what was pushed (U42).

Remote layout (relative to the login directory; the box's own python runs the pyz):
    .onbox/onbox.pyz          the agent (copied only when its sha256 differs)
    .onbox/code/<name>/       the code dir, rsynced with the user's .gitignore honoured
    .onbox/pushed.json        what the last push put there: pyz hash, code dir, time (launch cds into `code`)
    .onbox/secrets/<NAME>     secrets, mode 0600 in a 0700 dir, written from stdin (U34)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import subprocess
import tempfile
import threading
import time
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from controller.boxes.agent import REMOTE_CODE, REMOTE_PUSHED, REMOTE_PYZ, REMOTE_ROOT, REMOTE_SECRETS
from controller.boxes.inventory import Box
from controller.boxes.ssh import RSYNC_MISSING, RemoteCommandFailed, Ssh, rsync_lost_link
from controller.boxes.sshfail import unreachable
from controller.launch.secretfiles import Selection
from onbox.environment import Environment
from onbox.errors import JobFailed, UsageError
from onbox.toolrun import Says, Tool

SECRET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# sha256 of a remote file, or nothing when it is missing. Not an `onbox` command: before the first push there is
# no pyz, and after a copy the bytes that landed must not vouch for themselves (a torn zip may not even start;
# U42). coreutils' or busybox's sha256sum; one missing or failing ends the call with its own message (the Python
# fallback this replaced never ran: a pipeline's status is cut's, so a missing sha256sum read as "no pyz").
_REMOTE_SHA = 'f=%s; if [ -f "$f" ]; then h=$(sha256sum -- "$f") || exit; echo "${h%%%% *}"; fi'


@dataclasses.dataclass
class PushReport:
    box: str
    pyz_sha256: str
    pyz_copied: bool
    remote_version: str
    code_dir: Optional[str] = None
    code_files_changed: int = 0
    seconds: float = 0.0
    steps: List[str] = dataclasses.field(default_factory=list)
    secrets_left_out: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    secrets_included: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    # the dirs of --code that `onboxctl pull` brought home (its pulls record), relative to --code: never sent
    pulled_left_out: List[str] = dataclasses.field(default_factory=list)
    warnings: List[str] = dataclasses.field(default_factory=list)  # what was left out, in words, for stderr

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_pyz() -> str:
    """dist/onbox.pyz of this checkout, or $ONBOX_PYZ."""
    env = Environment.read().pyz
    if env:
        return env
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(repo, "dist", "onbox.pyz")


def code_filter_args(code_dir: str, excludes: Optional[Sequence[str]] = None) -> List[str]:
    """rsync filters: the secret-looking paths left out (`excludes`, as code_selection made them; None: made now,
    with none included), first so that no .gitignore rule can bring them back, then the user's .gitignore files
    (per directory)."""
    if excludes is None:
        excludes = code_selection(code_dir)[1]
    return [*excludes, "--filter=:- .gitignore"]


RSYNC_LIST = Tool("rsync", JobFailed, missing=RSYNC_MISSING,
                  timed_out=Says("listing the code dir with rsync did not finish within {timeout:.0f} s",
                                 "is --code a directory of millions of files? give the code's own directory"),
                  failed=Says("listing the code dir with rsync failed (exit {rc}): {stderr}", "check --code"))
_RSYNC_ESCAPE = re.compile(rb"\\#([0-7]{3})")


def _rsync_pattern(rel: str) -> str:
    """An rsync filter pattern matching exactly `rel` from the transfer's root: rsync reads `*`, `?` and `[` as
    wildcards, and then a backslash as an escape; without them, the pattern is taken literally."""
    if any(c in rel for c in "*?["):
        rel = re.sub(r"([\\*?\[])", r"\\\1", rel)
    return "/" + rel


def code_selection(code_dir: str, include: Sequence[str] = (), timeout: float = 120.0) -> Tuple[Selection, List[str]]:
    """What of `code_dir` a push sends, as rsync itself lists it (.gitignore honoured), with its secret-looking
    paths (controller/launch/secretfiles.py) left out unless `include`d: the Selection (what was left out and why), and
    the --exclude rules that leave them out (anchored, escaped)."""
    src = os.path.abspath(code_dir).rstrip("/") + "/"
    sel = Selection(code_dir, include)
    with tempfile.TemporaryDirectory(prefix="onbox-list-") as empty:
        # a dry run into a directory that does not exist: rsync names every entry it would send, in order, a
        # directory before what is in it; `%i` says what each is (d, f, L for a symlink: sent as a link)
        done = RSYNC_LIST.run(["rsync", "-a", "--dry-run", "--out-format=%i %n", "--filter=:- .gitignore", src,
                               os.path.join(empty, "none") + "/"], timeout, stdin=subprocess.DEVNULL, binary=True)
    pruned: List[str] = []
    for line in done.stdout.split(b"\n"):
        item, _, raw = line.partition(b" ")
        if len(item) < 2 or not raw:
            continue
        rel = os.fsdecode(_RSYNC_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), raw)).rstrip("/")
        if rel in ("", ".") or any(rel.startswith(p + "/") for p in pruned):
            continue
        if item[1:2] == b"d" and not sel.keep_dir(rel):
            pruned.append(rel)
        elif item[1:2] == b"f":
            sel.keep_file(rel, os.path.join(src, rel))
    sel.finish()
    return sel, ["--exclude=" + _rsync_pattern(f.path) for f in sel.left_out]


def inside(code_dir: str, dirs: Sequence[str]) -> List[str]:
    """Those of `dirs` that lie inside `code_dir` (symlinks resolved), relative to it, sorted; `code_dir` itself
    never (a pull into the code dir's own root is not a dir of it to leave out)."""
    root = os.path.realpath(code_dir)
    out = set()
    for d in dirs:
        rel = os.path.relpath(os.path.realpath(d), root)
        if rel != "." and rel != ".." and not rel.startswith(".." + os.sep):
            out.add(rel)
    return sorted(out)


def push(ssh: Ssh, box: Box, pyz: str, code_dir: Optional[str] = None, delete: bool = False,
         io_timeout: int = 60, progress: Optional[Callable[[str], None]] = None,
         include_secrets: Sequence[str] = (), pulled: Sequence[str] = ()) -> PushReport:
    """Copy the pyz (when its hash differs) and the code dir; verify both on the box. Raises on any mismatch.

    Secret-looking files of the code dir (.env, keys, kaggle.json, .netrc, .git/, ...) are left out unless
    `include_secrets` names them; the report names them (`warnings`, for stderr). Left out, not only warned about:
    a box is someone else's machine (a marketplace host has root on it, an image may ship its disk elsewhere) and
    a code dir is pushed again and again, so a warning alone would be read once and the key would still go every
    time; a secret the job needs travels by `onboxctl secrets push` (stdin, mode 0600, U34), or on purpose with
    --include-secret. Decided before any connection.

    `pulled`: the local dirs `onboxctl pull` brought checkpoints home into (its pulls record); those inside the
    code dir are left out (the report's `pulled_left_out`): a pull into ./results followed by `push --code .`
    would otherwise send the checkpoints back to the box."""
    say = progress or (lambda _m: None)
    t0 = time.monotonic()
    if not os.path.isfile(pyz):
        raise UsageError("no onbox.pyz at %s" % pyz, hint="build it with `make zipapp` or pass --pyz PATH")
    if code_dir is not None and not os.path.isdir(code_dir):
        raise UsageError("--code %s is not a directory" % code_dir)
    if include_secrets and code_dir is None:
        raise UsageError("--include-secret goes with --code: it names a file of the code directory")
    target = box.target()
    local_sha = sha256_file(pyz)
    report = PushReport(box=box.name, pyz_sha256=local_sha, pyz_copied=False, remote_version="")
    excludes: List[str] = []
    if code_dir is not None:
        selection, excludes = code_selection(code_dir, include_secrets)
        report.secrets_left_out = [f.to_dict() for f in selection.left_out]
        report.secrets_included = [f.to_dict() for f in selection.included]
        report.warnings = selection.summary("--code %s" % code_dir)
        report.pulled_left_out = inside(code_dir, pulled)
        excludes = ["--exclude=%s/" % _rsync_pattern(rel) for rel in report.pulled_left_out] + excludes

    # one call: create the dirs (U13: never assume a sibling made them) and read the remote hash
    script = "umask 022; mkdir -p %s %s && mkdir -p -m 700 %s && %s" % (
        REMOTE_ROOT, REMOTE_CODE, REMOTE_SECRETS, _REMOTE_SHA % REMOTE_PYZ)
    remote_sha = ssh.run(target, script=script, what="prepare remote dirs").text.strip()
    if remote_sha != local_sha:
        say("copying onbox.pyz (%d bytes) to %s" % (os.path.getsize(pyz), box.name))
        ssh_rsync(ssh, box, [pyz], REMOTE_PYZ, io_timeout=io_timeout)
        report.pyz_copied = True
    else:
        say("onbox.pyz on %s is current (sha256 %s)" % (box.name, local_sha[:12]))

    remote_code = None
    if code_dir is not None:
        src = os.path.abspath(code_dir).rstrip("/")
        remote_code = "%s/%s" % (REMOTE_CODE, os.path.basename(src))
        # --delete spares what the excludes leave out: a file sent before stays on the box (rsync's rule)
        extra = code_filter_args(src, excludes) + ["--itemize-changes"] + (["--delete"] if delete else [])
        say("syncing %s to %s:%s" % (src, box.name, remote_code))
        res = ssh_rsync(ssh, box, [src + "/"], remote_code + "/", extra=extra, io_timeout=io_timeout)
        report.code_files_changed = sum(1 for line in res.splitlines() if line[:1] in "<>ch" and line[1:2] == "f")
        report.code_dir = remote_code

    # U42: verify what is ON the box, not what we think we sent
    verify_pushed(ssh, box, local_sha, code_dir, remote_code, io_timeout, excludes)
    version = ssh.run(target, [box.python, REMOTE_PYZ, "--version"], timeout=60, what="onbox --version").text
    report.remote_version = version.strip()
    record = {"pyz_sha256": local_sha, "code": remote_code, "time": time.time(), "version": report.remote_version}
    ssh.run(target, script="umask 022; cat > %s.tmp && mv -f %s.tmp %s" % (REMOTE_PUSHED, REMOTE_PUSHED, REMOTE_PUSHED),
            input_bytes=json.dumps(record).encode(), what="record the push")
    report.seconds = round(time.monotonic() - t0, 3)
    return report


def verify_pushed(ssh: Ssh, box: Box, local_sha: str, code_dir: Optional[str], remote_code: Optional[str],
                  io_timeout: int, excludes: Optional[Sequence[str]] = None) -> None:
    target = box.target()
    got = ssh.run(target, script=_REMOTE_SHA % REMOTE_PYZ, what="hash onbox.pyz").text.strip()
    if got != local_sha:
        raise JobFailed("onbox.pyz on %s has sha256 %s, expected %s" % (box.name, got[:16] or "(missing)", local_sha[:16]),
                        hint="the copy did not land (disk full? U7); check `df -h -i` on the box and push again")
    if code_dir is not None and remote_code is not None:
        # a checksum dry run: any file that would still be sent differs on the box (or is missing there)
        extra = [*code_filter_args(code_dir, excludes), "--dry-run", "--checksum", "--itemize-changes"]
        out = ssh_rsync(ssh, box, [os.path.abspath(code_dir).rstrip("/") + "/"], remote_code + "/", extra=extra,
                        io_timeout=io_timeout)
        differ = [line[12:] for line in out.splitlines() if line[:2] in ("<f", ">f")]
        if differ:
            raise JobFailed("code on %s differs from %s after the push: %s" % (box.name, code_dir, ", ".join(differ[:5])),
                            hint="a file changed during the push, or the box's disk is full; push again")


RSYNC_TO = Tool("rsync", RemoteCommandFailed, missing=RSYNC_MISSING,
                timed_out=Says("rsync to {box} did not finish within {timeout:.0f} s",
                               "run the same command again: rsync resumes what is already there", error=JobFailed),
                failed=Says("rsync with {box} failed (exit {rc}): {stderr}",
                            "exit 11/12/23 usually mean a full disk or a dropped link; check `df -h -i` on the box "
                            "and retry"))


def ssh_rsync(ssh: Ssh, box: Box, sources: List[str], dest: str, extra: Optional[List[str]] = None,
              io_timeout: int = 60, upload: bool = True, timeout: Optional[float] = None) -> str:
    """Run rsync over our ssh settings (after the master connection is up). Returns rsync's stdout. Without a
    `timeout` only rsync's own --timeout (`io_timeout`: no byte moved for that long) bounds it."""
    target = box.target()
    ssh.ensure_master(target)
    argv = ssh.rsync_argv(target, sources, dest, upload=upload, extra=extra or [], io_timeout=io_timeout)
    done = RSYNC_TO.run(argv, timeout, check=False, stdin=subprocess.DEVNULL, binary=True, new_session=True,
                        box=box.name)
    text = done.stderr.decode("utf-8", "replace").strip()
    if rsync_lost_link(done.returncode, text):
        raise unreachable(target, text)
    RSYNC_TO.check(done, box=box.name)
    return done.stdout.decode("utf-8", "replace")


def check_secret_name(name: str) -> str:
    if not SECRET_NAME_RE.fullmatch(name):
        raise UsageError("invalid secret name %r" % name, hint="letters, digits, '.', '_' and '-' (at most 64)")
    return name


EMPTY_SECRET = UsageError("empty secret on stdin: nothing was sent",
                          hint="pipe the value in: `onboxctl secrets push BOX NAME < file`")


def secret_input(fd: int) -> IO[bytes]:
    """Our stdin as the stream to hand to ssh, refused (UsageError) BEFORE any network when it is empty or only
    whitespace. A regular file is checked with pread and handed over unread; from a pipe only the leading
    whitespace is held back, then a thread streams the rest through (U34: never the whole value in our memory,
    never in an argv)."""
    try:
        st = os.fstat(fd)
    except OSError:  # no stdin at all (closed by the caller)
        raise EMPTY_SECRET
    if stat.S_ISREG(st.st_mode):
        head = os.pread(fd, 4096, os.lseek(fd, 0, os.SEEK_CUR))
        if not head.strip() and st.st_size - os.lseek(fd, 0, os.SEEK_CUR) <= len(head):
            raise EMPTY_SECRET
        return os.fdopen(os.dup(fd), "rb", buffering=0)
    prefix = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EMPTY_SECRET
        prefix += chunk
        if chunk.strip():
            break
    rfd, wfd = os.pipe()

    def pump() -> None:
        try:
            with os.fdopen(wfd, "wb", buffering=0) as out:
                out.write(prefix)
                for block in iter(lambda: os.read(fd, 65536), b""):
                    out.write(block)
        except OSError:  # ssh went away first: it reports its own failure
            pass

    threading.Thread(target=pump, name="secret-stdin", daemon=True).start()
    return os.fdopen(rfd, "rb", buffering=0)


def push_secret(ssh: Ssh, box: Box, name: str, value: Union[bytes, IO[bytes]], timeout: float = 120.0) -> Tuple[str, int]:
    """stdin -> ssh's stdin -> remote file, mode 0600 (U34). The value is in no argv, no log, no history: a file
    object (our own stdin) is handed to ssh unread. Returns (remote path, bytes stored)."""
    check_secret_name(name)
    path = "%s/%s" % (REMOTE_SECRETS, name)
    tmp = path + ".tmp"
    # umask 077 before anything is created: the file never exists with wider permissions, not even briefly;
    # an empty value (nothing piped in) is refused on the box and leaves nothing behind
    script = ("umask 077; mkdir -p %s && chmod 700 %s && cat > %s && if [ ! -s %s ]; then rm -f %s; exit 3; fi; "
              "chmod 600 %s && mv -f %s %s && stat -c %%a %s && wc -c < %s") % (
        REMOTE_SECRETS, REMOTE_SECRETS, tmp, tmp, tmp, tmp, tmp, path, path, path)
    if isinstance(value, bytes):
        res = ssh.run(box.target(), script=script, input_bytes=value, what="write secret", check=False, timeout=timeout)
    else:
        res = ssh.run(box.target(), script=script, stdin=value, what="write secret", check=False, timeout=timeout)
    if res.returncode == 3:
        raise UsageError("empty secret on stdin", hint="pipe the value in: `onboxctl secrets push BOX NAME < file`")
    if res.returncode != 0:
        raise JobFailed("writing secret %s on %s failed (exit %d): %s" % (name, box.name, res.returncode, res.err_text[-300:]))
    mode, _, size = res.text.strip().partition("\n")
    if mode.strip() != "600":
        raise JobFailed("secret %s on %s has mode %s, expected 600" % (name, box.name, mode))
    return path, int(size.strip() or 0)
