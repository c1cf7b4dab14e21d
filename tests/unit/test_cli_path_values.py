"""The path options of the agent's commands (clikit.PathValue): a value that is an option or nothing is refused,
naming the flag, before anything takes it for a path; a path, however odd, is still a path (issue 30.12)."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from onbox.clikit import PathValue, option_like
from onbox.commands import checkpoints, run, sbatch
from onbox.errors import UsageError

PATH_OPTIONS = {"--run-file": "run_file", "--ckpt-dir": "ckpt_dir", "--durable": "durable", "--workdir": "workdir",
                "--env-file": "env_files", "--tracker-token-file": "tracker_token_file",
                "--heartbeat-file": "heartbeat_file", "--mlflow-token-file": "mlflow_token_file",
                "--node-group": "node_group"}


def parse_run(*args: str) -> dict:
    return run.run.make_context("onbox run", [*args, "--", "true"]).params


def test_every_path_option_of_onbox_run_is_a_path_value():
    """The table above is the whole list: an option of `onbox run` whose value names a file or dir and is not a
    PathValue would take `--` for a path again."""
    typed = {max(p.opts, key=len) for p in run.run.params if isinstance(p, click.Option)
             and isinstance(p.type, PathValue)}
    assert typed == set(PATH_OPTIONS)


@pytest.mark.parametrize("flag", sorted(PATH_OPTIONS))
@pytest.mark.parametrize("value", ["--", "-x", "--durable", "", "  ", "\t", "-"])
def test_an_option_or_nothing_is_never_a_path(flag, value):
    if flag == "--node-group" and value == "-":
        return  # stdin: the test below
    with pytest.raises(UsageError) as e:
        parse_run(flag, value)
    assert e.value.message == "%s needs a value: got %r (an unset variable?)" % (flag, value)
    assert e.value.hint and flag in e.value.hint


def test_an_unset_variable_before_another_option_names_the_first():
    """`--ckpt-dir $UNSET --durable D -- cmd`: the refusal names --ckpt-dir, not "cannot run D"."""
    with pytest.raises(UsageError, match=r"^--ckpt-dir needs a value: got '--durable'"):
        run.run.make_context("onbox run", ["--ckpt-dir", "--durable", "/d", "--", "true"])


@pytest.mark.parametrize("value", ["/abs/path", "rel/path", "./-x", "a-b", "remote:bucket/-x", ":sftp,host=h:p",
                                   "~/ckpt", "a b", "ünïcode/ck", "x--", "/-"])
@pytest.mark.parametrize("flag", ["--ckpt-dir", "--durable", "--env-file", "--heartbeat-file"])
def test_a_path_however_odd_is_still_a_path(flag, value):
    params = parse_run(flag, value)
    got = params[PATH_OPTIONS[flag]]
    assert (list(got) if isinstance(got, tuple) else [got]) == [value]


def test_node_group_dash_is_stdin():
    assert parse_run("--node-group", "-")["node_group"] == "-"


def test_click_path_checks_still_apply(tmp_path):
    """A PathValue wrapping click.Path keeps its checks: a directory for --run-file is still refused by click."""
    with pytest.raises(click.BadParameter, match="is a directory"):
        parse_run("--run-file", str(tmp_path))


def test_help_shows_the_same_metavars():
    text = CliRunner().invoke(run.run, ["--help"]).output
    assert "--run-file FILE" in text and "--workdir DIRECTORY" in text and "--durable PATH" in text


@pytest.mark.parametrize("argv", [["r", "--durable", "--"], ["r", "--ckpt-dir", ""]])
def test_sync_refuses_an_option_as_its_dirs(argv, onbox_home):
    r = CliRunner().invoke(checkpoints.sync, argv)
    assert isinstance(r.exception, UsageError) and "needs a value" in r.exception.message


def test_sbatch_checks_the_run_options_it_passes_on():
    """`onbox sbatch --durable "" -- cmd` used to write a script whose node then ran without durable storage."""
    r = CliRunner().invoke(sbatch.sbatch, ["--print", "--durable", "", "--", "true"])
    assert isinstance(r.exception, UsageError) and r.exception.message.startswith("--durable needs a value")


@pytest.mark.parametrize("value,refused", [("--", True), ("-", True), ("", True), (" \t", True), ("-x", True),
                                           ("x", False), ("./-x", False), ("a-", False), ("/", False)])
def test_option_like(value, refused):
    assert option_like(value) is refused
    assert option_like("-", stdin_dash=True) is False
