"""The controller's own settings: $ONBOX_CONFIG_DIR/config.toml (default ~/.config/onbox/config.toml).

    tracker = "http://127.0.0.1:8787"        # where `onboxctl status` reads runs (ONBOX_TRACKER overrides)
    tracker_token_file = "~/.onbox/tracker/tracker.token"   # ONBOX_TRACKER_TOKEN overrides

Every value is checked where it is read: a wrong type or an unknown key is one line naming the file and the key.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from controller.boxes.inventory import config_dir
from onbox.environment import Environment
from onbox.errors import UsageError

KEYS = {"tracker": str, "tracker_token_file": str}


def path() -> str:
    return os.path.join(config_dir(), "config.toml")


def load() -> Dict[str, Any]:
    p = path()
    if not os.path.exists(p):
        return {}
    from onbox.tomlread import load_toml

    data = load_toml(p, "onboxctl config")
    for key, value in data.items():
        if key not in KEYS:
            raise UsageError("onboxctl config %s: unknown key %r" % (p, key),
                             hint="known keys: %s" % ", ".join(sorted(KEYS)))
        if not isinstance(value, KEYS[key]) or not value:
            raise UsageError("onboxctl config %s: %s must be a non-empty string, not %r" % (p, key, value),
                             hint='e.g. %s = "%s"' % (key, "http://127.0.0.1:8787" if key == "tracker"
                                                      else "~/.onbox/tracker/tracker.token"))
    return data


def check_tracker_url(url: str, source: str = "--tracker") -> str:
    """`url` when it is an http(s) URL with a host (and a port in range), else a UsageError naming `source`."""
    from urllib.parse import urlsplit

    from onbox.config import url_problem

    problem = url_problem(url) if isinstance(url, str) else "not a string"
    if not problem and any(c.isspace() or ord(c) < 32 for c in url):
        problem = "spaces or control characters in it"
    if not problem and urlsplit(url).username is not None:
        problem = "credentials in the URL (the token travels in a file, never in a URL)"
    if problem:
        raise UsageError("tracker URL %r (%s): %s" % (url, source, problem),
                         hint="give the tracker's base URL, e.g. http://127.0.0.1:8787")
    return url.rstrip("/")


def tracker_url(flag: Optional[str]) -> Optional[str]:
    """The tracker to read: --tracker, else $ONBOX_TRACKER, else config.toml's `tracker`; checked."""
    if flag is not None:
        return check_tracker_url(flag, "--tracker")
    env = Environment.read()
    if env.tracker:
        return check_tracker_url(env.tracker, "ONBOX_TRACKER")
    url = load().get("tracker")
    return check_tracker_url(url, "tracker in %s" % path()) if url else None


def tracker_token(flag_file: Optional[str]) -> Optional[str]:
    """The bearer token: --tracker-token-file, ONBOX_TRACKER_TOKEN, then the config's tracker_token_file."""
    token = Environment.read().tracker_token
    if not flag_file and token:
        return token.strip()
    p = flag_file or load().get("tracker_token_file")
    if not p:
        return None
    from onbox.fsutil import read_token_file

    try:
        token = read_token_file(str(p))  # the first line, as the tracker reads its own --token-file
    except OSError as e:
        raise UsageError("cannot read tracker token file %s: %s" % (p, getattr(e, "strerror", None) or e),
                         hint="the file holds the tracker's token on one line (mode 600)")
    if not token or any(ord(c) < 32 or ord(c) == 127 for c in token):
        raise UsageError("tracker token file %s %s" % (p, "is empty" if not token else "holds control characters"),
                         hint="the file holds the tracker's token on one line (mode 600)")
    return token
