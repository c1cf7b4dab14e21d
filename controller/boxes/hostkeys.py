"""onbox's own known_hosts ($ONBOX_CONFIG_DIR/known_hosts): where inventory boxes' host keys are kept.

ssh itself writes it: an inventory box is reached with `StrictHostKeyChecking=accept-new` against this file
(controller/boxes/ssh.py), so a box met for the first time is accepted and its key recorded, and a box whose key has
CHANGED since is refused (a re-rented machine at the same address, or someone in the middle). Nothing here ever
accepts a changed key: `onboxctl box forget-key NAME` removes the old one, on the user's word, and the next
connection records the new one.

A box whose own ssh options manage host keys (StrictHostKeyChecking, UserKnownHostsFile, ...) and a name that is
not in the inventory (an ssh host alias) keep ssh's own files, which onbox never edits.
"""
from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
from typing import Any, Dict, List, Optional

from controller.boxes.inventory import Box, known_hosts_path
from controller.boxes.ssh import Ssh, manages_host_keys
from onbox.errors import UnfitError, UsageError
from onbox.toolrun import Says, Tool

SSH_KEYGEN = Tool("ssh-keygen", UnfitError,
                  missing=Says("ssh-keygen is not installed on this machine",
                               "install the OpenSSH client (apt-get install openssh-client)", error=UnfitError))
SSH_G = Tool("ssh", UnfitError, missing=Says("ssh is not installed on this machine",
                                              "install the OpenSSH client (apt-get install openssh-client)",
                                              error=UnfitError))


@dataclasses.dataclass
class Forgotten:
    box: str
    known_hosts: str
    hosts: List[str]  # the names the box's key is filed under (`[host]:port`, or its HostKeyAlias)
    fingerprints: List[str]  # one `NAME TYPE SHA256:...` line per key removed; empty when none was known

    def to_dict(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), forgotten=len(self.fingerprints))


def lookup_names(ssh: Ssh, box: Box) -> List[str]:
    """The names ssh files this box's key under: `ssh -G` resolves HostName, Port and HostKeyAlias as a
    connection would (an inventory host may be an alias of ~/.ssh/config). A local computation, no network."""
    target = box.target()
    argv = ["ssh", "-G", *ssh.options(target), "-T", "--", target.destination]
    res = SSH_G.run(argv, 10.0, check=False, stdin=subprocess.DEVNULL, what="ssh -G")
    conf: Dict[str, str] = {}
    for line in (res.stdout or "").splitlines() if res.returncode == 0 else []:
        key, _, value = line.partition(" ")
        conf.setdefault(key.lower(), value.strip())
    if conf.get("hostkeyalias") and conf["hostkeyalias"].lower() != "none":
        return [conf["hostkeyalias"]]
    host = conf.get("hostname") or box.host
    port = conf.get("port") or str(box.port or 22)
    return [host if port == "22" else "[%s]:%s" % (host, port)]


def check_file(path: str) -> bool:
    """Whether onbox's known_hosts exists; refused when it is something other than a regular file (a FIFO would
    hang ssh-keygen, a device would feed it forever)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise UsageError("cannot read onbox's known_hosts %s: %s" % (path, e.strerror or e))
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a symlink" if stat.S_ISLNK(st.st_mode) else \
            "not a regular file"
        raise UsageError("onbox's known_hosts %s is %s" % (path, kind),
                         hint="move it aside: ssh recreates it, and each inventory box's key is accepted again on "
                              "its next contact")
    return True


def forget_host_key(ssh: Ssh, box: Box) -> Forgotten:
    """Remove `box`'s host key(s) from onbox's known_hosts (the next connection accepts the box's current key).
    Refused for a box whose host keys are not onbox's to edit."""
    if not box.in_inventory:
        raise UsageError("box %s is not in the inventory: its host key is in ssh's own known_hosts, which onbox "
                         "does not edit" % box.name,
                         hint="`ssh-keygen -R HOST` removes it there; `onboxctl box ls` lists the inventory")
    if manages_host_keys(box.options):
        own = next((o.partition("=")[2] for o in box.options
                    if o.partition("=")[0].strip().lower() == "userknownhostsfile"), None)
        raise UsageError("box %s keeps its host keys where its own ssh options say (%s), not in onbox's known_hosts"
                         % (box.name, ", ".join(o for o in box.options if manages_host_keys([o]))),
                         hint="remove the old key there: `ssh-keygen -R '[%s]:%d'%s`" % (
                             box.host, box.port or 22, " -f %s" % own if own else ""))
    path = box.known_hosts or known_hosts_path()
    names = lookup_names(ssh, box)
    prints: List[str] = []
    if check_file(path):
        for name in names:
            found = SSH_KEYGEN.run(["ssh-keygen", "-l", "-F", name, "-f", path], 30.0, check=False,
                                   stdin=subprocess.DEVNULL, what="ssh-keygen -F")
            got = [ln.strip() for ln in (found.stdout or "").splitlines() if ln.strip() and not ln.startswith("#")]
            if found.returncode != 0 or not got:
                continue
            gone = SSH_KEYGEN.run(["ssh-keygen", "-R", name, "-f", path], 30.0, check=False,
                                  stdin=subprocess.DEVNULL, what="ssh-keygen -R")
            if gone.returncode != 0:
                raise UnfitError("ssh-keygen could not remove %s from %s: %s" % (
                    name, path, (gone.stderr or gone.stdout or "").strip()[-300:] or "exit %d" % gone.returncode))
            prints += got
    return Forgotten(box=box.name, known_hosts=path, hosts=names, fingerprints=prints)


def known_fingerprints(ssh: Ssh, box: Box) -> Optional[List[str]]:
    """The keys onbox's known_hosts holds for `box` (None when the box's keys are not onbox's)."""
    if not box.in_inventory or manages_host_keys(box.options):
        return None
    path = box.known_hosts or known_hosts_path()
    if not check_file(path):
        return []
    out: List[str] = []
    for name in lookup_names(ssh, box):
        found = SSH_KEYGEN.run(["ssh-keygen", "-l", "-F", name, "-f", path], 30.0, check=False,
                               stdin=subprocess.DEVNULL, what="ssh-keygen -F")
        out += [ln.strip() for ln in (found.stdout or "").splitlines() if ln.strip() and not ln.startswith("#")]
    return out
