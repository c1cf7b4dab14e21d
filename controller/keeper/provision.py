"""The user's provision command: the one way the keeper gets a box that is not in the inventory yet.

onbox never rents machines itself. `--provision CMD` names the user's own command (a script around the RunPod or
vast.ai CLI: profiles/provision/); the keeper runs it as a list argv (never through a shell), in a session of its
own, with a timeout, its stdin closed, and reads at most 64 KiB of what it prints. Its contract:

- it rents (or finds) one box, waits until the box answers ssh, and prints ONE JSON object as its last line on
  stdout: `{"host": "203.0.113.7", "port": 22, "user": "root", "name": "gpt-r1"}` (`host` and `name` required;
  optional: `port`, `user`, `identity`, `python`, `options`, `profile`); anything before that line is ignored;
- it exits 0; a non-zero exit, a timeout or a last line that is not such an object is a failed try (retried with
  backoff by the keeper), said in one line with the tail of its stderr;
- it gets ONBOX_RUN, ONBOX_POOL, ONBOX_NODE and ONBOX_PROVISION_KEY in its environment. The key is the same for
  every try of one recovery's node, also after the keeper restarts: a script that tags the box it rents with it
  can find that box again instead of renting a second one.
The box is added to the inventory in the run's pool; the keeper never tears it down.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any, Dict, List, Optional

from controller.boxes import BOX_NAME_RE, OPTION_RE, Box, check_box_fields
from onbox import untrusted
from onbox.errors import JobFailed, OnboxError, UsageError
from onbox.toolrun import Says, Tool

OUTPUT_MAX_BYTES = 64 * 1024
KEYS = {"host", "port", "user", "name", "identity", "python", "options", "profile"}


class ProvisionFailed(JobFailed):
    """The provision command did not give a usable box this time."""


PROVISION = Tool("provision command", ProvisionFailed,
                 missing=Says("the provision command {cmd} cannot be started: it is not there",
                              "give --provision an executable (a path, or a command on PATH)"),
                 timed_out=Says("the provision command {cmd} did not print a box within {timeout:.0f} s"),
                 failed=Says("the provision command {cmd} exited {rc}: {stderr}"))


def _tail(f: Any, limit: int) -> bytes:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return f.read(limit)


def run_provision(argv: List[str], timeout: float, env: Dict[str, str], pool: str) -> Box:
    """Run the command once; the box it printed (not yet in the inventory), or ProvisionFailed."""
    cmd = " ".join(argv)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        full_env = dict(os.environ, **env)
        try:
            done = PROVISION.run(argv, timeout, check=False, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 env=full_env, binary=True, new_session=True)
        except PermissionError:
            raise ProvisionFailed("the provision command %s cannot be started: it is not executable" % cmd,
                                  hint="chmod +x it, or give the interpreter: --provision 'bash %s'" % cmd)
        text = _tail(out, OUTPUT_MAX_BYTES).decode("utf-8", "replace")
        why = _tail(err, 600).decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0:
        raise ProvisionFailed("the provision command %s exited %d: %s" % (
            cmd, done.returncode, why[-1] if why else "(nothing on stderr)"))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ProvisionFailed("the provision command %s printed nothing: it must print one JSON line "
                              '{"host", "port", "user", "name"}' % cmd)
    return box_from_line(lines[-1], pool, cmd)


def box_from_line(line: str, pool: str, cmd: str = "the provision command") -> Box:
    """The Box a provision command's last line describes (ProvisionFailed naming what is wrong)."""
    shown = line if len(line) <= 120 else line[:117] + "..."
    try:
        doc = untrusted.loads_json(line, "its output")
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ProvisionFailed("the provision command %s printed %r as its last line, not a JSON object "
                              '{"host", "port", "user", "name"}' % (cmd, shown))
    unknown = sorted(set(doc) - KEYS)
    if unknown:
        raise ProvisionFailed("the provision command %s printed unknown key(s) %s" % (cmd, ", ".join(unknown)),
                              hint="known keys: %s" % ", ".join(sorted(KEYS)))
    name, host, port = doc.get("name"), doc.get("host"), doc.get("port")
    problem: Optional[str] = None
    if not isinstance(name, str) or not BOX_NAME_RE.fullmatch(name):
        problem = "name %r is not a box name (letters, digits, '.', '_', '-')" % (name,)
    elif not isinstance(host, str) or not host:
        problem = "host %r is not a host" % (host,)
    elif port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        problem = "port %r is not 1-65535" % (port,)
    elif any(doc.get(k) is not None and not isinstance(doc[k], str) for k in ("user", "identity", "python", "profile")):
        problem = "user, identity, python and profile must be strings"
    elif doc.get("options") is not None and not (isinstance(doc["options"], list) and all(
            isinstance(o, str) and OPTION_RE.fullmatch(o) for o in doc["options"])):
        problem = 'options must be a list of "Key=Value"'
    if problem is None:
        try:
            check_box_fields(str(host), doc.get("user"), doc.get("python") or "python3")
        except OnboxError as e:
            problem = e.message
    if problem:
        raise ProvisionFailed("the provision command %s printed a box the keeper cannot use: %s" % (cmd, problem))
    return Box(name=str(name), host=str(host), port=port, user=doc.get("user"), identity=doc.get("identity"),
               python=doc.get("python") or "python3", options=list(doc.get("options") or []),
               profile=doc.get("profile"), pool=pool)


def check_provision_command(argv: List[str]) -> List[str]:
    """At `onboxctl run` time: the program exists and is executable (a typo is exit 2 now, not at 3 a.m.). A
    relative path is made absolute: the keeper may run elsewhere."""
    prog = argv[0]
    if os.sep in prog:
        path = os.path.abspath(os.path.expanduser(prog))
        if not os.path.isfile(path):
            raise UsageError("--provision %s: no such file" % prog, hint="give the path of your provision script")
        if not os.access(path, os.X_OK):
            raise UsageError("--provision %s is not executable" % prog,
                             hint="chmod +x %s, or name its interpreter: --provision 'bash %s'" % (prog, prog))
        return [path, *argv[1:]]
    import shutil

    if shutil.which(prog) is None:
        raise UsageError("--provision %s: no such command on PATH" % prog,
                         hint="give the path of your provision script, e.g. --provision ./new-box.sh")
    return list(argv)
