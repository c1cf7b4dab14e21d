"""The real `kaggle` CLI (the `kaggle` package, pinned in the controller extra), run through onbox.toolrun.

Credentials are the CLI's own and stay where it reads them: ~/.kaggle/kaggle.json (KAGGLE_CONFIG_DIR), or
KAGGLE_USERNAME/KAGGLE_KEY, or an access token (KAGGLE_API_TOKEN). They never go into an argv; `credentials()`
only says, before any call, whether there are any and whose they are (the kernel's owner).

The CLI prints words, not documents (kaggle 2.2.5): a push says `Kernel version N successfully pushed.` or
`Kernel push error: ...` (and exits 0 for the latter), a status `OWNER/SLUG has status "KernelWorkerStatus.X"`
(the enum's name; older versions printed `"complete"`), a log is what Kaggle stores: a JSON array of {stream_name,
time, data}. Those shapes are parsed here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
from typing import Any, Dict, List, Optional

from onbox import toolrun, untrusted
from onbox.environment import Environment
from onbox.errors import JobFailed, UnfitError, UsageError

PUSH_TIMEOUT = 600.0  # uploads a ~2 MB script
CALL_TIMEOUT = 120.0
OUTPUT_TIMEOUT = 6 * 3600.0  # downloads a version's output: checkpoints
CREDENTIALS_MAX_BYTES = 64 * 1024
STATES = ("queued", "running", "complete", "error", "cancel_requested", "cancel_acknowledged", "new_script")
ACTIVE = ("queued", "running", "new_script")

VERSION_RE = re.compile(r"Kernel version (\d+) successfully (?:pushed|saved)")
STATUS_RE = re.compile(r'has status "([^"]*)"')
FAILURE_RE = re.compile(r'Failure message: "(.*)"')
PUSH_ERROR = "Kernel push error:"

_TAIL = toolrun.stderr_tail(chars=600, or_stdout=True)
# what the CLI printed is Kaggle's text (and a kernel's): one line, control characters shown as escapes
KAGGLE = toolrun.Tool(
    "kaggle", error=JobFailed,
    missing=toolrun.Says("the kaggle CLI is not installed", error=UnfitError,
                         hint="install onbox's controller extra (pip install 'onbox[controller]'; it pins the "
                              "kaggle package, Python 3.11+), or put `kaggle` on PATH"),
    timed_out=toolrun.Says("`{cmd}` did not finish within {timeout:.0f} s",
                           hint="Kaggle did not answer in time: try again"),
    failed=toolrun.Says("`{cmd}` failed (exit {rc}): {stderr}", hint="{hint}"),
    tail=lambda err, out: untrusted.printable(" ".join(_TAIL(err, out).splitlines())))


@dataclasses.dataclass(frozen=True)
class Credentials:
    owner: Optional[str]  # the Kaggle username, when the credentials name one
    source: str  # where they are, in words (never their value)


def credentials(environ: Optional[Dict[str, str]] = None) -> Credentials:
    """Which credentials the kaggle CLI will use, as it looks for them; UnfitError (exit 3) when there are none."""
    env = Environment.read(environ)
    if env.kaggle_username and env.kaggle_key:
        return Credentials(env.kaggle_username, "KAGGLE_USERNAME/KAGGLE_KEY")
    home = os.path.expanduser("~")
    dirs = [env.kaggle_config_dir] if env.kaggle_config_dir else [
        os.path.join(home, ".kaggle"),
        os.path.join(env.xdg_config_home or os.path.join(home, ".config"), "kaggle")]
    for d in dirs:
        path = os.path.join(os.path.expanduser(d), "kaggle.json")
        if not os.path.exists(path):
            continue
        try:
            doc = untrusted.read_json(path, CREDENTIALS_MAX_BYTES, "kaggle credentials")
        except (OSError, ValueError) as e:
            raise UsageError("%s cannot be read: %s" % (path, untrusted.reason(e)),
                             hint="it must be {\"username\": ..., \"key\": ...} as Kaggle's Settings > API gives it")
        user = doc.get("username") if isinstance(doc, dict) else None
        if not isinstance(user, str) or not isinstance(doc.get("key"), str):
            raise UsageError("%s has no username and key" % path,
                             hint="download a new one: Kaggle Settings > API > Create New Token")
        return Credentials(user, path)
    if env.kaggle_api_token or os.path.exists(os.path.join(home, ".kaggle", "access_token")):
        return Credentials(env.kaggle_username, "an access token (KAGGLE_API_TOKEN or ~/.kaggle/access_token)")
    raise UnfitError("no Kaggle credentials: neither KAGGLE_USERNAME/KAGGLE_KEY nor %s"
                     % " or ".join(os.path.join(d, "kaggle.json") for d in dirs),
                     hint="Kaggle Settings > API > Create New Token, save it as ~/.kaggle/kaggle.json (chmod 600); "
                          "onbox never takes a key on its command line")


def executable() -> str:
    """The kaggle CLI installed beside this Python (the controller extra), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "kaggle")
    return beside if os.access(beside, os.X_OK) else (shutil.which("kaggle") or "kaggle")


