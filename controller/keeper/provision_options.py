"""What a provision command's output may ask of ssh on this machine: an allow-list, checked before the box is added to
the inventory (every later `onboxctl` command that reaches the box passes its `options` to ssh as `-o`).

A provision's JSON line is outside input: the script often echoes what a platform's API answered. ssh options are
code on the keeper's machine (`ProxyCommand=touch pwned` ran there), so only options that shape one connection to
the box the line names are taken, each with its value checked:

  Port, User, ConnectTimeout, ConnectionAttempts, ServerAliveInterval, ServerAliveCountMax, TCPKeepAlive,
  Compression, BatchMode (yes), IdentitiesOnly, StrictHostKeyChecking, CheckHostIP, HostKeyAlias, AddressFamily,
  LogLevel, HostKeyAlgorithms, PubkeyAcceptedAlgorithms (and its old name), Ciphers, MACs, KexAlgorithms,
  IdentityFile and UserKnownHostsFile (a path under the onboxctl config dir or ~/.ssh; known hosts also /dev/null)

Everything else is refused naming the option; the ones below also say why. ProxyJump is refused on purpose: it is a
second host that ssh offers the user's keys and agent to, parsed by ssh's own rules (comma-separated hops, an alias
that pulls in the user's ~/.ssh/config blocks, ProxyCommand included), chosen by a line a script printed. A bastion
in front of rented boxes is the user's own decision: `Host 203.0.113.*` + `ProxyJump bastion` in ~/.ssh/config, which
the keeper's ssh honours.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, List, Optional

from controller.boxes.ssh import check_ssh_word
from onbox import untrusted
from onbox.errors import UsageError

# Refused with a reason (lower-case keyword -> why), besides every option not on the allow-list.
RUNS_HERE = "it runs a command on this machine"
NEVER = {
    "proxycommand": RUNS_HERE, "localcommand": RUNS_HERE, "permitlocalcommand": RUNS_HERE,
    "knownhostscommand": RUNS_HERE, "match": RUNS_HERE + " (`Match exec`)",
    "include": "it reads another ssh config file, which may hold any option",
    "proxyjump": "a second host your keys and agent are offered to; put a bastion in ~/.ssh/config instead",
    "proxyusefdpass": RUNS_HERE,
    "remotecommand": "it replaces the command onbox runs on the box",
    "forwardagent": "it hands your ssh agent to the box", "forwardx11": "it hands your display to the box",
    "forwardx11trusted": "it hands your display to the box",
    "sendenv": "it sends this machine's environment (its secrets) to the box",
    "setenv": "it sets the environment of the session on the box (onbox sets what the run needs)",
    "localforward": "it forwards ports between this machine and the box",
    "remoteforward": "it forwards ports between this machine and the box",
    "dynamicforward": "it forwards ports between this machine and the box",
    "gatewayports": "it forwards ports between this machine and the box",
    "tunnel": "it forwards ports between this machine and the box",
    "tunneldevice": "it forwards ports between this machine and the box",
    "controlpath": "onbox shares connections itself; another socket reuses a connection to another host",
    "controlmaster": "onbox shares connections itself; another socket reuses a connection to another host",
    "controlpersist": "onbox shares connections itself; another socket reuses a connection to another host",
    "pkcs11provider": "it loads a library into ssh on this machine",
    "securitykeyprovider": "it loads a library into ssh on this machine",
    "identityagent": "it points ssh at another agent socket",
    "hostname": "the host is the line's own `host`",
    "globalknownhostsfile": "onbox keeps the host keys of boxes (or UserKnownHostsFile names where)",
}

YES_NO = ("yes", "no")
NUMBER = re.compile(r"^[0-9]{1,6}$")
WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ALGORITHMS = re.compile(r"^[+^-]?[A-Za-z0-9@.,_+-]{1,1024}$")
PATH_CHARS = re.compile(r"^[^\s\"'\\%$\x00-\x1f\x7f]{1,4096}$")  # no quoting, %tokens, ${VAR}, control characters


def _choice(*values: str) -> Callable[[str], Optional[str]]:
    def check(v: str) -> Optional[str]:
        return None if v.lower() in values else "is not one of %s" % ", ".join(values)
    return check


def _number(lo: int, hi: int, what: str = "a whole number") -> Callable[[str], Optional[str]]:
    def check(v: str) -> Optional[str]:
        return None if NUMBER.fullmatch(v) and lo <= int(v) <= hi else "is not %s from %d to %d" % (what, lo, hi)
    return check


def _regex(rx: "re.Pattern[str]", what: str) -> Callable[[str], Optional[str]]:
    def check(v: str) -> Optional[str]:
        return None if rx.fullmatch(v) else "is not %s" % what
    return check


def _user(v: str) -> Optional[str]:
    try:
        check_ssh_word("user", v)
    except UsageError as e:
        return e.message
    return None


def _dev_null_or_path(v: str) -> Optional[str]:
    return None if v == "/dev/null" else key_path_problem(v)


ALLOWED: Dict[str, Callable[[str], Optional[str]]] = {
    "port": _number(1, 65535, "a port"),
    "user": _user,
    "connecttimeout": _number(1, 3600),
    "connectionattempts": _number(1, 100),
    "serveraliveinterval": _number(0, 3600),
    "serveralivecountmax": _number(0, 1000),
    "tcpkeepalive": _choice(*YES_NO),
    "compression": _choice(*YES_NO),
    "batchmode": _choice("yes"),  # a prompt in the keeper would be a hang
    "identitiesonly": _choice(*YES_NO),
    "stricthostkeychecking": _choice("yes", "accept-new", "no", "off"),
    "checkhostip": _choice(*YES_NO),
    "hostkeyalias": _regex(WORD, "a host name"),
    "addressfamily": _choice("any", "inet", "inet6"),
    "loglevel": _choice("quiet", "fatal", "error", "info", "verbose", "debug", "debug1", "debug2", "debug3"),
    "hostkeyalgorithms": _regex(ALGORITHMS, "a list of algorithms"),
    "pubkeyacceptedalgorithms": _regex(ALGORITHMS, "a list of algorithms"),
    "pubkeyacceptedkeytypes": _regex(ALGORITHMS, "a list of algorithms"),
    "ciphers": _regex(ALGORITHMS, "a list of algorithms"),
    "macs": _regex(ALGORITHMS, "a list of algorithms"),
    "kexalgorithms": _regex(ALGORITHMS, "a list of algorithms"),
    "identityfile": lambda v: key_path_problem(v),
    "userknownhostsfile": _dev_null_or_path,
}
SHOWN = ("Port, User, IdentityFile, ConnectTimeout, ServerAliveInterval, ServerAliveCountMax, Compression, "
         "StrictHostKeyChecking, UserKnownHostsFile, ...")


def key_dirs() -> List[str]:
    """Where a provision may point ssh at a key or known-hosts file: the onboxctl config dir and ~/.ssh (resolved)."""
    from controller.boxes.inventory import config_dir

    return [os.path.realpath(config_dir()), os.path.realpath(os.path.join(os.path.expanduser("~"), ".ssh"))]


def key_path_problem(value: str) -> Optional[str]:
    """Why `value` is no key or known-hosts path a provision may name (None: it is one). ssh reads a key file and
    appends to a known-hosts file: a line must not make it read or write anywhere else on this machine."""
    if not PATH_CHARS.fullmatch(value):
        return "holds a space, a quote, a %token, a $variable or a control character (give the plain path)"
    path = os.path.realpath(os.path.expanduser(value))
    if not os.path.isabs(os.path.expanduser(value)):
        return "is not an absolute path (or ~/...)"
    dirs = key_dirs()
    if not any(path == d or path.startswith(d + os.sep) for d in dirs):
        return "is not under %s" % " or ".join(dirs)
    return None


def option_problem(option: str) -> Optional[str]:
    """Why the `Key=Value` option is not one a provision may set (None: it may), naming the option."""
    key, sep, value = option.partition("=")
    shown = untrusted.printable(key)[:60]
    if not sep or not key:
        return 'ssh option %r is not "Key=Value"' % untrusted.printable(option)[:80]
    lower = key.lower()
    if lower in NEVER:
        return "ssh option %s is never taken from a provision's output: %s" % (shown, NEVER[lower])
    check = ALLOWED.get(lower)
    if check is None:
        return "ssh option %s is not one a provision may set (allowed: %s)" % (shown, SHOWN)
    why = check(value) if not any(ord(c) < 32 or ord(c) == 127 for c in value) else "holds control characters"
    if why:
        return "ssh option %s=%s %s" % (shown, untrusted.printable(value)[:80], why)
    return None
