"""The ONE reader of the environment variables that steer onbox itself (as shiv's bootstrap Environment does):
each variable is a typed, documented field, read from the mapping a caller was given (tests and the supervisor
pass their own; None means os.environ).

Three kinds of ONBOX_* variables, three owners:
- run knobs, one per RunConfig field (ONBOX_GRACE, ONBOX_SYNC_INTERVAL, ONBOX_TICK_INTERVAL, ...): read by
  onbox.config.env_overrides, the layer between flags and the run file;
- the child's contract (ONBOX_RUN, ONBOX_CKPT_DIR, ONBOX_RESUME_FROM, ...): written for the job by
  onbox.supervisor.childenv, never read by the agent (a nested onbox must not inherit its parent's run);
- everything else, here: where state lives, the box's name, the controller's settings.
onbox/platform/extractroot.py reads SHIV_* itself: it runs before onbox's libraries are unpacked.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

TRACKER_TOKEN_VAR = "ONBOX_TRACKER_TOKEN"  # the tracker's bearer token (the agent's sinks, onboxctl tracker serve)


@dataclasses.dataclass(frozen=True)
class Environment:
    home: Optional[str] = None  # ONBOX_HOME: where runs and secrets live (default ~/.onbox; onbox.paths)
    box: Optional[str] = None  # ONBOX_BOX: the box's name as onboxctl knows it; the hostname when unset
    tracker: Optional[str] = None  # ONBOX_TRACKER: the tracker URL (also the run knob `tracker`)
    tracker_token: Optional[str] = dataclasses.field(default=None, repr=False)  # ONBOX_TRACKER_TOKEN: a secret
    config_dir: Optional[str] = None  # ONBOX_CONFIG_DIR: onboxctl's inventory, tunnels, pulls, recoveries
    xdg_config_home: Optional[str] = None  # XDG_CONFIG_HOME: the config dir's parent when ONBOX_CONFIG_DIR is unset
    xdg_runtime_dir: Optional[str] = None  # XDG_RUNTIME_DIR: where ssh control sockets go first
    profiles_dir: Optional[str] = None  # ONBOX_PROFILES_DIR: the user's own platform profiles (onboxctl)
    pyz: Optional[str] = None  # ONBOX_PYZ: the onbox.pyz `onboxctl push` sends (default dist/onbox.pyz)
    # ONBOX_RCLONE_RCD: 0 makes every call to an rclone remote a process of its own instead of a request to one
    # long-lived `rclone rcd` (onbox/checkpoints/rcd.py)
    rclone_rcd: Optional[str] = None
    # the kaggle CLI's own variables, read by `onboxctl kaggle` to name the kernel's owner and to say, before the CLI
    # runs, whether it has credentials at all; the CLI reads them itself (they never go into its argv)
    kaggle_username: Optional[str] = None  # KAGGLE_USERNAME
    kaggle_key: Optional[str] = dataclasses.field(default=None, repr=False)  # KAGGLE_KEY: a secret
    kaggle_api_token: Optional[str] = dataclasses.field(default=None, repr=False)  # KAGGLE_API_TOKEN: a secret
    kaggle_config_dir: Optional[str] = None  # KAGGLE_CONFIG_DIR: where kaggle.json is (default ~/.kaggle)
    # ONBOX_SSH_CONNECT_TIMEOUT, _ALIVE_INTERVAL, _ALIVE_COUNT, _COMMAND_TIMEOUT, _CONTROL_DIR, _MULTIPLEX: raw
    # strings, checked where they are turned into ssh settings (controller/boxes/ssh.py)
    ssh: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # ONBOX_TUNNEL_WATCH, _POLL, _BACKOFF_MAX, _RUN_CHECK, _GIVE_UP: the tunnel supervisor's knobs, raw strings
    # checked where they are read (controller/boxes/tunnel.py WatchKnobs)
    tunnel: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(cls, environ: Optional[Mapping[str, str]] = None) -> "Environment":
        env = os.environ if environ is None else environ

        def get(name: str) -> Optional[str]:
            value = env.get(name)
            return value if value else None  # set but empty means unset, as a shell's `VAR= cmd` intends

        return cls(home=get("ONBOX_HOME"), box=get("ONBOX_BOX"), tracker=get("ONBOX_TRACKER"),
                   tracker_token=get(TRACKER_TOKEN_VAR), config_dir=get("ONBOX_CONFIG_DIR"),
                   xdg_config_home=get("XDG_CONFIG_HOME"), xdg_runtime_dir=get("XDG_RUNTIME_DIR"),
                   profiles_dir=get("ONBOX_PROFILES_DIR"), pyz=get("ONBOX_PYZ"), rclone_rcd=get("ONBOX_RCLONE_RCD"),
                   kaggle_username=get("KAGGLE_USERNAME"), kaggle_key=get("KAGGLE_KEY"),
                   kaggle_api_token=get("KAGGLE_API_TOKEN"), kaggle_config_dir=get("KAGGLE_CONFIG_DIR"),
                   ssh={k[len("ONBOX_SSH_"):].lower(): v for k, v in env.items()
                        if k.startswith("ONBOX_SSH_") and v},
                   tunnel={k[len("ONBOX_TUNNEL_"):].lower(): v for k, v in env.items()
                           if k.startswith("ONBOX_TUNNEL_") and v})
