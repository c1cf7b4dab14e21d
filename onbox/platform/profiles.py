"""Platform profiles: what a box's platform means for a run (profiles/<name>.toml, shipped inside onbox.pyz).

A profile records the meter-stop verb and whether it is irreversible, the preemption signal and grace, the cloud
notice source, the fast and durable paths, the inode cap, the SSH user, the environment the job needs and the
gotchas that apply. Platforms change billing verbs and paths: every money-affecting table ([billing],
[preemption], [paths]) carries `source` and `verified` (YYYY-MM), and `onbox profiles show` prints them.

Lookup order for NAME: a user file ($ONBOX_HOME/profiles/NAME.toml, or --profile-file) deep-merged over the
built-in one; a user file may also define a new profile. Built-ins live in onbox/_profiles/ inside the pyz
(build/zipapp.py copies them there) and in the repository's profiles/ in a checkout.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from onbox.errors import UsageError

ONBOX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file is onbox/platform/profiles.py
PACKAGE_DIR = os.path.join(ONBOX_DIR, "_profiles")
REPO_DIR = os.path.join(os.path.dirname(ONBOX_DIR), "profiles")
DEFAULT_PROFILE = "generic-ssh"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
MONTH_RE = re.compile(r"^20\d\d-(0[1-9]|1[0-2])$")
GOTCHA_RE = re.compile(r"^U\d{1,2}$")
NOTICE_SOURCES = ("aws", "gcp", "azure", "none")
CONFIDENCE = ("hands-on", "documented", "unconfirmed")

# --- the schema: table -> key -> (accepted types, required). `None` as a table means "free-form str -> str".
STR, BOOL, INT, NUM, LIST, TABLE = (str,), (bool,), (int,), (int, float), (list,), (dict,)
MONEY = {"source": (STR, True), "verified": (STR, True), "confidence": (STR, False), "note": (STR, False)}
SCHEMA: Dict[str, Dict[str, Tuple[Tuple[type, ...], bool]]] = {
    "": {"name": (STR, True), "title": (STR, True), "kind": (STR, True), "description": (STR, False),
         "gotchas": (LIST, False), "notes": (LIST, False), "detect": (TABLE, False), "billing": (TABLE, True),
         "preemption": (TABLE, True), "paths": (TABLE, True), "ssh": (TABLE, False), "env": (TABLE, False),
         "hooks": (TABLE, False), "run": (TABLE, False), "platforms": (TABLE, False), "session": (TABLE, False),
         "accelerators": (TABLE, False)},
    "detect": {"env": (LIST, False), "paths": (LIST, False), "files": (LIST, False), "priority": (INT, False)},
    # teardown: one sentence on how to stop the meter on this platform (`onboxctl down` prints it once the gate passes)
    "billing": dict(MONEY, meter_stop=(STR, True), irreversible=(BOOL, True), teardown=(STR, False)),
    "preemption": dict(MONEY, signal=(STR, True), grace_seconds=(NUM, False), notice_source=(STR, True),
                       signal_lead=(NUM, False)),  # Slurm: seconds before the time limit for --signal (sbatch)
    "paths": dict(MONEY, fast=(STR, True), durable=(STR, True), inode_cap=(INT, False)),
    "ssh": {"user": (STR, True), "port": (INT, False)},
    # a session that ends on a clock (Kaggle): its hours from the session's start become the run's deadline
    # (onbox/launch/deadline.py); tpu_hours when one of tpu_env's variables is set
    "session": dict(MONEY, hours=(NUM, True), tpu_hours=(NUM, False), tpu_env=(LIST, False)),
    # the accelerators a notebook platform offers by name (Kaggle's machine shapes), with where that list was read
    "accelerators": dict(MONEY, names=(LIST, True)),
    "hooks": {"proxy": (STR, False), "proxy_note": (STR, False)},
}
# A sub-platform (the china family's four) may override these tables and keys.
PLATFORM_KEYS = ("title", "notes", "detect", "billing", "preemption", "paths", "ssh", "env", "hooks", "run",
                 "session", "accelerators")


@dataclasses.dataclass
class Profile:
    name: str
    data: Dict[str, Any]
    files: List[str]  # the built-in file and any user file merged over it

    def table(self, key: str) -> Dict[str, Any]:
        value = self.data.get(key)
        return dict(value) if isinstance(value, dict) else {}

    def run_defaults(self) -> Dict[str, Any]:
        """RunConfig keys this platform implies (the `profile` layer of config.resolve)."""
        pre = self.table("preemption")
        out: Dict[str, Any] = {"notice_source": pre["notice_source"]}
        if pre.get("grace_seconds") is not None:
            out["grace"] = float(pre["grace_seconds"])
        if self.table("env"):
            out["env"] = {str(k): str(v) for k, v in self.table("env").items()}
        out.update(self.table("run"))
        return out

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.data, files=list(self.files))


def builtin_dir() -> str:
    """onbox/_profiles inside the pyz; the repository's profiles/ in a checkout."""
    return PACKAGE_DIR if os.path.isdir(PACKAGE_DIR) else REPO_DIR


