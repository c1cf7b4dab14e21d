"""`onboxctl kaggle push|status|logs|pull`: a run on Kaggle kernels, one session (kernel version) after another."""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

import click

from controller.commands.pull import say_pulled
from controller.kaggle import folder, onboxargs
from controller.kaggle.cli import ACTIVE, KaggleCli, credentials, log_lines
from controller.kaggle.output import outcome_in_log, pull
from controller.launch.secretfiles import Selection
from controller.launch.start import check_name
from onbox import vocab
from onbox.clikit import LaidOut, echo_json
from onbox.errors import UnfitError, UsageError
from onbox.untrusted import printable

PUSH_SCHEMA = vocab.SCHEMA_KAGGLE_PUSH
STATUS_SCHEMA = vocab.SCHEMA_KAGGLE_STATUS
REMOTE_RE = re.compile(r"^(:[A-Za-z0-9_-]+[^:]*|[A-Za-z0-9_][A-Za-z0-9_. -]*):")
NEXT = {"session_limit": "push again to continue (onboxctl kaggle push ... --name {run})",
        "preempted": "push again to continue (onboxctl kaggle push ... --name {run})",
        "done": "done: onboxctl kaggle pull {run} DEST brings the checkpoints home",
        "failed": "the run failed: onboxctl kaggle logs {run} says why"}


@click.group("kaggle")
def kaggle() -> None:
    """Run on Kaggle kernels: each push is one session (a kernel version) of run NAME, resumed from the last.

    Needs the kaggle CLI (onbox's controller extra) and its credentials: ~/.kaggle/kaggle.json, or
    KAGGLE_USERNAME and KAGGLE_KEY in the environment; never on the command line.
    """


def _who(owner: Optional[str], offline: bool = False) -> Tuple[str, str]:
    """(the kernel's owner, where the credentials are). `offline` (--no-push): none are needed, only a name."""
    if offline and owner:
        return owner, "--owner (no credentials needed: --no-push asks Kaggle nothing)"
    try:
        creds = credentials()
    except UnfitError:
        if not offline:
            raise
        raise UsageError("--no-push without Kaggle credentials needs --owner YOUR_KAGGLE_USERNAME",
                         hint="the kernel's id is OWNER/onbox-NAME; --no-push itself needs no credentials")
    who = owner or creds.owner
    if not who:
        raise UsageError("the Kaggle credentials (%s) do not name a user" % creds.source,
                         hint="give --owner YOUR_KAGGLE_USERNAME, or set KAGGLE_USERNAME")
    return who, creds.source


def _ref(owner: str, run: str) -> str:
    return "%s/%s" % (owner, folder.slug_of(check_name(run)))


def _pyz(path: Optional[str]) -> bytes:
    from controller.launch.push import default_pyz

    path = path or default_pyz()
    if not os.path.isfile(path):
        raise UsageError("no onbox.pyz at %s" % path, hint="build it with `make zipapp`, or give --pyz PATH")
    with open(path, "rb") as f:
        return f.read()


PUSH_EXAMPLES = [
    "onboxctl kaggle push ./kernel --name gpt --code . -- python3 train.py",
    "onboxctl kaggle push ./kernel --name gpt --code . --accelerator NvidiaTeslaT4 --durable r2:ckpt "
    "-- python3 train.py",
    "onboxctl kaggle push ./kernel --name gpt --code . --no-push -- python3 train.py   # the folder only",
]
PUSH_SECTIONS = [("The session", ["--resume-arg", "--onbox-arg", "--internet"]),
                 ("Secrets and publishing", ["--include-secret", "--public", "--yes-publish-secrets"]),
                 ("Advanced", ["--owner", "--pyz", "--no-push"])]


