"""What both CLIs share: a group that imports each command only when it is run (fast `--version`),
and the one place that turns a domain error into a message, a hint and an exit code."""
from __future__ import annotations

import importlib
import math
import sys
from typing import Any, Dict, List, Optional, Tuple

import click

from onbox.errors import ExitCode, OnboxError


class LazyGroup(click.Group):
    """A click group whose subcommands live in other modules and are imported on first use.

    `lazy` maps a command name to ("package.module", "attribute", "one-line help"): `--help` lists the names and
    help lines without importing anything heavy.
    """

    def __init__(self, *args: Any, lazy: Optional[Dict[str, Tuple[str, str, str]]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> List[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        if cmd_name in self.lazy:
            module, attr, _ = self.lazy[cmd_name]
            cmd = getattr(importlib.import_module(module), attr)
            if not isinstance(cmd, click.Command):
                raise TypeError("%s.%s is not a click command" % (module, attr))
            return cmd
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy:
                rows.append((name, self.lazy[name][2]))
            else:
                cmd = super().get_command(ctx, name)
                if cmd is not None and not cmd.hidden:
                    rows.append((name, cmd.get_short_help_str(limit=80)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class FiniteFloat(click.ParamType):
    """A float option that is a finite number inside [low, high]: click's FloatRange lets nan and inf through
    (every comparison with nan is false), and one `--grace nan` made `onbox stop` give up at once."""

    name = "float"

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail("%r is not a number" % (value,), param, ctx)
        if not (math.isfinite(number) and self.low <= number <= self.high):
            self.fail("%r is not a number from %g to %g" % (value, self.low, self.high), param, ctx)
        return number


def report_error(prog: str, err: OnboxError) -> int:
    """Print a domain error as `prog: message` (+ `hint: ...`) on stderr and return its exit code."""
    click.echo("%s: %s" % (prog, err.message), err=True)
    if err.hint:
        click.echo("hint: %s" % err.hint, err=True)
    return int(err.exit_code)


def run_cli(group: click.Group, prog: str, argv: Optional[List[str]] = None) -> None:
    """Invoke a click group; domain errors become one clean message and their exit code, never a traceback."""
    try:
        rv = group.main(args=argv, prog_name=prog, standalone_mode=False)
    except OnboxError as e:
        sys.exit(report_error(prog, e))
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(int(ExitCode.USAGE))
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        sys.exit(0)
    sys.exit(rv if isinstance(rv, int) else 0)


def echo_json(obj: Any) -> None:
    """The one JSON printer for `--json` output: stable key order, one document, strict JSON (a diverged loss is
    the string "NaN" or "Infinity", as the heartbeats carry it: a bare NaN would break `jq` and json.loads
    in other languages)."""
    import json  # here, not at the top: `--version` and `--help` print no JSON (start-up time, issue 2)

    from onbox.fsutil import json_safe

    click.echo(json.dumps(json_safe(obj), indent=2, sort_keys=True, default=str, allow_nan=False))