def user_dir() -> str:
    from onbox.paths import onbox_home

    return os.path.join(onbox_home(), "profiles")


def builtin_names() -> List[str]:
    try:
        return sorted(f[:-5] for f in os.listdir(builtin_dir()) if f.endswith(".toml"))
    except OSError:
        return []


def _problem(path: str, key: str, problem: str) -> UsageError:
    return UsageError("profile %s: %s: %s" % (path, key or "(top level)", problem),
                      hint="fix the profile file; `onbox profiles show NAME` prints a valid one")


def _check_table(path: str, where: str, table: Mapping[str, Any], spec: Dict[str, Tuple[Tuple[type, ...], bool]],
                 partial: bool) -> None:
    for key, value in table.items():
        full = "%s.%s" % (where, key) if where else key
        if key not in spec:
            raise _problem(path, full, "unknown key (known: %s)" % ", ".join(sorted(spec)))
        types, _ = spec[key]
        if isinstance(value, bool) and bool not in types:
            raise _problem(path, full, "expected %s, got a boolean" % "/".join(t.__name__ for t in types))
        if not isinstance(value, types):
            raise _problem(path, full, "expected %s, got %s" % ("/".join(t.__name__ for t in types),
                                                                type(value).__name__))
    if not partial:
        for key, (_, required) in spec.items():
            if required and key not in table:
                raise _problem(path, "%s.%s" % (where, key) if where else key, "missing (required)")


def _check_values(path: str, prefix: str, data: Mapping[str, Any]) -> None:
    """Value rules beyond types: months, notice sources, signals, gotcha ids, RunConfig keys."""
    from onbox.config import RunConfig, parse_signal

    for table in ("billing", "preemption", "paths", "session", "accelerators"):
        t = data.get(table) or {}
        if "verified" in t and not MONTH_RE.fullmatch(t["verified"]):
            raise _problem(path, prefix + table + ".verified", "expected a month YYYY-MM, not %r" % t["verified"])
        if "confidence" in t and t["confidence"] not in CONFIDENCE:
            raise _problem(path, prefix + table + ".confidence", "expected one of %s" % "|".join(CONFIDENCE))
    pre = data.get("preemption") or {}
    if "notice_source" in pre and pre["notice_source"] not in NOTICE_SOURCES:
        raise _problem(path, prefix + "preemption.notice_source",
                       "expected one of %s, not %r" % ("|".join(NOTICE_SOURCES), pre["notice_source"]))
    if pre.get("signal"):
        try:
            parse_signal(pre["signal"], "signal")
        except UsageError as e:
            raise _problem(path, prefix + "preemption.signal", e.message)
    for key, high in (("grace_seconds", 86400), ("signal_lead", 65535)):
        value = pre.get(key)
        if value is not None and not (math.isfinite(value) and 0 <= value <= high):
            raise _problem(path, prefix + "preemption." + key, "must be a number from 0 to %d, not %r" % (high, value))
    session = data.get("session") or {}
    for key in ("hours", "tpu_hours"):
        value = session.get(key)
        if value is not None and not (math.isfinite(value) and 0 < value <= 24 * 366):
            raise _problem(path, prefix + "session." + key, "must be a number of hours from 0 to 8784, not %r"
                           % (value,))
    if not all(isinstance(v, str) for v in session.get("tpu_env") or []):
        raise _problem(path, prefix + "session.tpu_env", "expected a list of strings")
    if not all(isinstance(v, str) for v in (data.get("accelerators") or {}).get("names") or []):
        raise _problem(path, prefix + "accelerators.names", "expected a list of strings")
    for g in data.get("gotchas") or []:
        if not isinstance(g, str) or not GOTCHA_RE.fullmatch(g):
            raise _problem(path, prefix + "gotchas", "expected ids like \"U7\", not %r" % (g,))
    for key in ("notes",):
        if not all(isinstance(n, str) for n in data.get(key) or []):
            raise _problem(path, prefix + key, "expected a list of strings")
    for key, value in (data.get("env") or {}).items():
        if not isinstance(value, str):
            raise _problem(path, "%senv.%s" % (prefix, key), "expected a string")
    det = data.get("detect") or {}
    for key in ("env", "paths"):
        if not all(isinstance(v, str) for v in det.get(key) or []):
            raise _problem(path, prefix + "detect." + key, "expected a list of strings")
    for item in det.get("files") or []:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(v, str) for v in item)):
            raise _problem(path, prefix + "detect.files", "expected [path, text] pairs, not %r" % (item,))
    if data.get("run"):
        try:
            RunConfig.from_dict(data["run"], source="run").validate()
        except UsageError as e:
            raise _problem(path, prefix + "run", e.message)