@kaggle.command("push", cls=LaidOut, usage="[OPTIONS] DIR -- COMMAND...", examples=PUSH_EXAMPLES,
                sections=PUSH_SECTIONS, context_settings={"ignore_unknown_options": True})
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--name", "run", required=True, help="The run; the kernel is OWNER/onbox-NAME.")
@click.option("--accelerator", metavar="SHAPE", help="Kaggle's machine shape (NvidiaTeslaT4, NvidiaTeslaP100, "
              "TpuV38, ...; `cpu` for none). Default: Kaggle's default GPU.")
@click.option("--durable", metavar="REMOTE:PATH", help="An rclone remote the session commits to and resumes from "
              "(the kernel needs rclone and the remote's RCLONE_CONFIG_* there). Default: /kaggle/working, kept as "
              "the version's output, which the next push mounts and resumes from.")
@click.option("--code", "code_dir", type=click.Path(file_okay=False), help="Your code directory, packed into the "
              "script (at most 20 MiB compressed) and the command's working directory there.")
@click.option("--dataset", "datasets", multiple=True, metavar="OWNER/SLUG", help="A dataset the kernel mounts "
              "under /kaggle/input (repeatable).")
@click.option("--resume-arg", "resume_args", multiple=True, help="Appended to the command when a checkpoint "
              "exists (onbox run --resume-arg; {ckpt} is its path).")
@click.option("--onbox-arg", "onbox_args", multiple=True, metavar="OPT", help="An `onbox run` option for the "
              "session, e.g. --onbox-arg=--keep-last=2 (repeatable).")
@click.option("--internet/--no-internet", default=True, show_default=True, help="The kernel's internet access.")
@click.option("--public", is_flag=True, help="Make the kernel public (default private).")
@click.option("--owner", help="Your Kaggle username, when the credentials do not name it (an access token).")
@click.option("--pyz", type=click.Path(dir_okay=False), help="The onbox.pyz to embed (default dist/onbox.pyz "
              "or $ONBOX_PYZ).")
@click.option("--include-secret", "include_secrets", multiple=True, metavar="PATH", help="Pack this secret-looking "
              "file or directory of --code anyway (the path the warning names, relative to --code; repeatable). "
              "Without it such files (.env*, keys, kaggle.json, .netrc, credentials*, .git/, .ssh/, ...) are left "
              "out, and named on stderr.")
@click.option("--yes-publish-secrets", is_flag=True, help="With --public: publish the files --include-secret names "
              "and the value of an --onbox-arg=--env whose name looks like a secret (refused without it).")
@click.option("--no-push", is_flag=True, help="Write the kernel folder only, asking Kaggle nothing (no network, no "
              "credentials with --owner); `kaggle kernels push -p DIR` it later.")
