"""Boxes and how onboxctl reaches them: the inventory, OpenSSH and rsync, the host keys, what ssh's failures mean,
the platform facts that stop a box's meter, the questions put to a box's agent, and the reverse tunnels that carry
beats home.

  inventory.py    boxes.toml: the boxes, their pools, prices and profiles; the config dir
  ssh.py          the OpenSSH / rsync seam: every remote call goes through it (master connections, timeouts)
  sshfail.py      what ssh's exit 255 means (its stderr classified) and what fixes it
  hostkeys.py     onbox's own known_hosts for inventory boxes
  agent.py        asking a box's agent (`onbox ... --json` over ssh); where onbox's files live on a box
  profiles.py     the profiles' money-affecting facts: what stops the meter
  tunnel.py       reverse tunnels to a tracker on this machine, and their records
  tunnelwatch.py  TunnelWatcher: one background process per recorded tunnel, which keeps it up

The floor of the controller: May import controller.goodput (a box's price) and onbox's library (never its
commands); every other room of the controller imports it.
"""