def validate(data: Mapping[str, Any], path: str, partial: bool = False) -> None:
    """Raise UsageError naming the file, the key and the problem. `partial`: a user override file."""
    _check_table(path, "", data, SCHEMA[""], partial)
    for table, spec in SCHEMA.items():
        if table and isinstance(data.get(table), dict):
            _check_table(path, table, data[table], spec, partial)
    if not partial and not NAME_RE.fullmatch(data["name"]):
        raise _problem(path, "name", "use lowercase letters, digits and '-', not %r" % data["name"])
    _check_values(path, "", data)
    for sub, body in (data.get("platforms") or {}).items():
        where = "platforms.%s" % sub
        if not isinstance(body, dict):
            raise _problem(path, where, "expected a table")
        for key in body:
            if key not in PLATFORM_KEYS:
                raise _problem(path, "%s.%s" % (where, key), "unknown key (known: %s)" % ", ".join(PLATFORM_KEYS))
        for table, spec in SCHEMA.items():
            if table and isinstance(body.get(table), dict):
                _check_table(path, "%s.%s" % (where, table), body[table], spec, partial=True)
        _check_values(path, where + ".", body)


def _merge(base: Dict[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read(path: str) -> Dict[str, Any]:
    """A profile file through load_toml (a regular file of at most 4 MiB, 64 levels deep), with a profile's hint."""
    from onbox.tomlread import load_toml

    try:
        return load_toml(path, "profile")
    except UsageError as e:
        if path.startswith(user_dir() + os.sep):
            e.hint = "%s; or remove %s to use the built-in profile" % (e.hint or "fix it", path)
        raise


def load(name: str, profile_file: Optional[str] = None) -> Profile:
    """The profile NAME (built-in, then the user's file merged over it); `name` may be "family/sub"."""
    family, _, sub = name.partition("/")
    builtin = os.path.join(builtin_dir(), family + ".toml")
    user = profile_file or os.path.join(user_dir(), family + ".toml")
    files: List[str] = []
    data: Dict[str, Any] = {}
    if os.path.exists(builtin):
        data = _read(builtin)
        validate(data, builtin)
        files.append(builtin)
    if os.path.exists(user) or profile_file:
        over = _read(user)
        validate(over, user, partial=bool(data))
        data = _merge(data, over)
        files.append(user)
        validate(data, user)
    if not files:
        raise UsageError("unknown profile %r" % name,
                         hint="known profiles: %s (or put one in %s)" % (", ".join(builtin_names()), user_dir()))
    if sub:
        platforms = data.get("platforms") or {}
        if sub not in platforms:
            raise UsageError("profile %s has no platform %r" % (family, sub),
                             hint="platforms of %s: %s" % (family, ", ".join(sorted(platforms)) or "none"))
        data = _merge({k: v for k, v in data.items() if k != "platforms"}, platforms[sub])
        data["name"] = "%s/%s" % (family, sub)
    return Profile(name=data["name"] if sub else family, data=data, files=files)


def load_all() -> List[Profile]:
    return [load(n) for n in builtin_names()]


def _matches(detect: Mapping[str, Any], environ: Mapping[str, str], root: str,
             exists: Callable[[str], bool]) -> Optional[str]:
    """The evidence that a detect table matches, or None."""
    for var in detect.get("env") or []:
        if environ.get(var):
            return "$%s is set" % var
    for path in detect.get("paths") or []:
        if exists(os.path.join(root, path.lstrip("/"))):
            return "%s exists" % path
    for path, text in detect.get("files") or []:
        try:
            with open(os.path.join(root, path.lstrip("/")), encoding="utf-8", errors="replace") as f:
                if text in f.read(4096):
                    return "%s mentions %r" % (path, text)
        except OSError:
            continue
    return None


def detect(environ: Optional[Mapping[str, str]] = None, root: str = "/",
           exists: Callable[[str], bool] = os.path.exists) -> Tuple[str, str]:
    """(profile name, evidence) for the box this runs on; DEFAULT_PROFILE when nothing matches.

    Profiles are tried by descending [detect].priority; a family's sub-platforms before the family itself.
    `root` prefixes every path probed (tests use fixture trees).
    """
    environ = os.environ if environ is None else environ
    ranked = sorted(load_all(), key=lambda p: (-int(p.table("detect").get("priority", 0)), p.name))
    for prof in ranked:
        for sub, body in sorted((prof.data.get("platforms") or {}).items()):
            why = _matches(body.get("detect") or {}, environ, root, exists)
            if why:
                return "%s/%s" % (prof.name, sub), why
        why = _matches(prof.table("detect"), environ, root, exists)
        if why:
            return prof.name, why
    return DEFAULT_PROFILE, "nothing platform-specific found"


def select(name: Optional[str] = None, profile_file: Optional[str] = None,
           environ: Optional[Mapping[str, str]] = None) -> Tuple[Profile, str]:
    """The profile a command should use and why: NAME when given (--profile), else the detected one.

    This is what `onbox run --profile` / `onbox audit` call; `profile.run_defaults()` is the profile layer of
    config.resolve().
    """
    if name:
        return load(name, profile_file), "--profile"
    detected, why = detect(environ)
    return load(detected, profile_file), why