@click.option("--json", "as_json", is_flag=True, help="One onbox.kaggle.push/1 document on stdout.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def push(directory: str, run: str, accelerator: Optional[str], durable: Optional[str], code_dir: Optional[str],
         datasets: Tuple[str, ...], resume_args: Tuple[str, ...], onbox_args: Tuple[str, ...], internet: bool,
         public: bool, owner: Optional[str], pyz: Optional[str], include_secrets: Tuple[str, ...],
         yes_publish_secrets: bool, no_push: bool, as_json: bool, command: Tuple[str, ...]) -> None:
    """Write DIR as a Kaggle kernel of run NAME and push it: one session, resumed from the one before.

    DIR gets kernel-metadata.json and a script carrying onbox.pyz; Kaggle runs COMMAND under `onbox run
    --foreground` with the session's deadline, and a push after the first continues from the newest checkpoint the
    previous session committed.
    """
    check_name(run)
    if durable is not None and not REMOTE_RE.match(durable):
        raise UsageError("--durable %r is no rclone remote (REMOTE:PATH): a kernel has no disk of yours" % durable,
                         hint="leave it out: /kaggle/working is the commit target and the next push resumes from it")
    if include_secrets and not code_dir:
        raise UsageError("--include-secret goes with --code: it names a file of the code directory")
    secret_env = onboxargs.check(onbox_args, resume_args, run, code=code_dir is not None)  # the agent's checks
    if secret_env:
        _say_secret_env(secret_env, public, yes_publish_secrets)
    who, _ = _who(owner, offline=no_push)
    spec = folder.KernelSpec(owner=who, run=run, command=list(command), accelerator=accelerator,
                             internet=internet, private=not public, durable=durable, datasets=list(datasets),
                             resume_args=list(resume_args), onbox_args=list(onbox_args))
    spec.check()
    folder.check_folder(directory)
    selection = Selection(code_dir, include_secrets) if code_dir else None
    payload, code = _pyz(pyz), folder.pack_code(code_dir, selection) if code_dir else None
    if selection is not None:
        _say_secrets(selection.finish(), code_dir or "", public, yes_publish_secrets)
    cli = None if no_push else KaggleCli()  # everything above is checked here, before Kaggle is asked anything
    continuing: Optional[bool] = None
    if cli is None:
        spec.continuing = True  # nothing asked: the kernel lists itself as a source, skipped (said) on a first version
    else:
        before = cli.status(spec.ref)
        if before is not None and before["state"] in ACTIVE:
            raise UsageError("%s (run %s) is %s on Kaggle: a push now would start another session beside it"
                             % (spec.ref, run, before["state"]),
                             hint="wait until it ends (onboxctl kaggle status %s), or stop it on Kaggle" % run)
        spec.continuing = continuing = before is not None
    written = folder.write(directory, spec, payload, code)
    version = None if cli is None else cli.push(directory)
    resumes = None if not spec.continuing and not durable else ("remote" if durable else "previous_output")
    doc: Dict[str, Any] = {"schema": PUSH_SCHEMA, "run": run, "kernel": spec.ref, "version": version,
                           "pushed": version is not None, "folder": os.path.abspath(directory), "files": written,
                           "continuing": continuing, "resumes_from": resumes, "durable": durable,
                           "accelerator": accelerator, **(selection.to_dict() if selection else
                                                          {"secrets_left_out": [], "secrets_included": []})}
    if as_json:
        echo_json(doc)
        return
    how = {"remote": "resuming from %s" % durable, "previous_output": "resuming from the previous version's output",
           None: "a new kernel, from scratch"}[resumes]
    if version is None:
        if continuing is None and resumes == "previous_output":
            how = "resuming from the previous version's output when there is one"
        click.echo("wrote %s for run %s (%s); push it with: kaggle kernels push -p %s" % (directory, run, how,
                                                                                         directory))
    else:
        click.echo("pushed run %s as version %d of %s (%s); onboxctl kaggle status %s" % (run, version, spec.ref,
                                                                                         how, run))


def _say_secret_env(names: List[str], public: bool, yes: bool) -> None:
    """An --onbox-arg=--env NAME=VALUE whose name looks like a secret: its value is in the kernel's script."""
    shown = ", ".join(printable(n) for n in names)
    if public and not yes:
        raise UsageError("--public would publish the value of --env %s: every --onbox-arg is in the kernel's "
                         "script, anyone's to read" % shown,
                         hint="give the trainer the secret through Kaggle's Secrets (Add-ons > Secrets), push it "
                              "private, or add --yes-publish-secrets")
    click.echo("onboxctl: warning: the value of --env %s is written into the kernel's script, which Kaggle keeps "
               "with every version: Kaggle's Secrets (Add-ons > Secrets) keep it out" % shown, err=True)


def _say_secrets(selection: Selection, code_dir: str, public: bool, yes: bool) -> None:
    """Refuse to publish secret-looking files without --yes-publish-secrets; say what was left out and sent."""
    if public and selection.included and not yes:
        raise UsageError("--public would publish secret-looking files of --code %s: %s" % (
            code_dir, ", ".join(printable(f.path) for f in selection.included)),
            hint="a public kernel's script is anyone's to read: push it private, leave --include-secret out, or "
                 "add --yes-publish-secrets")
    for line in selection.summary("--code %s" % code_dir):
        click.echo("onboxctl: warning: %s" % line, err=True)