class KaggleCli:
    """One method per kaggle command onboxctl uses. `runner`: the subprocess seam (toolrun's)."""

    def __init__(self, exe: Optional[str] = None, runner: Optional[toolrun.Runner] = None) -> None:
        self.exe = exe or executable()
        self.runner = runner

    def _run(self, args: List[str], timeout: float, hint: str, check: bool = True) -> Any:
        # -W: no "outdated kaggle" line mixed into what is parsed; the pinned version is the tested one
        return KAGGLE.run([self.exe, "-W", *args], timeout, check=check, runner=self.runner, hint=hint)

    def push(self, folder: str) -> int:
        """`kaggle kernels push -p FOLDER`: the new version's number."""
        done = self._run(["kernels", "push", "-p", folder], PUSH_TIMEOUT,
                         "the kernel folder is in %s: fix what Kaggle said and push again" % folder)
        out = done.stdout or ""
        if PUSH_ERROR in out:
            raise JobFailed("Kaggle refused the push: %s" % _said(out.split(PUSH_ERROR, 1)[1].strip()[:600]),
                            hint="the kernel folder is in %s" % folder)
        m = VERSION_RE.search(out)
        if not m:
            raise JobFailed("`kaggle kernels push` said no version: %s" % _said(out.strip()[-600:]),
                            hint="see the kernel on Kaggle; the folder is in %s" % folder)
        return int(m.group(1))

    def status(self, ref: str) -> Optional[Dict[str, Any]]:
        """{"state": one of STATES, "failure": message or None}; None when Kaggle has no such kernel (404)."""
        done = self._run(["kernels", "status", ref], CALL_TIMEOUT, "", check=False)
        text = (done.stdout or "") + (done.stderr or "")
        if done.returncode != 0 and re.search(r"\b404\b|[Nn]ot [Ff]ound", text):
            return None
        if done.returncode != 0:
            KAGGLE.check(done, hint="check the kernel %s on Kaggle" % ref)
        m = STATUS_RE.search(done.stdout or "")
        if not m:
            raise JobFailed("`kaggle kernels status %s` said no status: %s" % (ref, _said(text.strip()[-400:])))
        state = m.group(1).rsplit(".", 1)[-1].lower()
        if state not in STATES:
            raise JobFailed("`kaggle kernels status %s` said %s, a status onbox does not know"
                            % (ref, _said(repr(m.group(1)))))
        failure = FAILURE_RE.search(done.stdout or "")
        return {"state": state, "failure": failure.group(1) if failure else None}

    def log(self, ref: str) -> str:
        """`kaggle kernels logs REF`: the newest session's log as Kaggle stores it."""
        return self._run(["kernels", "logs", ref], CALL_TIMEOUT, "check the kernel %s on Kaggle" % ref).stdout or ""

    def output(self, ref: str, dest: str, pattern: Optional[str] = None) -> None:
        """`kaggle kernels output REF -p DEST -o -q [--file-pattern RE]`: the newest version's output files."""
        self._run(["kernels", "output", ref, "-p", dest, "-o", "-q",
                   *(["--file-pattern", pattern] if pattern else [])], OUTPUT_TIMEOUT,
                  "run the same pull again: files already there are fetched anew")


def _said(text: str) -> str:
    """Text the kaggle CLI printed (Kaggle's words), for a one-line message."""
    return untrusted.printable(" ".join(text.splitlines()))


def log_lines(raw: str) -> List[str]:
    """A kernel's log as lines of text: the `data` of each {stream_name, time, data} entry of Kaggle's JSON array,
    or the raw lines when it is not one (nor one of at most MAX_DEPTH levels: the log is Kaggle's, and a trainer's)."""
    try:
        doc = untrusted.loads_json(raw, "the kernel's log")
    except ValueError:  # malformed, or nested past the bound (UntrustedInput): its lines as they are
        return raw.splitlines()
    entries = doc if isinstance(doc, list) else [doc]
    text = "".join(str(e.get("data", "")) for e in entries if isinstance(e, dict))
    return text.splitlines()
