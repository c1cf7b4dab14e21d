"""Thin click commands of `onbox`, one module per concept; each is imported only when used (fast `--version`).

clikit.py is what both CLIs (onbox and onboxctl) share: the lazy command group, the one mapping of domain errors
to a message, a hint and an exit code, and the JSON printer. This package is the only place in onbox that imports
click; nothing outside it (and onbox/cli.py) imports it.
"""
