"""The user's provision command: the one way the keeper gets a box that is not in the inventory yet.

onbox never rents machines itself. `--provision CMD` names the user's own command (a script around the RunPod or
vast.ai CLI: profiles/provision/); the keeper runs it as a list argv (never through a shell), in a session and
process group of its own, with a timeout (`--provision-timeout`, 1 s to 24 h), its stdin closed, and reads at most
64 KiB of its stdout and 64 KiB of its stderr (the last ones; the rest is read and dropped, and the cut is said).
Its contract:

- it rents (or finds) one box, waits until the box answers ssh, and prints ONE JSON object as its last line on
  stdout: `{"host": "203.0.113.7", "port": 22, "user": "root", "name": "gpt-r1"}` (`host` and `name` required;
  optional: `port`, `user`, `identity`, `python`, `options`, `profile`); anything before that line is ignored;
- `options` are ssh `Key=Value` options from an allow-list (provision_options.py: Port, User, IdentityFile under
  the onboxctl config dir or ~/.ssh, ConnectTimeout, ...): an option that runs a command here (ProxyCommand,
  LocalCommand, Match exec, ...), reads another config (Include), or reaches another host (ProxyJump) is refused
  naming it; `identity` lies under the config dir or ~/.ssh too, and `profile` is a known profile;
- it exits 0; a non-zero exit, a timeout or a last line that is not such an object is a failed try (retried with
  backoff by the keeper), said in one line with the last line of its stderr (control characters shown as escapes);
- whatever it leaves running when it ends (a background child, a setsid grandchild) is stopped, TERM then KILL
  (provision_run.py, provision_reaper.py), and said as a `provision_leftovers` event: a provision that needs a
  daemon starts it under its own service manager;
- it gets ONBOX_RUN, ONBOX_POOL, ONBOX_NODE and ONBOX_PROVISION_KEY in its environment. The key is the same for
  every try of one recovery's node, also after the keeper restarts: a script that tags the box it rents with it
  can find that box again instead of renting a second one.
The box is added to the inventory in the run's pool; the keeper never tears it down.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional

from controller.boxes.inventory import BOX_NAME_RE, OPTION_RE, Box, check_box_fields
from controller.keeper.provision_options import key_path_problem, option_problem
from controller.keeper.provision_run import LEFTOVER_GRACE, OUTPUT_MAX_BYTES, ProvisionRunner
from onbox import untrusted
from onbox.errors import JobFailed, OnboxError, UsageError
from onbox.toolrun import Says, Tool

KEYS = {"host", "port", "user", "name", "identity", "python", "options", "profile"}
Note = Callable[[str, str], None]  # (event kind, text): what the keeper says of a try besides its result

__all__ = ["OUTPUT_MAX_BYTES", "ProvisionFailed", "box_from_line", "check_provision_command", "run_provision"]


class ProvisionFailed(JobFailed):
    """The provision command did not give a usable box this time."""


PROVISION = Tool("provision command", ProvisionFailed,
                 missing=Says("the provision command {shown} cannot be started: it is not there",
                              "give --provision an executable (a path, or a command on PATH)"),
                 timed_out=Says("the provision command {shown} did not print a box within {timeout:.0f} s"),
                 failed=Says("the provision command {shown} exited {rc}: {stderr}"))


def run_provision(argv: List[str], timeout: float, env: Dict[str, str], pool: str, note: Optional[Note] = None,
                  grace: float = LEFTOVER_GRACE) -> Box:
    """Run the command once; the box it printed (not yet in the inventory), or ProvisionFailed. `note` hears what
    else the try calls for (what it left running, what was cut), whatever its result."""
    cmd = untrusted.printable(" ".join(argv))
    runner = ProvisionRunner(OUTPUT_MAX_BYTES, grace)
    try:
        try:
            done = PROVISION.run(argv, timeout, check=False, env=dict(os.environ, **env), binary=True, runner=runner,
                                 shown=cmd)
        except PermissionError:
            raise ProvisionFailed("the provision command %s cannot be started: it is not executable" % cmd,
                                  hint="chmod +x it, or give the interpreter: --provision 'bash %s'" % cmd)
        except OSError as e:
            raise ProvisionFailed("the provision command %s cannot be started: %s" % (cmd, untrusted.printable(e)))
    finally:
        if note is not None:
            for kind, text in runner.notes():
                note(kind, text)
    text = bytes(done.stdout).decode("utf-8", "replace")
    why = [ln for ln in bytes(done.stderr).decode("utf-8", "replace").splitlines() if ln.strip()]
    if done.returncode != 0:
        how = "exited %d" % done.returncode if done.returncode > 0 else "was killed by signal %d" % -done.returncode
        raise ProvisionFailed("the provision command %s %s: %s%s" % (
            cmd, how, untrusted.printable(why[-1].strip())[-300:] if why else "(nothing on stderr)", runner.cut_note()))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ProvisionFailed("the provision command %s printed nothing: it must print one JSON line "
                              '{"host", "port", "user", "name"}%s' % (cmd, runner.cut_note()))
    try:
        return box_from_line(lines[-1], pool, cmd)
    except ProvisionFailed as e:
        e.message += runner.cut_note()
        raise


def box_from_line(line: str, pool: str, cmd: str = "the provision command") -> Box:
    """The Box a provision command's last line describes (ProvisionFailed naming what is wrong)."""
    shown = untrusted.printable(line if len(line) <= 120 else line[:117] + "...")
    try:
        doc = untrusted.loads_json(line, "its output")
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise ProvisionFailed("the provision command %s printed %r as its last line, not a JSON object "
                              '{"host", "port", "user", "name"}' % (cmd, shown))
    unknown = sorted(set(doc) - KEYS)
    if unknown:
        raise ProvisionFailed("the provision command %s printed unknown key(s) %s" % (
            cmd, untrusted.printable(", ".join(k[:40] for k in unknown[:5]))),
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
        problem = next((p for p in (option_problem(o) for o in doc.get("options") or []) if p), None)
    if problem is None and doc.get("identity") is not None:
        why = key_path_problem(doc["identity"])
        problem = "identity %s %s" % (untrusted.printable(doc["identity"])[:120], why) if why else None
    if problem is None and doc.get("profile") is not None:
        problem = _profile_problem(doc["profile"])
    if problem is None:
        try:
            check_box_fields(str(host), doc.get("user"), doc.get("python") or "python3")
        except OnboxError as e:
            problem = e.message
    if problem:
        raise ProvisionFailed("the provision command %s printed a box the keeper cannot use: %s" % (
            cmd, untrusted.printable(problem)))
    return Box(name=str(name), host=str(host), port=port, user=doc.get("user"), identity=doc.get("identity"),
               python=doc.get("python") or "python3", options=list(doc.get("options") or []),
               profile=doc.get("profile"), pool=pool)


def _profile_problem(name: str) -> Optional[str]:
    """Why `name` is no profile a provided box may carry (None: a known one): a profile's file is read by later
    commands (`onboxctl down` runs its meter-stop), so a name must never lead to another file."""
    from controller.boxes.profiles import known_profiles

    family, _, sub = name.partition("/")
    known = known_profiles()
    if not BOX_NAME_RE.fullmatch(family) or (sub and not BOX_NAME_RE.fullmatch(sub)):
        return "profile %r is not a profile name" % name[:80]
    if known and family not in known:
        return "unknown profile %r (known: %s)" % (name[:80], ", ".join(known))
    return None


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
