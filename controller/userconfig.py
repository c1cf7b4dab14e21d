"""The controller's own settings: $ONBOX_CONFIG_DIR/config.toml (default ~/.config/onbox/config.toml).

    tracker = "http://127.0.0.1:8765"        # where `onboxctl status` reads runs (ONBOX_TRACKER overrides)
    tracker_token_file = "~/.config/onbox/tracker.token"   # ONBOX_TRACKER_TOKEN overrides
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from controller.boxes import config_dir
from onbox.errors import UsageError


def load() -> Dict[str, Any]:
    path = os.path.join(config_dir(), "config.toml")
    if not os.path.exists(path):
        return {}
    from onbox.tomlread import load_toml

    return load_toml(path, "onboxctl config")


def tracker_url(flag: Optional[str]) -> Optional[str]:
    return flag or os.environ.get("ONBOX_TRACKER") or load().get("tracker") or None


def tracker_token(flag_file: Optional[str]) -> Optional[str]:
    """The bearer token: --tracker-token-file, ONBOX_TRACKER_TOKEN, then the config's tracker_token_file."""
    if not flag_file and os.environ.get("ONBOX_TRACKER_TOKEN"):
        return os.environ["ONBOX_TRACKER_TOKEN"].strip()
    path = flag_file or load().get("tracker_token_file")
    if not path:
        return None
    try:
        with open(os.path.expanduser(str(path)), encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise UsageError("cannot read tracker token file %s: %s" % (path, e.strerror or e))
