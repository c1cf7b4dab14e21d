"""`--help` starts with what to type (onbox/clikit.py LaidOut: usage, examples, the common options, the rest under
headings, every option still listed), and the two CLIs agree on the flags they share: a flag in one is a flag in
the other (`onbox stop --wait` took a number, `onboxctl stop --wait` was a flag). Both CLIs' click commands are
walked as they are, so a new command or option is checked without a list here."""
from __future__ import annotations

import shlex
from typing import Dict, Iterator, List, Tuple

import click
import pytest
from click.testing import CliRunner

from controller.cli import cli as ctl_cli
from controller.launch import stop as ctl_stop
from onbox.cli import cli as onbox_cli
from onbox.clikit import LaidOut, renamed
from onbox.errors import JobFailed
from tests.unit.test_controller_stop import ASKED, BOX, ENDED, FakeClock, answer, statuses


def commands(group: click.Group, prefix: Tuple[str, ...] = ()) -> Iterator[Tuple[str, click.Command]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), cmd


def options(cmd: click.Command) -> Dict[str, click.Option]:
    return {flag: p for p in cmd.params if isinstance(p, click.Option) for flag in p.opts + p.secondary_opts}


def help_of(group: click.Group, argv: List[str]) -> str:
    r = CliRunner().invoke(group, [*argv, "--help"], terminal_width=80)
    assert r.exit_code == 0, r.output
    return r.output


EVERY = [(prog, group, name, cmd) for prog, group in (("onbox", onbox_cli), ("onboxctl", ctl_cli))
         for name, cmd in commands(group)]
HEADINGS_FROM = 8  # a command with no more options than this lists them all under "Options"


def example_args(prog: str, name: str, example: str) -> List[str]:
    """An example line's arguments after `prog name` (a `  # comment` and a redirection `< FILE` cut off)."""
    words = shlex.split(example.split("  #")[0])
    words = words[:words.index("<")] if "<" in words else words
    assert words[:1 + len(name.split())] == [prog, *name.split()], example
    return words[1 + len(name.split()):]


@pytest.mark.parametrize("prog,group,name,cmd", EVERY, ids=["%s %s" % (e[0], e[2]) for e in EVERY])
def test_help_starts_with_usage_and_examples_then_lists_every_option(prog, group, name, cmd):
    text = help_of(group, name.split())
    assert isinstance(cmd, LaidOut) and 2 <= len(cmd.examples) <= 3
    usage, examples, common = text.index("Usage:"), text.index("\nExamples:\n"), text.index("\nOptions:\n")
    assert usage == 0 and examples < common
    assert text[:examples].count("\n") <= 6  # the usage line and the one-paragraph summary, nothing more
    for example in cmd.examples:
        assert text.index(example) < common
    for heading, _ in cmd.sections:
        assert text.index("\n%s:\n" % heading) > common
    assert not cmd.sections or len(options(cmd)) > HEADINGS_FROM  # headings only where the options are many
    for flag in options(cmd):  # every option still listed, once
        assert text.count(" %s" % flag) >= 1, flag


@pytest.mark.parametrize("prog,group,name,cmd", EVERY, ids=["%s %s" % (e[0], e[2]) for e in EVERY])
def test_every_example_parses_as_the_command_takes_it(prog, group, name, cmd):
    for example in cmd.examples:
        args = example_args(prog, name, example)
        try:
            cmd.make_context(name, args)
        except click.BadParameter as e:  # a path the example names need not exist here
            assert "does not exist" in e.format_message(), example


def test_an_example_that_does_not_parse_is_caught():
    stop = dict(commands(onbox_cli))["stop"]
    with pytest.raises(click.UsageError):
        stop.make_context("stop", example_args("onbox", "stop", "onbox stop NAME --grace soon"))
    with pytest.raises(AssertionError):
        example_args("onbox", "stop", "onboxctl stop gpu1 NAME")


def test_onbox_run_help_leaves_the_internal_knob_ranges_to_the_reference():
    text = help_of(onbox_cli, ["run"])
    assert "tick_interval" not in text and "scan_max_seconds" not in text
    assert "--sync-interval FLOAT" in text and "(0-604800, default 60)" in text.replace("\n", " ").replace("  ", " ")


def test_onboxctl_run_help_puts_the_recovery_options_under_their_heading():
    text = help_of(ctl_cli, ["run"])
    recovery = text.index("\nRecovery (onboxctl keep):\n")
    for flag in ("--recover ", "--provision ", "--lost-after ", "--recover-tries ", "--include-secret "):
        assert text.index("  " + flag) > recovery, flag


def test_a_section_naming_a_flag_the_command_lacks_is_an_error_when_drawn():
    def body() -> None:
        """Do it."""

    good = LaidOut("x", callback=body, params=[click.Option(["--a"])], sections=[("A", ["--a"])])
    assert "\nA:\n  --a TEXT" in good.get_help(click.Context(good))
    bad = LaidOut("x", callback=body, params=[click.Option(["--a"])], sections=[("A", ["--b"])])
    with pytest.raises(ValueError, match="names --b"):
        bad.get_help(click.Context(bad))


