"""`onbox audit`: pre-flight check of this box (onbox/platform/audit.py does the work)."""
from __future__ import annotations

from typing import Optional

import click

from onbox.clikit import FiniteFloat, LaidOut, PathValue, echo_json

MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "info": "info"}


@click.command("audit", cls=LaidOut, examples=[
    "onbox audit", "onbox audit --ckpt-dir /workspace/ckpt --durable remote:ckpt --min-free-gb 50",
    "onbox audit --json"])
@click.option("--ckpt-dir", type=PathValue(click.Path(file_okay=False)), help="Where the trainer will write checkpoints "
              "(default: the profile's fast disk if present, else $ONBOX_HOME).")
@click.option("--durable", type=PathValue(), help="Durable target: a mounted path or an rclone remote (default: the profile's).")
@click.option("--min-free-gb", type=FiniteFloat(0.0, 1e9), default=10.0, show_default=True,
              help="Free space the checkpoint dir needs; less is unfit (exit 3).")
@click.option("--min-free-inodes", type=click.IntRange(min=0), default=10000, show_default=True,
              help="Free inodes the checkpoint dir needs; fewer is unfit (exit 3) (U7).")
@click.option("--profile", help="Platform profile to judge by (default: detected; see `onbox profiles`).")
@click.option("--profile-file", type=PathValue(click.Path(dir_okay=False)), help="A profile file merged over the profile.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (schema onbox.audit/1).")
def audit(ckpt_dir: Optional[str], durable: Optional[str], min_free_gb: float, min_free_inodes: int,
          profile: Optional[str], profile_file: Optional[str], as_json: bool) -> None:
    """Pre-flight check of this box before a run: exit 3 when it is unfit, 0 otherwise.

    It checks disks and inodes, cgroup memory and OOM kills, CPU quota vs threads, GPUs, torch's CUDA build vs the
    driver, tmux/rsync/rclone and Python."""
    from onbox.errors import UnfitError
    from onbox.platform.audit import AuditOptions, run_audit

    report = run_audit(AuditOptions(ckpt_dir=ckpt_dir, durable=durable, min_free_gb=min_free_gb,
                                    min_free_inodes=min_free_inodes, profile=profile,
                                    profile_file=profile_file))
    if as_json:
        echo_json(report.to_dict())
    else:
        for c in report.checks:
            click.echo("%s  %-14s %s" % (MARK[c.verdict], c.name, c.summary))
            if c.hint and c.verdict != "ok":
                click.echo("      %-14s hint: %s" % ("", c.hint))
        click.echo("%s (%.2f s)" % ("fit" if report.fit else "UNFIT", report.elapsed_s))
    failed = [c for c in report.checks if c.verdict == "fail"]
    if failed:
        raise UnfitError("box unfit: %s" % failed[0].summary, hint=failed[0].hint)
