"""Secret-looking files of a code directory that is about to leave this machine: `onboxctl kaggle push --code`
(packed into the kernel's script, which Kaggle stores with every version, for everyone to read with --public) and
`onboxctl push --code` (rsynced to a box: hardware someone else runs). One classifier for both, by name, and for a
file's first 64 KiB by a private key's PEM header: such a file is left out and named, unless the user names it
with --include-secret PATH (then it goes, and is named as sent).

By name (extensions compared in lower case):
- directories, with everything in them: `.git` (its config can carry credentials in remote URLs, its history a
  secret removed from the tree), `.ssh`, `.gnupg`, `.aws`, `.azure`, `.kube`, `.kaggle`, `.huggingface`, `.env`
  (and a code dir that is one of them itself: `--code ~/.ssh` sends nothing unasked);
- environment files: `.env`, `.env.*`, `.envrc`, `*.env`;
- keys and key stores: `*.pem` (but one holding certificates only: a CA bundle), `*.key`, `*.p12`, `*.pfx`,
  `*.ppk`, `*.jks`, `*.keystore`, `*.kdbx`, `*.ovpn`;
  ssh private keys `id_rsa`, `id_ed25519`, ... (with `_sk`, `-cert`, `_work`, `.bak` and the like) and `*_rsa`,
  `*_ed25519`, ...;
- credential files the tools that write them name so: `kaggle.json`, `.netrc`, `_netrc`, `.pgpass`, `.pypirc`,
  `.npmrc`, `.git-credentials`, `.dockercfg`, `.docker/config.json`, `.s3cfg`, `.boto`, `.htpasswd`, shell and
  REPL histories, Terraform state and variables;
- data files (no extension, or .json, .yaml, .toml, .ini, .cfg, .conf, .csv, .txt, .xml, .env, .properties) whose
  name holds the word `credentials`, starts with `secret(s)`, `client_secret(s)` or `service_account`, or is
  `token`, `access_token`, `hf_token`, `api_key`.

Precise on purpose, the other way too: code and data whose names merely look alike are files like any other:
`src/keyboard.py`, `environment.py`, `environment.yml`, `tokenizer.json`, `id_map.csv`, `id_rsa.pub`,
`credentials.py`, `secret_sauce.py`, `.env.example` (`.example`, `.sample`, `.template`, `.dist` mark a file
written to be published).
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from typing import Any, Dict, List, Optional, Sequence

from onbox import untrusted
from onbox.errors import UsageError

HEAD_BYTES = 64 * 1024  # how much of a file the PEM check reads: a private key is a few KiB, at the start
PEM_MAX_BYTES = 4 * 1024 * 1024  # a .pem read whole to see it holds certificates only (cacert.pem: ~300 KB)

SECRET_DIRS = {
    ".git": "a git directory (remote URLs with credentials, secrets in its history)",
    ".ssh": "an ssh directory (private keys)",
    ".gnupg": "a GnuPG home (private keys)",
    ".aws": "AWS credentials", ".azure": "Azure credentials", ".kube": "Kubernetes credentials",
    ".kaggle": "Kaggle credentials", ".huggingface": "a Hugging Face token",
    ".env": "an environment directory (env files, or a virtualenv)",
}
SECRET_NAMES = {
    "kaggle.json": "Kaggle API credentials",
    ".netrc": "login credentials (netrc)", "_netrc": "login credentials (netrc)",
    ".pgpass": "PostgreSQL passwords", ".pypirc": "PyPI credentials", ".npmrc": "npm credentials",
    ".git-credentials": "git credentials", ".dockercfg": "Docker registry credentials", ".s3cfg": "S3 credentials",
    ".boto": "cloud storage credentials (boto)", ".htpasswd": "password hashes",
    ".bash_history": "a shell history", ".zsh_history": "a shell history", ".sh_history": "a shell history",
    ".python_history": "a Python history", ".psql_history": "a psql history", ".mysql_history": "a MySQL history",
}
SECRET_EXTS = {
    ".pem": "a PEM file (private keys)", ".key": "a private key", ".p12": "a PKCS#12 key store",
    ".pfx": "a PKCS#12 key store", ".ppk": "a PuTTY private key", ".jks": "a Java key store",
    ".keystore": "a key store", ".kdbx": "a KeePass database", ".ovpn": "an OpenVPN profile (keys inside)",
    ".tfstate": "Terraform state (secrets in plain text)", ".tfvars": "Terraform variables",
}
DATA_EXTS = {"", ".json", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".csv", ".txt", ".xml", ".env",
             ".properties"}
PLACEHOLDER_WORDS = {"example", "examples", "sample", "template", "tmpl", "dist"}
SSH_KEY_RE = re.compile(r"^(id_(rsa|dsa|ecdsa|ed25519|xmss)(_sk)?(-cert)?([_-][a-z0-9]+)*"
                        r"(\.(old|bak|orig|backup|save|key|pem))?|[a-z0-9._-]+_(rsa|dsa|ecdsa|ed25519))$")
CREDENTIAL_RE = re.compile(r"^\.?(.*[._-])?credentials?([._-].*)?$"
                           r"|^\.?(secrets?|client_secrets?|service[-_]?account)([._-].*)?$"
                           r"|^\.?(token|access_token|hf_token|api[-_]?key)$")
# a PEM private key: its header at a line's start, then key material (a line of base64, after the armor headers
# of an encrypted or a PGP key); or the same inside a JSON string (a service account's key file). A header alone, as code that
# looks for keys spells it, is no key.
PRIVATE_KEY_RE = re.compile(rb"(?m)^-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----\r?\n"
                            rb"(?:[A-Za-z-]+:[^\r\n]*\r?\n)*(?:\r?\n)?[A-Za-z0-9+/=]{40,}"
                            rb'|"private_key"\s*:\s*"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----\\n[A-Za-z0-9+/=]{40,}')


def _placeholder(name: str) -> bool:
    return bool(PLACEHOLDER_WORDS & set(re.split(r"[._-]", name)))


def name_reason(name: str, parent: str = "") -> Optional[str]:
    """Why a file called `name` (in a directory called `parent`) looks like a secret, or None."""
    low = name.lower()
    if name in SECRET_NAMES:
        return SECRET_NAMES[name]
    if parent == ".docker" and name == "config.json":
        return "Docker registry credentials"
    if low.startswith(".env") or (low.endswith(".env") and len(low) > 4):
        return None if _placeholder(low) else "an environment file"
    if low.endswith(".tfstate.backup"):
        return SECRET_EXTS[".tfstate"]
    ext = posixpath.splitext(low)[1]
    if ext in SECRET_EXTS:
        return SECRET_EXTS[ext]
    if ext == ".pub":
        return None
    if SSH_KEY_RE.match(low):
        return "an ssh private key"
    if ext in DATA_EXTS and CREDENTIAL_RE.match(low[:len(low) - len(ext)]) and not _placeholder(low):
        return "credentials"
    return None


def content_reason(head: bytes) -> Optional[str]:
    """Why a file beginning with `head` (its first HEAD_BYTES) holds a secret, or None."""
    return "holds a private key (PEM)" if PRIVATE_KEY_RE.search(head) else None


def reason(rel: str, is_dir: bool = False, head: Optional[bytes] = None) -> Optional[str]:
    """Why the path `rel` (relative to the code dir, '/'-separated) looks like a secret, or None: a directory by
    its name, a file by being in such a directory, by its name, or by `head` when given."""
    parts = rel.split("/")
    for i, part in enumerate(parts if is_dir else parts[:-1]):
        if part in SECRET_DIRS:
            return SECRET_DIRS[part] if i == len(parts) - 1 else "in %s/: %s" % ("/".join(parts[:i + 1]),
                                                                                SECRET_DIRS[part])
    if is_dir:
        return None
    return name_reason(parts[-1], parts[-2] if len(parts) > 1 else "") or (
        content_reason(head) if head is not None else None)


def read_head(path: str, limit: int = HEAD_BYTES) -> bytes:
    """The first `limit` bytes of a regular file (opened without following a last-moment symlink; b"" when it
    cannot be read: the transfer that follows reports that in its own words)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return b""
    try:
        chunks, got = [], 0
        while got < limit:
            chunk = os.read(fd, min(1 << 20, limit - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    except OSError:
        return b""
    finally:
        os.close(fd)


def public_pem(path: str) -> bool:
    """A .pem file that holds certificates and no private key (a CA bundle such as certifi's cacert.pem, which a
    vendored package needs): read whole, up to PEM_MAX_BYTES; a larger one is not judged public."""
    data = read_head(path, PEM_MAX_BYTES + 1)
    return len(data) <= PEM_MAX_BYTES and b"-----BEGIN CERTIFICATE-----" in data and b"PRIVATE KEY" not in data


@dataclasses.dataclass(frozen=True)
class Finding:
    path: str  # relative to the code dir; a directory's ends with '/'
    why: str

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "why": self.why}


class Selection:
    """What of code dir `root` leaves this machine, decided path by path as a walk meets them (a directory before
    what is in it): `keep_dir` and `keep_file` say yes or no and record what was left out and what was sent on
    purpose. `include`: --include-secret values, relative to `root` (or absolute inside it)."""

    def __init__(self, root: str, include: Sequence[str] = (), flag: str = "--include-secret") -> None:
        self.root = root
        self.flag = flag
        self.include = {self._relative(p): p for p in include}
        # `--code ~/.ssh` itself: everything in it is as secret as it would be below a code dir
        top = os.path.basename(os.path.realpath(root))
        self.root_why = ("in %s/: %s" % (top, SECRET_DIRS[top])) if top in SECRET_DIRS else None
        self.left_out: List[Finding] = []
        self.included: List[Finding] = []
        self._used: set = set()

    def _relative(self, path: str) -> str:
        real_root = os.path.realpath(self.root)
        if os.path.isabs(path):
            real = os.path.realpath(path)
            if not untrusted.is_under(real, real_root) or real == real_root:
                raise UsageError("%s %s is not inside the code directory %s" % (self.flag, untrusted.printable(path),
                                                                               self.root),
                                 hint="give the path as the warning names it, relative to the code directory")
            path = os.path.relpath(real, real_root)
        rel = posixpath.normpath(path.replace(os.sep, "/")).strip("/")
        if rel in ("", ".") or rel == ".." or rel.startswith("../"):
            raise UsageError("%s %s names no file inside the code directory %s" % (
                self.flag, untrusted.printable(path), self.root),
                hint="give the path as the warning names it, relative to the code directory")
        return rel

    def _included(self, rel: str) -> Optional[str]:
        """The --include-secret value that covers `rel` (itself or a directory above it), or None."""
        parts = rel.split("/")
        for i in range(len(parts), 0, -1):
            if "/".join(parts[:i]) in self.include:
                return "/".join(parts[:i])
        return None

    def _use(self, cover: str, is_dir: bool, why: str) -> None:
        if cover not in self._used:
            self._used.add(cover)
            self.included.append(Finding(cover + ("/" if is_dir else ""), why))

    def keep_dir(self, rel: str) -> bool:
        """Whether to go into directory `rel`: no when it looks like a secret, is not included, and holds nothing
        included (then it is left out whole, and named once)."""
        why = reason(rel, is_dir=True)
        if why is None:
            return True
        cover = self._included(rel)
        if cover is not None:
            self._use(cover, True, why)
            return True
        if any(inc.startswith(rel + "/") for inc in self.include):
            return True  # only what is named in it goes; the rest is left out file by file
        self.left_out.append(Finding(rel + "/", why))
        return False

    def keep_file(self, rel: str, path: Optional[str] = None) -> bool:
        """Whether file `rel` goes; `path`, its local path, lets its content be looked at (a PEM private key under
        any name; a .pem of certificates only is no secret)."""
        why = reason(rel)
        if why is not None and path is not None and rel.lower().endswith(".pem") and public_pem(path):
            why = None
        if why is None and path is not None:
            why = content_reason(read_head(path))
        why = why or self.root_why
        if why is None:
            return True
        cover = self._included(rel)
        if cover is None:
            self.left_out.append(Finding(rel, why))
            return False
        self._use(cover, cover != rel, why)
        return True

    def finish(self) -> "Selection":
        """UsageError when an --include-secret named nothing that looks like a secret here (a typo, or a file that
        is not sent anyway): the user meant to send something, and it would not go."""
        unused = sorted(p for rel, p in self.include.items() if rel not in self._used)
        if unused:
            raise UsageError("%s %s names no secret-looking file that would be sent from %s" % (
                self.flag, untrusted.printable(unused[0]), self.root),
                hint="it takes the paths a push names as left out (a file that is sent anyway needs no flag)")
        return self

    def summary(self, what: str) -> List[str]:
        """The warning lines: what was left out and what was sent on purpose (names shown with printable())."""
        lines = []
        if self.left_out:
            lines.append("left out %d secret-looking path(s) of %s: %s; %s PATH sends one on purpose" % (
                len(self.left_out), what, "; ".join("%s (%s)" % (untrusted.printable(f.path), f.why)
                                                    for f in self.left_out), self.flag))
        if self.included:
            lines.append("sending secret-looking path(s) of %s as asked (%s): %s" % (
                what, self.flag, "; ".join("%s (%s)" % (untrusted.printable(f.path), f.why) for f in self.included)))
        return lines

    def to_dict(self) -> Dict[str, Any]:
        return {"secrets_left_out": [f.to_dict() for f in self.left_out],
                "secrets_included": [f.to_dict() for f in self.included]}