@kaggle.command("status", cls=LaidOut, examples=["onboxctl kaggle status gpt", "onboxctl kaggle status gpt --json"])
@click.argument("run")
@click.option("--owner", help="The kernel's owner (default: the Kaggle credentials' user).")
@click.option("--json", "as_json", is_flag=True, help="One onbox.kaggle.status/1 document on stdout.")
def status(run: str, owner: Optional[str], as_json: bool) -> None:
    """The newest session of RUN on Kaggle (`kaggle kernels status`) and, once it ended, how onbox ended it."""
    who, _ = _who(owner)
    ref = _ref(who, run)
    cli = KaggleCli()
    st = cli.status(ref)
    if st is None:
        raise UsageError("Kaggle has no kernel %s (run %s)" % (ref, run),
                         hint="start it: onboxctl kaggle push DIR --name %s -- COMMAND" % run)
    onbox = outcome_in_log(log_lines(cli.log(ref))) if st["state"] in ("complete", "error") else None
    outcome = (onbox or {}).get("outcome")
    doc = {"schema": STATUS_SCHEMA, "run": run, "kernel": ref, "state": st["state"], "failure": st["failure"],
           "onbox": onbox, "next": NEXT[outcome].format(run=run) if isinstance(outcome, str) and outcome in NEXT
           else None}
    if as_json:
        echo_json(doc)
        return
    line = "%s (%s): %s" % (run, ref, st["state"])
    if st["failure"]:
        line += " — %s" % st["failure"]
    if onbox:
        line += "; onbox: %s (exit %s)" % (outcome, onbox.get("exit_code"))
    click.echo(printable(line))  # Kaggle's failure message and the log's outcome line: text from outside
    if doc["next"]:
        click.echo("  next: %s" % doc["next"])


@kaggle.command("logs", cls=LaidOut, examples=["onboxctl kaggle logs gpt", "onboxctl kaggle logs gpt --raw"])
@click.argument("run")
@click.option("--owner", help="The kernel's owner (default: the Kaggle credentials' user).")
@click.option("--raw", is_flag=True, help="The log as Kaggle stores it (a JSON array), not its text.")
def logs(run: str, owner: Optional[str], raw: bool) -> None:
    """The log of RUN's newest session on Kaggle (`kaggle kernels logs`)."""
    who, _ = _who(owner)
    text = KaggleCli().log(_ref(who, run))
    # the session's output, from Kaggle: control characters shown as escapes (a trainer's ESC sequence, or a
    # dependency's, must not drive this terminal); tqdm's carriage returns already split lines in log_lines
    click.echo(printable(text.rstrip("\n") if raw else "\n".join(log_lines(text)), keep_newlines=True))


@kaggle.command("pull", cls=LaidOut, examples=["onboxctl kaggle pull gpt ./results",
                                                "onboxctl kaggle pull gpt ./results --json"])
@click.argument("run")
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--owner", help="The kernel's owner (default: the Kaggle credentials' user).")
@click.option("--load/--no-load", default=None, help="Load with torch while verifying (default: when torch is "
              "installed).")
@click.option("--json", "as_json", is_flag=True, help="The pull report as JSON (what `onboxctl pull --json` prints).")
def pull_cmd(run: str, dest: str, owner: Optional[str], load: Optional[bool], as_json: bool) -> None:
    """Download RUN's newest output from Kaggle into DEST/RUN/ and verify it, as `onboxctl pull` does.

    The output is `kaggle kernels output`'s; every committed checkpoint in it is verified and recorded in the pulls
    record."""
    who, _ = _who(owner)
    ref = _ref(who, run)
    say = (lambda m: None) if as_json else (lambda m: click.echo("pull: " + m))
    report = pull(KaggleCli(), ref, who, run, dest, load=load, say=say)
    say_pulled(report, run, ref, as_json, verified=True,
               damaged="pull again; if it fails again the version's output is damaged")


pull_cmd.name = "pull"
