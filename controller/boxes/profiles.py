"""The controller's view of platform profiles (profiles/*.toml, shipped in onbox): what stops the meter.

Profiles are owned by the foundation issue; this module only reads the money-affecting facts the teardown gate
shows, tolerant of where they sit in the file, and always with their `verified` date and source.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Dict, List, Optional

from onbox.environment import Environment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # controller/boxes/ -> the checkout
DEFAULT_PROFILE = "generic-ssh"


def _dirs() -> List[str]:
    out = []
    env = Environment.read().profiles_dir
    if env:
        out.append(env)
    out += [os.path.join(REPO, "profiles"), os.path.join(REPO, "onbox", "profiles")]
    return [d for d in out if os.path.isdir(d)]


def known_profiles() -> List[str]:
    names = set()
    for d in _dirs():
        for p in glob.glob(os.path.join(d, "*.toml")):
            base = os.path.splitext(os.path.basename(p))[0]
            if not base.startswith("_") and base != "schema":
                names.add(base)
    return sorted(names)


def load_profile(name: str) -> Optional[Dict[str, Any]]:
    """The profile NAME as onbox reads it (the user's $ONBOX_HOME/profiles/NAME.toml merged over the built-in one),
    else NAME.toml in ONBOX_PROFILES_DIR or the checkout; None when there is no profile of that name anywhere.

    A profile file that is there but refused (a FIFO, /dev/zero, too large, not TOML, not the schema) is onbox's
    UsageError naming it: falling back to the built-in profile would show a meter-stop verb the user overrode."""
    from onbox.platform import profiles as onbox_profiles
    from onbox.tomlread import load_toml

    family = name.partition("/")[0] + ".toml"
    if any(os.path.exists(os.path.join(d, family)) for d in (onbox_profiles.builtin_dir(), onbox_profiles.user_dir())):
        return onbox_profiles.load(name).to_dict()
    for d in _dirs():
        p = os.path.join(d, name + ".toml")
        if os.path.exists(p):
            return load_toml(p, "profile")
    return None


@dataclasses.dataclass
class MeterStop:
    profile: str
    verb: str
    irreversible: Optional[bool]
    verified: Optional[str]
    source: Optional[str]
    command: Optional[str]  # the platform CLI command that stops the meter, with {box}/{host} placeholders
    note: Optional[str] = None
    how: Optional[str] = None  # the profile's sentence on how to stop the meter (`[billing] teardown`)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _find(doc: Any, keys: List[str]) -> Any:
    """Depth-first search for the first of `keys` anywhere in a nested profile document."""
    if isinstance(doc, dict):
        for k in keys:
            if k in doc and not isinstance(doc[k], dict):
                return doc[k]
        for v in doc.values():
            r = _find(v, keys)
            if r is not None:
                return r
    return None


def meter_stop(name: Optional[str]) -> MeterStop:
    name = name or DEFAULT_PROFILE
    doc = load_profile(name)
    if doc is None:
        return MeterStop(profile=name, verb="unknown (no profile %r here)" % name, irreversible=None, verified=None,
                         source=None, command=None,
                         note="stop the box the way its platform does; a forgotten box bills 24/7",
                         how="To stop the meter, stop the box the way its platform does: no profile %r here says "
                             "how, and a forgotten box bills around the clock." % name)
    section = None
    for key in ("meter_stop", "billing", "teardown", "meter"):
        if isinstance(doc.get(key), dict):
            section = doc[key]
            break
    where = section if section is not None else doc
    verb = _find(where, ["verb", "meter_stop_verb", "meter_stop"]) or "manual"
    irrev = _find(where, ["irreversible", "meter_stop_irreversible"])
    verified = _find(where, ["verified", "verified_month"]) or _find(doc, ["verified", "verified_month"])
    source = _find(where, ["source", "sources"]) or _find(doc, ["source"])
    command = _find(where, ["command", "meter_stop_command", "cli"])
    note = _find(where, ["note", "notes"])
    how = _find(where, ["teardown"])
    return MeterStop(profile=name, verb=str(verb), irreversible=bool(irrev) if irrev is not None else None,
                     verified=str(verified) if verified is not None else None,
                     source=str(source) if source is not None else None,
                     command=str(command) if command else None, note=str(note) if note else None,
                     how=str(how) if how else None)
