"""The `onbox run` options a Kaggle session gets (`kaggle push --onbox-arg`, `--resume-arg`), checked on this machine
before anything is written or sent: Kaggle would only say so hours later, in a session's log, after the queue.

The checks are the agent's own, not copies: its option parser (`onbox run`'s click command) and RunConfig.validate
through onbox.commands.run.check_run_options, the check `onbox sbatch` makes before a queue wait; a --ckpt-dir by
onbox.launch.checks.ckpt_dir_problem, as the agent would judge it at the path it has on Kaggle. Refused besides:
the options the kernel's script sets itself (a different --name, --profile or --durable would break the chain:
`kaggle push --durable` and `--name` are the ways to set them), and anything that is not an option (the script puts
the onbox options before `--` and the command: a stray word, or a `--`, would become the command).
"""
from __future__ import annotations

import posixpath
from typing import List, Optional, Sequence

import click

from onbox import untrusted
from onbox.errors import UsageError

# The options kernel_main.agent_argv passes itself, with the `kaggle push` option that sets each instead.
SET_BY_SCRIPT = {"name": "--name", "profile": None, "durable": "--durable"}
KAGGLE_ROOT = "/kaggle"  # where a session's paths lie (kernel_main.layout without ONBOX_KAGGLE_ROOT)


def _refuse(args: Sequence[str], problem: str, hint: Optional[str] = None) -> UsageError:
    shown = " ".join(untrusted.printable(a) for a in args)
    return UsageError("--onbox-arg %s: %s" % (shown, problem),
                      hint=hint or "each --onbox-arg is an `onbox run` option for the session (see `onbox run "
                                   "--help`), e.g. --onbox-arg=--keep-last=2")


def session_workdir(run: str, code: bool) -> str:
    """The session's working directory on Kaggle: the unpacked --code tree, else /kaggle/working."""
    return posixpath.join(KAGGLE_ROOT, "temp", "onbox-" + run, "code") if code else posixpath.join(KAGGLE_ROOT,
                                                                                                  "working")


def check(onbox_args: Sequence[str], resume_args: Sequence[str], run: str, code: bool) -> List[str]:
    """UsageError (exit 2) naming the first option the agent on Kaggle would refuse, or the script could not pass.
    Returns the names of the --env variables that look like secrets (onbox's own rule, SECRET_NAME_RE): their
    values are written into the kernel's script, which Kaggle keeps with every version."""
    from onbox.commands.run import check_run_options
    from onbox.commands.run import run as run_command
    from onbox.launch.checks import CKPT_DIR_HINT, SECRET_NAME_RE, ckpt_dir_problem

    args: List[str] = list(onbox_args)
    if "--" in args:
        raise _refuse(args, "`--` ends the options: the session's command comes after `--` of kaggle push itself")
    try:
        ctx = run_command.make_context("onbox run", list(args))
    except click.ClickException as e:
        raise _refuse(args, "`onbox run` refuses it: %s" % e.format_message().rstrip("."))
    except UsageError as e:  # an option's own type refused its value (a path option given `--x` or nothing)
        raise _refuse(args, e.message, e.hint)
    stray = list(ctx.params.get("command") or ())
    if stray:
        raise _refuse(args, "%s is no `onbox run` option" % untrusted.printable(stray[0]),
                      hint="give each option with its value, e.g. --onbox-arg=--grace=30; the command goes after --")
    for key, instead in SET_BY_SCRIPT.items():
        if ctx.get_parameter_source(key) == click.core.ParameterSource.COMMANDLINE:
            raise _refuse(args, "--%s is set by the kernel's script" % key,
                          hint=("use `onboxctl kaggle push %s` instead" % instead) if instead else
                          "the session runs under the kaggle profile: its [session] hours are the deadline")
    try:
        check_run_options(args + ["--resume-arg=" + a for a in resume_args])
    except UsageError as e:
        raise _refuse(args, e.message, e.hint)
    except click.ClickException as e:  # a --resume-arg the parser refuses
        raise UsageError("--resume-arg: %s" % e.format_message())
    ckpt = ctx.params.get("ckpt_dir")
    if ckpt:
        where = posixpath.normpath(posixpath.join(session_workdir(run, code), ckpt))
        problem = ckpt_dir_problem(where, posixpath.join(KAGGLE_ROOT, "temp", "onbox-" + run, "home", "runs", run))
        if problem:
            shown = "" if where == ckpt else " (%s on Kaggle)" % where
            raise _refuse(args, "--ckpt-dir %s%s %s" % (untrusted.printable(ckpt), shown, problem), CKPT_DIR_HINT)
    names = [str(e).split("=", 1)[0] for e in ctx.params.get("env") or ()]
    return sorted({n for n in names if SECRET_NAME_RE.search(n)})
