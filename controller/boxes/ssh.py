"""The OpenSSH / rsync seam: every remote call onboxctl makes goes through here.

Rules this module enforces (gotchas U1, U4, U12, U13, U17):
- every call is a list argv, never a local shell string; a remote command is built from argv with shlex quoting;
- BatchMode (never a password prompt that hangs), ConnectTimeout, ServerAliveInterval/CountMax (a dead link
  kills the client in interval x count seconds instead of a half-open hang);
- one multiplexed master connection per box in a private directory (ControlPath), started explicitly so that the
  backgrounded master never holds a pipe of ours open;
- every remote command has a timeout; a timed-out client is killed with its process group;
- exit 255 is the ssh client's own failure (connection), not the remote command's: it becomes a BoxUnreachable
  whose message names the cause ssh gave (a changed host key, a refused login, nothing listening, no answer, no
  route, an unknown name) and the fix (sshfail.py);
- host keys of inventory boxes live in onbox's own known_hosts ($ONBOX_CONFIG_DIR/known_hosts): a box met for the
  first time is accepted (`StrictHostKeyChecking=accept-new`: rentals get a new key with every machine), a key
  that CHANGED is refused and never replaced silently. A box whose own ssh options set StrictHostKeyChecking,
  UserKnownHostsFile, GlobalKnownHostsFile or KnownHostsCommand keeps them, and onbox adds neither.

The user's ~/.ssh/config, agent and ProxyJump stay in force: we only add -o options, and a box that is not in the
inventory is passed to ssh as a host alias (ssh's own known_hosts then applies).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import shlex
import socket
import stat
import subprocess
import tempfile
import threading
import time
from typing import IO, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from controller.boxes.sshfail import BoxUnreachable as BoxUnreachable  # where onboxctl's commands find it
from controller.boxes.sshfail import unreachable
from onbox.environment import Environment
from onbox.errors import JobFailed, UnfitError, UsageError
from onbox.toolrun import Says, Tool, stderr_tail

SSH_FAILURE = 255  # ssh(1): "exits with 255 if an error occurred" (its own, not the remote command's)


class RemoteTimeout(JobFailed):
    """A remote command did not finish within its timeout."""


class RemoteCommandFailed(JobFailed):
    """The remote command ran and exited non-zero."""


# A missing ssh or rsync here is this machine's problem (exit 3), whatever the command was for.
SSH_MISSING = Says("ssh is not installed on this machine", "install the OpenSSH client (apt-get install openssh-client)",
                   error=UnfitError)
RSYNC_MISSING = Says("rsync is not installed on this machine", "install rsync here and on the box "
                     "(apt-get install rsync)", error=UnfitError)
SSH = Tool("ssh", RemoteCommandFailed, missing=SSH_MISSING,
           timed_out=Says("{what} on {box} did not finish within {timeout:.0f} s",
                          "the box may be overloaded or the link stalled; check with `onboxctl status` and retry "
                          "(the remote side may still have run)", error=RemoteTimeout),
           failed=Says("{what} on {box} exited {rc}: {stderr}"), tail=stderr_tail(chars=600, empty="(no output)"))


def rsync_lost_link(returncode: int, err: str) -> bool:
    """Whether rsync failed because its ssh link did (ssh's own 255, or rsync's 12 "connection unexpectedly
    closed"), not because of the files: the box is unreachable."""
    return returncode == SSH_FAILURE or (returncode == 12 and "connection unexpectedly closed" in err)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a box is: what ssh needs. `host` may be a ~/.ssh/config alias (then port/user come from there)."""

    name: str
    host: str
    port: Optional[int] = None
    user: Optional[str] = None
    identity: Optional[str] = None
    options: Sequence[str] = ()  # extra `-o Key=Value` options from the inventory (e.g. UserKnownHostsFile)
    known_hosts: Optional[str] = None  # onbox's own known_hosts: a new key is accepted there, a changed one refused
    alias: bool = False  # a name that is not in the inventory, handed to ssh as a host alias

    def __post_init__(self) -> None:
        check_ssh_word("host", self.host)
        if self.user is not None:
            check_ssh_word("user", self.user)

    @property
    def destination(self) -> str:
        return "%s@%s" % (self.user, self.host) if self.user else self.host


@dataclasses.dataclass(frozen=True)
class SshSettings:
    """Timeouts and multiplexing. Seconds everywhere; tests shrink them."""

    connect_timeout: int = 10
    alive_interval: int = 5
    alive_count: int = 3
    control_persist: int = 120
    control_dir: Optional[str] = None  # default: a private per-user dir (see control_dir())
    command_timeout: float = 60.0  # default bound for a remote command (U17)
    multiplex: bool = True


@dataclasses.dataclass
class Result:
    argv: List[str]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err_text(self) -> str:
        return self.stderr.decode("utf-8", "replace").strip()


def check_ssh_word(what: str, value: str) -> str:
    """A host, user or alias that ssh gets as a word of its argv: never empty, never starting with '-' (ssh and
    rsync would read `-oProxyCommand=...` as an option and run it), no whitespace or control characters."""
    if not isinstance(value, str) or not value:
        raise UsageError("the %s must not be empty" % what)
    if value.startswith("-"):
        raise UsageError("invalid %s %r: it must not start with '-' (ssh would read it as an option)" % (what, value),
                         hint="give the real %s; an option belongs in --ssh-option KEY=VALUE" % what)
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
        raise UsageError("invalid %s %r: no spaces or control characters" % (what, value))
    return value


def default_control_dir() -> str:
    """A short private directory for ControlPath sockets (unix socket paths are limited to ~104 bytes)."""
    base = Environment.read().xdg_runtime_dir or tempfile.gettempdir()
    return os.path.join(base, "onboxctl-ssh-%d" % os.getuid())


def remote_command(argv: Sequence[str]) -> str:
    """Quote an argv for the remote login shell (ssh joins its arguments with spaces and hands them to a shell)."""
    return " ".join(shlex.quote(str(a)) for a in argv)


class Ssh:
    """Builds and runs ssh/rsync command lines for one set of settings; every call goes through onbox.toolrun."""

    def __init__(self, settings: Optional[SshSettings] = None, env: Optional[Mapping[str, str]] = None) -> None:
        self.settings = settings or SshSettings()
        self.env = dict(env) if env is not None else None
        self._locks: Dict[Tuple[str, Optional[int], Optional[str]], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # -- command lines ---------------------------------------------------------------------------------------
    def control_dir(self) -> str:
        return self.settings.control_dir or default_control_dir()

    def options(self, target: Target, master: Optional[str] = None, persist: bool = False) -> List[str]:
        """The `-o`/`-p`/`-i` part shared by ssh and rsync's `-e` (without the destination). `persist`: a master
        that stays until its link dies or it is told to go (it carries a tunnel; see controller/boxes/tunnel.py)."""
        s = self.settings
        opts = [
            "-o", "BatchMode=yes",  # never prompt: a prompt in a script is a hang
            "-o", "ConnectTimeout=%d" % s.connect_timeout,
            "-o", "ServerAliveInterval=%d" % s.alive_interval,  # U17: a blip self-kills instead of hanging
            "-o", "ServerAliveCountMax=%d" % s.alive_count,
        ]
        if s.multiplex:
            # %C: a hash of host, port and user: a short, unique socket path
            opts += ["-o", "ControlPath=%s" % os.path.join(self.control_dir(), "%C"),
                     "-o", "ControlMaster=%s" % (master or "no")]
            if master:
                opts += ["-o", "ControlPersist=%s" % ("yes" if persist else s.control_persist)]
        for opt in target.options:
            opts += ["-o", opt]
        if target.known_hosts:  # never together with the box's own host-key options (Box.target leaves it out)
            opts += ["-o", "StrictHostKeyChecking=accept-new",
                     "-o", "UserKnownHostsFile=%s" % config_path(target.known_hosts)]
        if target.port:
            opts += ["-p", str(target.port)]
        if target.identity:
            opts += ["-i", os.path.expanduser(target.identity), "-o", "IdentitiesOnly=yes"]
        return opts

    def ssh_argv(self, target: Target, argv: Optional[Sequence[str]] = None, script: Optional[str] = None,
                 tty: bool = False) -> List[str]:
        """ssh argv running `argv` (quoted) or a prepared shell `script` on the box."""
        # `--` BEFORE the destination: nothing after it is ever read as an ssh option (the host included)
        out = ["ssh"] + self.options(target) + (["-tt"] if tty else ["-T"]) + ["--", target.destination]
        if argv is not None:
            out.append(remote_command(argv))
        elif script is not None:
            out.append(script)
        return out

    def rsync_shell(self, target: Target) -> str:
        """The `-e` value for rsync: our ssh with the same options (rsync splits it shell-style)."""
        return remote_command(["ssh", *self.options(target), "-T"])

    def rsync_argv(self, target: Target, sources: Sequence[str], dest: str, *, upload: bool,
                   extra: Sequence[str] = (), io_timeout: int = 60) -> List[str]:
        """rsync argv; remote paths are relative to the login directory unless absolute.

        `--protect-args` keeps remote names from being split by the remote shell; `--timeout` bounds a stalled
        transfer (U12: a stall is retried, not waited on forever)."""
        base = ["rsync", "-a", "--protect-args", "--timeout=%d" % io_timeout, "-e", self.rsync_shell(target)]
        base += list(extra)
        if upload:
            return base + list(sources) + ["%s:%s" % (target.destination, dest)]
        return base + ["%s:%s" % (target.destination, s) for s in sources] + [dest]

    # -- running ---------------------------------------------------------------------------------------------
    def ensure_master(self, target: Target, persist: bool = False) -> None:
        """Start the multiplexed master connection if none is alive. A box that is down fails here, fast.
        `persist`: the master must stay after its last session (it carries a tunnel); a live master that would
        time out is told to stop taking new sessions (those under way finish) and a persistent one replaces it."""
        if not self.settings.multiplex:
            return
        os.makedirs(self.control_dir(), mode=0o700, exist_ok=True)
        os.chmod(self.control_dir(), 0o700)
        with self._lock_for(target), self._file_lock(target):  # one master per box: threads, and processes (a
            self._ensure_master_locked(target, persist)         # tunnel's supervisor beside `onboxctl tunnel`)

    @contextlib.contextmanager
    def _file_lock(self, target: Target) -> Iterator[None]:
        """A flock per box in the control dir, so that two onboxctl processes never start two masters at once (the
        second would find the socket taken and stay as a plain connection nobody uses). Bounded: a holder is
        itself bounded by the master's start timeout; past that we go on without it."""
        key = hashlib.sha256(repr((target.host, target.port, target.user)).encode()).hexdigest()[:16]
        fd = os.open(os.path.join(self.control_dir(), "master-%s.lock" % key), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + self.settings.connect_timeout + 20.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the lock

    def master_pid(self, target: Target) -> Optional[int]:
        """The pid of the live master connection to `target` (a local check, no network), or None."""
        if not self.settings.multiplex:
            return None
        res = self._exec(self.control_argv(target, "check"), timeout=5.0, input_bytes=None, quiet=True)
        m = re.search(r"pid=(\d+)", res.err_text)
        return int(m.group(1)) if res.returncode == 0 and m else None

    def control_argv(self, target: Target, command: str, *args: str) -> List[str]:
        """`ssh -O COMMAND [ARGS] -- DEST`: a request to the master (check, forward, cancel, stop, exit)."""
        return ["ssh", *self.options(target), "-O", command, *args, "--", target.destination]

    def master_argv(self, target: Target, persist: bool = False) -> List[str]:
        """The master connection: backgrounded after authentication (-f), no command (-N)."""
        return ["ssh", *self.options(target, master="yes", persist=persist), "-N", "-f", "--", target.destination]

    def control(self, target: Target, command: str, *args: str, timeout: float = 30.0) -> Result:
        return self._exec(self.control_argv(target, command, *args), timeout=timeout, input_bytes=None, quiet=True)

    def _lock_for(self, target: Target) -> threading.Lock:
        key = (target.host, target.port, target.user)
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def _ensure_master_locked(self, target: Target, persist: bool = False) -> None:
        check = self.control_argv(target, "check")
        pid = self.master_pid(target)
        if pid is not None:
            if not persist or master_persists(pid):
                return
            self.control(target, "stop")  # it finishes what it carries, takes nothing new, then exits
        else:
            self._unlink_stale_socket(target)
        # -f backgrounds after authentication; its stderr goes to a file, never to a pipe of ours (a persisting
        # master holding our pipe open would make every later read wait for ControlPersist to expire).
        argv = self.master_argv(target, persist=persist)
        with tempfile.TemporaryFile() as errf:
            rc = self._spawn_wait(argv, self.settings.connect_timeout + 10.0, errf)
            errf.seek(0)
            err = errf.read().decode("utf-8", "replace").strip()
        if rc != 0:
            # another onboxctl may have started the master meanwhile: then it is there to use
            if self._exec(check, timeout=5.0, input_bytes=None, quiet=True).returncode == 0:
                return
            raise unreachable(target, err or "ssh exited %s" % rc)

    def _unlink_stale_socket(self, target: Target) -> None:
        """A master killed outright leaves its socket behind, and a new master would then refuse to take the path
        ("already exists, disabling multiplexing"). A socket in our control dir that no one answers is removed."""
        res = self._exec(["ssh", "-G", *self.options(target), "-T", "--", target.destination], timeout=10.0,
                         input_bytes=None, quiet=True)
        path = next((ln.partition(" ")[2].strip() for ln in res.text.splitlines() if ln.startswith("controlpath ")),
                    None)
        if res.returncode != 0 or not path or os.path.dirname(path) != self.control_dir():
            return
        try:
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                return
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(2.0)
                sock.connect(path)
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except OSError:
            pass

    def poke(self, target: Target, port: int, timeout: float = 5.0) -> None:
        """Connect to the box's own 127.0.0.1:PORT through the live master and hang up (`ssh -W`). A listener left
        there by the session of a master that died with its link then writes to its dead connection, is reset,
        and frees the port for a new forward (the box's sshd would otherwise hold it until something pokes it)."""
        self._exec(["ssh", *self.options(target), "-W", "127.0.0.1:%d" % port, "--", target.destination],
                   timeout=timeout, input_bytes=None, quiet=True)

    def run(self, target: Target, argv: Optional[Sequence[str]] = None, *, script: Optional[str] = None,
            timeout: Optional[float] = None, input_bytes: Optional[bytes] = None, check: bool = True,
            what: str = "remote command", stdin: Optional[IO[bytes]] = None) -> Result:
        """Run a command on the box, bounded by `timeout` (U17). Raises BoxUnreachable, RemoteTimeout and,
        with check=True, RemoteCommandFailed. `stdin` (a file) is handed to ssh as is: streamed, never buffered."""
        self.ensure_master(target)
        full = self.ssh_argv(target, argv, script=script)
        res = self._exec(full, timeout=timeout or self.settings.command_timeout, input_bytes=input_bytes,
                         what=what, target=target, stdin=stdin)
        if res.returncode == SSH_FAILURE:
            raise unreachable(target, res.err_text or "ssh exited 255")
        if check:
            SSH.check(res, what=what, box=target.name)
        return res

    def close(self, target: Target) -> None:
        """Stop the master connection (best effort)."""
        if self.settings.multiplex:
            self._exec(self.control_argv(target, "exit"), timeout=5.0, input_bytes=None, quiet=True)

    def _exec(self, argv: List[str], timeout: float, input_bytes: Optional[bytes], quiet: bool = False,
              what: str = "command", target: Optional[Target] = None, stdin: Optional[IO[bytes]] = None) -> Result:
        """Run ssh in a session of its own (killed as a group at the timeout). `quiet`: a timeout is ssh's own
        failure (exit 255), not an error."""
        done = SSH.run(argv, timeout, check=False, input=input_bytes, binary=True, new_session=True, env=self.env,
                       stdin=stdin if stdin is not None or input_bytes is not None else subprocess.DEVNULL,
                       timed_out_rc=SSH_FAILURE if quiet else None, what=what, box=target.name if target else "?")
        return Result(argv, done.returncode, done.stdout or b"", done.stderr or b"")

    def _spawn_wait(self, argv: List[str], timeout: float, errf: Any) -> int:
        """The exit code of a master start (its stderr into the file `errf`); a timeout reads as ssh's own 255."""
        return SSH.run(argv, timeout, check=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errf,
                       new_session=True, env=self.env, timed_out_rc=SSH_FAILURE).returncode


def master_persists(pid: int) -> bool:
    """Whether the master connection `pid` was started to stay (ControlPersist=yes) rather than time out."""
    try:
        import psutil

        return "ControlPersist=yes" in psutil.Process(pid).cmdline()
    except Exception:  # gone, or not ours to read: treat it as one that may time out
        return False


HOST_KEY_OPTIONS = ("stricthostkeychecking", "userknownhostsfile", "globalknownhostsfile", "knownhostscommand")


def manages_host_keys(options: Sequence[str]) -> bool:
    """Whether a box's own ssh options decide its host keys (then onbox adds no host-key option of its own)."""
    return any(o.partition("=")[0].strip().lower() in HOST_KEY_OPTIONS for o in options)


def config_path(path: str) -> str:
    """A file path as an ssh -o value: `%` is a token there (doubled), a space would end the word (quoted)."""
    value = path.replace("%", "%%")
    if any(c.isspace() or c in "\"'\\" for c in value):
        value = '"%s"' % value.replace("\\", "\\\\").replace('"', '\\"')
    return value


def settings_from_env(environ: Optional[Mapping[str, str]] = None, **overrides: object) -> SshSettings:
    """SshSettings with ONBOX_SSH_CONNECT_TIMEOUT / ONBOX_SSH_ALIVE_INTERVAL / ONBOX_SSH_ALIVE_COUNT /
    ONBOX_SSH_COMMAND_TIMEOUT / ONBOX_SSH_CONTROL_DIR / ONBOX_SSH_MULTIPLEX=0 applied."""
    env = Environment.read(environ).ssh
    fields: Dict[str, Any] = {}
    for key, conv in (("connect_timeout", int), ("alive_interval", int), ("alive_count", int),
                      ("command_timeout", float), ("control_dir", str)):
        raw = env.get(key)
        if raw:
            try:
                fields[key] = conv(raw)
            except ValueError:
                raise UsageError("ONBOX_SSH_%s must be a number, not %r" % (key.upper(), raw))
    if env.get("multiplex", "1") in ("0", "no", "false"):
        fields["multiplex"] = False
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return SshSettings(**fields)
