"""What both CLIs share: a group that imports each command only when it is run (fast `--version`), a help layout
that starts with what to type (LaidOut: usage, examples, the common options, the rest under headings),
and the one place that turns a domain error into a message, a hint and an exit code."""
from __future__ import annotations

import importlib
import inspect
import math
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from onbox.errors import ExitCode, OnboxError, UsageError


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


class PathValue(click.ParamType):
    """Every path option and argument of the agent's commands: a value that is an option (`--`, `-x`, `--durable`)
    or nothing is refused, naming the flag, before it can be taken for a path. An unset variable does that:
    `--durable $UNSET -- cmd` made `--` the durable dir (`<cwd>/--`: every commit went to the local disk),
    `--ckpt-dir $UNSET --durable D` made `--durable` the checkpoint dir and D the command. `checks`: click's own
    Path checks where the option had them (dir_okay, exists, ...). `stdin_dash`: `-` alone is a value
    (`--node-group -`: read it from stdin)."""

    name = "path"

    def __init__(self, checks: Optional[click.Path] = None, stdin_dash: bool = False) -> None:
        self.checks, self.stdin_dash = checks, stdin_dash
        self.name = checks.name if checks is not None else "path"  # the metavar --help shows (FILE, DIRECTORY)

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if isinstance(value, str) and option_like(value, self.stdin_dash):
            label = param_label(param)
            raise UsageError("%s needs a value: got %r (an unset variable?)" % (label, value),
                             hint=PATH_VALUE_HINT % ((label + " ") if label.startswith("-") else ""))
        if isinstance(value, str) and "\0" in value:  # no argv carries one, but os.stat would raise on it
            raise UsageError("%s: the path holds a NUL byte, which no path can carry" % param_label(param))
        return self.checks.convert(value, param, ctx) if self.checks is not None else value


PATH_VALUE_HINT = ("give it a path; from a variable, quote it and check that it is set (%s\"$DIR\"); a path that "
                   "starts with a dash goes as ./-name")


def option_like(value: str, stdin_dash: bool = False) -> bool:
    """True when `value` cannot be a path option's value: nothing, blanks, or an option (`-` alone is stdin where
    `stdin_dash`)."""
    return not value.strip() or (value.startswith("-") and not (stdin_dash and value == "-"))


def param_label(param: Optional[click.Parameter]) -> str:
    """How a message names a parameter: its long flag (`--durable`), or an argument's metavar (`DIRECTORY`)."""
    if param is None:
        return "the path"
    opts = getattr(param, "opts", None) or []
    if isinstance(param, click.Option) and opts:
        return max(opts, key=len)
    return (param.name or "PATH").upper()


def report_error(prog: str, err: OnboxError) -> int:
    """Print a domain error as `prog: message` (+ `hint: ...`) on stderr and return its exit code."""
    from onbox.untrusted import printable

    # a message may carry a name from outside (a checkpoint's, a lease holder's): no terminal escapes from it
    click.echo(printable("%s: %s" % (prog, err.message), keep_newlines=True), err=True)
    if err.hint:
        click.echo(printable("hint: %s" % err.hint, keep_newlines=True), err=True)
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


def echo_line(text: str, err: bool = False) -> None:
    """One line of text output that carries names or text from outside (a checkpoint name from durable storage or
    the trainer's dir, a lease holder, the trainer's last words): its control characters shown as escapes
    (onbox.untrusted.printable), so that none can forge a line of its own or drive the terminal. --json output
    stays exact (echo_json)."""
    from onbox.untrusted import printable

    click.echo(printable(text), err=err)


def echo_json(obj: Any) -> None:
    """The one JSON printer for `--json` output: stable key order, one document, strict JSON (a diverged loss is
    the string "NaN" or "Infinity", as the heartbeats carry it: a bare NaN would break `jq` and json.loads
    in other languages)."""
    import json  # here, not at the top: `--version` and `--help` print no JSON (start-up time, issue 2)

    from onbox.fsutil import json_safe

    click.echo(json.dumps(json_safe(obj), indent=2, sort_keys=True, default=str, allow_nan=False))


