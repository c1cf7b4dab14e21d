"""What ssh's own failure (exit 255) means, and what fixes it: its stderr classified (`classify`: a changed host
key, an unknown one, a refused login, nothing listening, no answer, no route, an unknown name, a closed
connection) and turned into the BoxUnreachable that onboxctl prints (`unreachable`), naming ssh's line as the
cause and the command that mends it. ssh.py raises it for every remote call; push and pull for rsync's.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Protocol

from onbox.errors import UnfitError


class Reached(Protocol):
    """What the messages read of a box as ssh reaches it (ssh.Target)."""

    @property
    def name(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> Optional[int]: ...
    @property
    def user(self) -> Optional[str]: ...
    @property
    def identity(self) -> Optional[str]: ...
    @property
    def known_hosts(self) -> Optional[str]: ...
    @property
    def alias(self) -> bool: ...
    @property
    def destination(self) -> str: ...


class BoxUnreachable(UnfitError):
    """ssh could not reach or authenticate to the box. `kind`: what ssh said, one of FAILURE_KINDS."""

    def __init__(self, message: str, hint: Optional[str] = None, kind: str = "other") -> None:
        super().__init__(message, hint=hint)
        self.kind = kind



# What ssh said, in the order it is looked for (a changed key also says "Host key verification failed").
FAILURE_KINDS = ("host_key_changed", "host_key_unknown", "auth", "refused", "no_route", "timeout", "resolve",
                 "closed", "other")
_SAYS = (
    ("host_key_changed", ("REMOTE HOST IDENTIFICATION HAS CHANGED", "has changed and you have requested strict")),
    ("host_key_unknown", ("Host key verification failed", "host key is known for")),
    ("auth", ("Permission denied", "Too many authentication failures")),
    ("refused", ("Connection refused",)),
    ("no_route", ("No route to host", "Network is unreachable")),
    ("timeout", ("timed out",)),
    ("resolve", ("Could not resolve hostname", "Name or service not known", "Temporary failure in name resolution")),
    ("closed", ("Connection closed by", "Connection reset by", "kex_exchange_identification", "Broken pipe",
                "closed by remote host")),
)


@dataclasses.dataclass(frozen=True)
class SshFailure:
    """ssh's own failure (exit 255), read from its stderr."""

    kind: str  # one of FAILURE_KINDS
    line: str  # ssh's line that says it (the last line when none matched)
    remove_with: Optional[str] = None  # a changed key: the `ssh-keygen ... -R ...` command ssh itself suggested