# -- an old `--wait SECONDS` keeps working --------------------------------------------------------------------------
def test_an_old_option_number_is_read_as_its_new_name_with_a_warning(capsys):
    assert renamed(["r", "--wait", "5"], {"--wait": "--timeout"}, "onbox") == ["r", "--timeout", "5"]
    assert renamed(["--wait=0.5", "r"], {"--wait": "--timeout"}, "onbox") == ["--timeout", "0.5", "r"]
    assert "onbox: warning: `--wait 5` is deprecated: it is `--timeout 5` now" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--wait", "r"], ["r", "--wait"], ["r", "--no-wait"], ["--", "--wait", "5"],
                                  ["r", "--grace", "5"]])
def test_the_flag_alone_and_anything_after_dashes_stay_as_they_are(args, capsys):
    assert renamed(args, {"--wait": "--timeout"}, "onbox") == args
    assert capsys.readouterr().err == ""


def test_onbox_stop_reads_wait_as_a_flag_and_timeout_as_the_bound():
    stop = dict(commands(onbox_cli))["stop"]
    for argv, wait, timeout in ((["r"], True, None), (["r", "--no-wait"], False, None),
                                (["r", "--wait", "--timeout", "9"], True, 9.0), (["r", "--wait", "9"], True, 9.0),
                                (["--wait", "r"], True, None)):
        params = stop.make_context("stop", list(argv)).params
        assert (params["name"], params["wait"], params["timeout"]) == ("r", wait, timeout), argv


# -- the two CLIs agree ----------------------------------------------------------------------------------------------
def kind(opt: click.Option) -> str:
    """What typing the option takes: a flag (with or without its --no- form), or a value (once or repeatable)."""
    if opt.is_flag:
        return "flag"
    return "values" if opt.multiple else "value"


def test_a_flag_both_clis_share_on_a_command_of_the_same_name_takes_the_same_form():
    ours, theirs = dict(commands(onbox_cli)), dict(commands(ctl_cli))
    differ = []
    for name in sorted(set(ours) & set(theirs)):
        a, b = options(ours[name]), options(theirs[name])
        for flag in sorted(set(a) & set(b)):
            if kind(a[flag]) != kind(b[flag]) or bool(a[flag].secondary_opts) != bool(b[flag].secondary_opts):
                differ.append("%s %s: onbox %s, onboxctl %s" % (name, flag, kind(a[flag]), kind(b[flag])))
    assert differ == []
    assert {"run", "stop", "status", "logs"} <= set(ours) & set(theirs)  # the walk did find the shared commands


# flags whose meaning is one across every command of both CLIs: the same form wherever they appear
ONE_FORM = {"--json": "flag", "--follow": "flag", "--wait": "flag", "--grace": "value", "--timeout": "value",
            "--name": "value", "--durable": "value"}


@pytest.mark.parametrize("flag", sorted(ONE_FORM))
def test_a_common_flag_has_one_form_in_every_command_of_both_clis(flag):
    seen = {"%s %s" % (cli_name, name): kind(options(cmd)[flag])
            for cli_name, group in (("onbox", onbox_cli), ("onboxctl", ctl_cli))
            for name, cmd in commands(group) if flag in options(cmd)}
    assert seen and {k: v for k, v in seen.items() if v != ONE_FORM[flag]} == {}


# -- onboxctl stop --timeout bounds the wait ------------------------------------------------------------------------
def test_onboxctl_stop_timeout_bounds_the_wait_instead_of_the_agents_own(monkeypatch):
    answer(monkeypatch, ASKED)  # the agent's own bound: wait_s 60 (+ slack 30)
    statuses(monkeypatch, [dict(ENDED, state="stopping", agent_alive=True)])
    clock, said = FakeClock(), []
    with pytest.raises(JobFailed) as e:
        ctl_stop.stop_run(None, BOX, "gpt", wait=True, say=said.append, clock=clock,  # type: ignore[arg-type]
                          timeout=7.0)
    assert e.value.message == "run gpt on gpu1 did not stop within 7 s (it is stopping)"
    assert said[0].endswith("waiting up to 7 s") and sum(clock.sleeps) == 7.0


def test_onboxctl_stop_without_timeout_keeps_the_agents_bound(monkeypatch):
    answer(monkeypatch, ASKED)
    statuses(monkeypatch, [dict(ENDED, state="stopping", agent_alive=True)])
    clock = FakeClock()
    with pytest.raises(JobFailed, match="within 90 s"):
        ctl_stop.stop_run(None, BOX, "gpt", wait=True, clock=clock)  # type: ignore[arg-type]
