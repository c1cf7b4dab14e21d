"""`onbox profiles list|show|detect`: the platform profiles shipped in onbox.pyz (onbox/platform/profiles.py)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import click

from onbox.clikit import LaidOut, PathValue, echo_json

MONEY_TABLES = ("billing", "preemption", "paths", "session", "accelerators")  # the tables with a source


@click.group("profiles")
def profiles() -> None:
    """Platform profiles: meter-stop verb, preemption, fast/durable paths, env and gotchas per platform.

    A user file $ONBOX_HOME/profiles/NAME.toml (or --profile-file) overrides any field of a built-in profile.
    """


@profiles.command("list", cls=LaidOut, examples=["onbox profiles list", "onbox profiles list --json"])
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_cmd(as_json: bool) -> None:
    """List the built-in profiles (and their sub-platforms)."""
    from onbox.platform import profiles as core

    rows: List[Dict[str, Any]] = []
    for p in core.load_all():
        bill, pre = p.table("billing"), p.table("preemption")
        rows.append({"name": p.name, "title": p.data["title"], "meter_stop": bill["meter_stop"],
                     "irreversible": bill["irreversible"], "notice_source": pre["notice_source"],
                     "grace_seconds": pre.get("grace_seconds"),
                     "platforms": sorted(p.data.get("platforms") or {})})
    if as_json:
        echo_json(rows)
        return
    fmt = "%-12s %-26s %-30s %-12s %-8s %s"
    click.echo(fmt % ("NAME", "TITLE", "METER STOP", "IRREVERSIBLE", "GRACE", "NOTICE"))
    for r in rows:
        grace = "-" if r["grace_seconds"] is None else "%gs" % r["grace_seconds"]
        stop = r["meter_stop"] if len(r["meter_stop"]) <= 30 else r["meter_stop"][:29] + "~"
        click.echo(fmt % (r["name"], r["title"][:26], stop, "yes" if r["irreversible"] else "no", grace,
                          r["notice_source"]))
        for sub in r["platforms"]:
            click.echo("  %s/%s" % (r["name"], sub))


def _show_text(p: Any) -> None:
    d = p.data
    click.echo("%s — %s" % (p.name, d["title"]))
    if d.get("description"):
        click.echo(d["description"])
    for table in MONEY_TABLES:
        t = p.table(table)
        if not t:  # [session] and [accelerators] are only a notebook platform's
            continue
        click.echo("\n[%s]  (verified %s, %s; source: %s)" % (table, t.get("verified"),
                                                             t.get("confidence", "documented"), t.get("source")))
        for key, value in t.items():
            if key not in ("source", "verified", "confidence"):
                click.echo("  %-14s %s" % (key, value))
    for table in ("ssh", "env", "hooks", "run"):
        if p.table(table):
            click.echo("\n[%s]" % table)
            for key, value in p.table(table).items():
                click.echo("  %-14s %s" % (key, value))
    if d.get("gotchas"):
        click.echo("\ngotchas: %s" % ", ".join(d["gotchas"]))
    for note in d.get("notes") or []:
        click.echo("- %s" % note)
    if d.get("platforms"):
        click.echo("\nplatforms: %s (show one with NAME/PLATFORM)" % ", ".join(
            "%s/%s" % (p.name, s) for s in sorted(d["platforms"])))
    click.echo("\nrun defaults: %s" % p.run_defaults())
    click.echo("files: %s" % ", ".join(p.files))


@profiles.command("show", cls=LaidOut, examples=[
    "onbox profiles show runpod", "onbox profiles show china/gpushare --json",
    "onbox profiles show runpod --profile-file ./runpod.toml   # with your overrides"])
@click.argument("name")
@click.option("--profile-file", type=PathValue(click.Path(dir_okay=False)), help="A user file merged over the built-in one.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show(name: str, profile_file: Optional[str], as_json: bool) -> None:
    """Show one profile (NAME, or FAMILY/PLATFORM such as china/gpushare) with sources and dates."""
    from onbox.platform import profiles as core

    p = core.load(name, profile_file)
    if as_json:
        echo_json(dict(p.to_dict(), run_defaults=p.run_defaults()))
    else:
        _show_text(p)


@profiles.command("detect", cls=LaidOut, examples=["onbox profiles detect",
                                                    "onbox profiles detect --profile runpod --json"])
@click.option("--profile", "forced", help="Skip detection and use this profile.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def detect_cmd(forced: Optional[str], as_json: bool) -> None:
    """Detect the platform this box runs on (RUNPOD_POD_ID, VAST_CONTAINERLABEL, SLURM_JOB_ID, ...)."""
    from onbox.platform import profiles as core

    if forced:
        name, why = forced, "--profile given"
    else:
        name, why = core.detect()
    p = core.load(name)
    if as_json:
        echo_json({"profile": p.name, "evidence": why, "run_defaults": p.run_defaults()})
    else:
        click.echo("%s (%s)" % (p.name, why))