def classify(stderr: str) -> SshFailure:
    """What went wrong, from ssh's stderr (the whole of it: a changed key's banner spans twenty lines)."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    remove_with = None
    for i, ln in enumerate(lines):
        if ln.startswith("remove with:") and i + 1 < len(lines) and lines[i + 1].startswith("ssh-keygen"):
            remove_with = lines[i + 1]
    for kind, needles in _SAYS:
        for ln in lines:
            if any(n.lower() in ln.lower() for n in needles):
                if kind == "host_key_changed":
                    ln = next((x for x in lines if "has changed and you have" in x), "the host key has changed")
                return SshFailure(kind, ln, remove_with)
    return SshFailure("other", lines[-1] if lines else "ssh exited 255")


def by_hand(target: Reached) -> str:
    """The ssh command line a person types to try the box as onboxctl reaches it."""
    words = ["ssh"]
    if target.port:
        words += ["-p", str(target.port)]
    if target.identity:
        words += ["-i", target.identity]
    return " ".join([*words, target.destination])


def unreachable(target: Reached, stderr: str) -> BoxUnreachable:
    """The error for ssh's own failure on `target`: what ssh said, named as its cause, and what fixes it."""
    f = classify(stderr)
    kind = f.kind
    if kind == "host_key_unknown" and target.known_hosts:
        kind = "host_key_changed"  # accept-new takes every key it has not seen: a refusal is a key that changed
    where = target.destination + (":%d" % target.port if target.port else "")
    box = "box %s (%s)" % (target.name, where)
    alias = "%s is not in the inventory, so ssh read it as a host alias" % target.name
    if kind == "host_key_changed":
        if target.known_hosts:
            filed = target.host if not target.port or target.port == 22 else "[%s]:%d" % (target.host, target.port)
            seen = "since onbox recorded it in %s" % target.known_hosts
            fix = ("if you know the box is a new machine (re-rented or rebuilt at the same address), forget the "
                   "old key with `onboxctl box forget-key %s` (or `ssh-keygen -R '%s' -f %s`) and retry: the next "
                   "connection accepts and records the new one. If you do not know that, do not connect"
                   % (target.name, filed, target.known_hosts))
        else:
            seen = "since ssh recorded it"
            fix = ("if you know the box is a new machine, remove the old key from the known_hosts file ssh used%s "
                   "and retry. If you do not know that, do not connect"
                   % (": `%s`" % f.remove_with if f.remove_with else ""))
        return BoxUnreachable(
            "refusing to connect to %s: its host key CHANGED %s, so nothing was run there: either the box was "
            "re-rented or rebuilt at the same address, or someone is in the middle (ssh: %s)"
            % (box, seen, f.line), hint=fix, kind=kind)
    if kind == "host_key_unknown":
        hint = ("`ssh %s` once by hand to accept its key into your known_hosts, or add it to the inventory "
                "(`onboxctl box add %s --host ...`): onbox accepts an inventory box's key on first contact"
                % (target.host, target.name) if target.alias else
                "this box's own --ssh-option settings manage its host keys: add its key to the known_hosts file "
                "they name, or re-add the box without them (`onboxctl box add %s ... --replace`) and onbox accepts "
                "its key on first contact into its own known_hosts" % target.name)
        return BoxUnreachable("cannot reach %s: ssh does not know its host key and was told to refuse unknown ones "
                              "(%s)%s" % (box, f.line, "; " + alias if target.alias else ""), hint=hint, kind=kind)
    if kind == "auth":
        hint = ("give the key this box accepts: `onboxctl box add %s ... --identity ~/.ssh/KEY --replace`, or load "
                "it into your ssh agent (ssh-add); onboxctl uses keys only, never a password (BatchMode)" % target.name
                if not target.alias else
                "%s; give it an IdentityFile in ~/.ssh/config or load the key into your ssh agent (ssh-add): "
                "onboxctl uses keys only, never a password (BatchMode)" % alias)
        return BoxUnreachable("cannot reach %s: the box refused the login of %s: no key offered is authorised there "
                              "(%s)" % (box, target.user or "your user", f.line), hint=hint, kind=kind)
    if kind == "refused":
        return BoxUnreachable("cannot reach %s: nothing accepts ssh connections there (%s)" % (box, f.line),
                              hint="the box may still be booting or its sshd is down; or the port is wrong "
                                   "(rentals often map ssh to another port: compare the provider's connect "
                                   "command with `onboxctl box ls`)", kind=kind)
    if kind in ("timeout", "no_route"):
        return BoxUnreachable("cannot reach %s: %s (%s)" % (
            box, "no answer from it" if kind == "timeout" else "no route to it", f.line),
            hint="the box may be stopped or gone, or the network between here and there is down: check it is "
                 "running in your provider's console, then retry", kind=kind)
    if kind == "resolve":
        return BoxUnreachable("cannot reach %s: the name %s does not resolve (%s)" % (box, target.host, f.line),
                              hint="%s, and neither ~/.ssh/config nor DNS knows it: add it with `onboxctl box add "
                                   "%s --host ADDRESS`" % (alias, target.name) if target.alias else
                              "check the host of %s (`onboxctl box ls`), or this machine's DNS" % target.name,
                              kind=kind)
    if kind == "closed":
        return BoxUnreachable("cannot reach %s: the box closed the connection before the login (%s)" % (box, f.line),
                              hint="its sshd may be starting or overloaded (MaxStartups); retry in a moment",
                              kind=kind)
    return BoxUnreachable("cannot reach %s: %s" % (box, f.line),
                          hint=("check that the box is running and that `%s` works by hand (onboxctl uses keys "
                                "only, in BatchMode: give --identity or load the key into your ssh agent)"
                                % by_hand(target)) if not target.alias else
                          ("check that `ssh %s` works by hand (%s; keys only, in BatchMode: load them into your "
                           "agent)" % (target.host, alias)), kind=kind)