class LaidOut(click.Command):
    """A command whose `--help` starts with what to type: the usage line, the first paragraph of its help, its
    examples, the common options, then the rest under headings, then the other paragraphs (exit codes, ...).

    `examples`: command lines shown as written. `sections`: (heading, [flag, ...]) in the order shown; an option no
    section names is a common one, listed first under "Options". A flag a section names that the command lacks is an
    error when the help is drawn (a renamed option cannot silently drop out of its heading). `usage`: the text after
    the command's path on the usage line (default: click's). `renamed_values`: {old: new} for an option whose value
    moved to another one: `old NUMBER` (or `old=NUMBER`) is read as `new NUMBER` with a warning, while `old` alone
    stays what it is now (`onbox stop --wait 30` is `--timeout 30`; `--wait` is a flag).
    """

    def __init__(self, *args: Any, examples: Sequence[str] = (), sections: Sequence[Tuple[str, Sequence[str]]] = (),
                 usage: Optional[str] = None, renamed_values: Optional[Dict[str, str]] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.examples = list(examples)
        self.sections = [(heading, list(flags)) for heading, flags in sections]
        self.usage = usage
        self.renamed_values = dict(renamed_values or {})

    def parse_args(self, ctx: click.Context, args: List[str]) -> List[str]:
        return super().parse_args(ctx, renamed(args, self.renamed_values, ctx.find_root().info_name or ""))

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.usage is None:
            super().format_usage(ctx, formatter)
        else:
            formatter.write_usage(ctx.command_path, self.usage)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.format_usage(ctx, formatter)
        text = inspect.cleandoc(self.help or "").split("\f")[0]
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        if paragraphs:
            formatter.write_paragraph()
            with formatter.indentation():
                formatter.write_text(paragraphs[0])
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:
                    formatter.write("%*s%s\n" % (formatter.current_indent, "", line))
        for heading, rows in self.option_sections(ctx):
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)
        if paragraphs[1:]:
            formatter.write_paragraph()
            with formatter.indentation():
                formatter.write_text("\n\n".join(paragraphs[1:]))
        self.format_epilog(ctx, formatter)

    def option_sections(self, ctx: click.Context) -> List[Tuple[str, List[Tuple[str, str]]]]:
        """(heading, help rows) in the order --help shows them: "Options" (the common ones) first."""
        by_flag: Dict[str, click.Parameter] = {}
        for param in self.get_params(ctx):
            for flag in getattr(param, "opts", []) + getattr(param, "secondary_opts", []):
                by_flag[flag] = param
        placed: Dict[str, str] = {}
        for heading, flags in self.sections:
            for flag in flags:
                if flag not in by_flag:
                    raise ValueError("%s --help: section %r names %s, which the command does not have" % (
                        ctx.command_path, heading, flag))
                placed[by_flag[flag].name or flag] = heading
        rows: Dict[str, List[Tuple[str, str]]] = {"Options": []}
        rows.update((heading, []) for heading, _ in self.sections)
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                rows[placed.get(param.name or "", "Options")].append(record)
        return list(rows.items())


def renamed(args: List[str], renames: Dict[str, str], prog: str) -> List[str]:
    """`args` with each `OLD NUMBER` / `OLD=NUMBER` (before a `--`) rewritten as `NEW NUMBER`, saying so on stderr;
    `OLD` followed by anything else is left alone (it is a flag now)."""
    if not renames:
        return args
    out: List[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        old, eq, value = arg.partition("=")
        if old in renames and not eq and i + 1 < len(args) and _number(args[i + 1]):
            eq, value = "=", args[i + 1]
            i += 1
        if old in renames and eq:
            click.echo("%s: warning: `%s %s` is deprecated: it is `%s %s` now (%s alone is a flag)" % (
                prog, old, value, renames[old], value, old), err=True)
            out += [renames[old], value]
        else:
            out.append(arg)
        i += 1
    return out


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
