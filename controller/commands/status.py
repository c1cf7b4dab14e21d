"""`onboxctl status [--watch] [--json]` and `onboxctl logs BOX RUN [-f]`."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any, List, Optional, Tuple

import click

from controller import userconfig
from controller.boxes.agent import REMOTE_PYZ, ask, refusal
from controller.boxes.inventory import Box, Inventory
from controller.boxes.ssh import SSH_FAILURE, Ssh, settings_from_env
from controller.boxes.sshfail import unreachable
from controller.commands.params import Duration, Seconds
from controller.launch.start import check_name
from controller.tracker.runview import (
    RunRow,
    SkippedRun,
    beat_hint,
    read_tracker,
    render_table,
    rows_from_box_status,
    rows_from_tracker,
)
from onbox.clikit import LaidOut, echo_json
from onbox.clock import Clock, SystemClock
from onbox.errors import JobFailed, OnboxError, UnfitError, UsageError
from onbox.untrusted import printable

WAITS: Clock = SystemClock()  # the clock seam of `status --watch`'s interval (a test passes a FakeClock)


def box_rows(ssh: Ssh, box: Box) -> List[RunRow]:
    """Rows from `onbox status --json` on the box (schema onbox.status/1): each run's state, the agent's liveness,
    and the progress and checkpoint status the agent's subsystems recorded, read by the agent's own bounded
    readers. A run whose state.json is corrupt is a row of its own (exit 2 after the list): not a dead box."""
    doc, res, what = ask(ssh, box, ["status", "--json"], timeout=30)
    if not isinstance(doc, list):
        raise refusal(box, what, res, "run list")
    return rows_from_box_status(box.name, doc)


def collect(tracker: Optional[str], token: Optional[str], boxes: Tuple[str, ...], ssh: Ssh
            ) -> Tuple[List[RunRow], List[str], List[SkippedRun]]:
    """Rows from the tracker when one is configured, else from each box over ssh. Returns (rows, problems, the runs
    of the tracker's answer that were skipped or shown without their newest beat). A tracker that cannot be read
    raises (exit 3; a refused token, exit 2); one bad run in its answer is said, never the end of the table."""
    if tracker:
        view = read_tracker(tracker, token)
        if view.problem is not None:
            raise view.problem
        from_tracker = rows_from_tracker(view.document())
        return [r for r in from_tracker if not boxes or r.box in boxes], [], view.skipped
    inv = Inventory()
    names = list(boxes) or sorted(inv.load())
    if not names:
        raise UsageError("no tracker configured and no boxes in the inventory",
                         hint="pass --tracker URL (or set ONBOX_TRACKER), or name boxes: onboxctl status --box NAME")
    rows: List[RunRow] = []
    problems = []
    for name in names:
        box = inv.resolve(name)
        try:
            rows += box_rows(ssh, box)
        except OnboxError as e:
            problems.append("%s: %s" % (name, e.message))
            rows.append(RunRow(box=name, run="-", state="UNREACHABLE", liveness="unknown", source="ssh"))
    return rows, problems, []


def check_known(boxes: Tuple[str, ...], rows: List[RunRow], url: Optional[str]) -> None:
    """A --box that names no box: not in the inventory, and neither the tracker's runs nor ssh (as a host alias)
    know it. Exit 2 naming it: an empty table, exit 0, read as "that box has no runs"."""
    inv = Inventory()
    known = inv.load()
    for name in boxes:
        if name in known:
            continue
        mine = [r for r in rows if r.box == name]
        if url and not mine:
            where = "the tracker %s has no runs from it" % url
        elif not url and all(r.state == "UNREACHABLE" for r in mine):
            where = "no ssh host answers to that name"
        else:
            continue
        raise UsageError("unknown box %s: it is not in the inventory (%s), and %s" % (name, inv.path(), where),
                         hint="`onboxctl box ls` lists the boxes; `onboxctl box add %s --host ADDRESS` adds it" % name)


def tunnel_notes(ssh: Ssh, boxes: Tuple[str, ...]) -> List[str]:
    """One line per recorded tracker tunnel whose ssh master is gone (a local check: no network): since when, and
    whether its supervisor is re-opening it."""
    from controller.boxes.tunnel import Records, is_open

    inv = Inventory()
    out = []
    records = Records()
    try:
        recorded = records.load()
    except OnboxError as e:  # a damaged record must not take the status table down with it
        return [e.message]
    for t in recorded:
        if boxes and t.box not in boxes:
            continue
        try:
            if is_open(ssh, t, inv.resolve(t.box)):
                continue
        except OnboxError:
            pass
        since = " since %s" % time.strftime("%H:%M:%S", time.localtime(t.since)) if t.state == "down" and t.since \
            else ""
        if t.supervised():
            out.append("the tunnel of %s is down%s (%s): its supervisor (pid %s) re-opens it as soon as the box "
                       "answers, %d re-open(s) so far (log: %s); its beats wait in the agent's spool"
                       % (t.box, since, t.last_error or "its ssh master is gone", t.supervisor_pid, t.reopens,
                          records.log_path(t)))
        else:
            out.append("the tunnel of %s is down%s: its beats wait in the agent's spool; `onboxctl tunnel %s` "
                       "re-opens it and starts its supervisor" % (t.box, since, t.box))
    return out


def source_line(url: Optional[str], read_at: float) -> str:
    """Where the table came from and when it was read: the tracker's beats, or each box's records over ssh (whose
    BEAT is the age of the newest beat or progress the box recorded, measured on the box's own clock)."""
    when = time.strftime("%H:%M:%S", time.localtime(read_at))
    if url:
        return printable("from the tracker %s, read %s" % (url, when))
    return "from the boxes over ssh, read %s (BEAT: each run's newest beat or progress, by its box's clock)" % when


@click.command("status", cls=LaidOut, examples=[
    "onboxctl status                    # every run of every box", "onboxctl status --box gpu1 --watch",
    "onboxctl status --json --max-at-risk 30m"])
@click.option("--tracker", default=None, help="Tracker URL (default: ONBOX_TRACKER, then config.toml).")
@click.option("--tracker-token-file", default=None, type=click.Path(dir_okay=False),
              help="File holding the tracker's token (default: ONBOX_TRACKER_TOKEN, then config.toml).")
@click.option("--box", "boxes", multiple=True, help="Only these boxes (repeatable).")
@click.option("--watch", is_flag=True, help="Refresh in place until Ctrl-C.")
@click.option("--interval", type=Seconds(0.2, 3600), default=5.0, show_default=True,
              help="With --watch: seconds between refreshes.")
@click.option("--count", type=click.IntRange(1), default=None, help="With --watch: stop after this many refreshes.")
@click.option("--max-at-risk", type=Duration(), default=None, metavar="DUR",
              help="Alert (at_risk) on a run whose training since its newest durable checkpoint passes this (a run "
                   "launched with its own --max-at-risk keeps that one).")
@click.option("--json", "as_json", is_flag=True, help="Print the runs, problems and notes as JSON.")
def status(tracker: Optional[str], tracker_token_file: Optional[str], boxes: Tuple[str, ...], watch: bool,
           interval: float, count: Optional[int], max_at_risk: Optional[float], as_json: bool) -> None:
    """Every run of every box: state, step, loss, GPU, newest durable checkpoint, work at risk, heartbeat age.

    Each row also has the attempt, tokens/s and the time and steps since that checkpoint; for runs `onboxctl keep`
    watches, its state (RECOVERING), the number of recoveries and where the run lives now.

    Reads the tracker; without one, asks each box in the inventory over ssh.
    """
    from controller.keeper.view import apply_keeper

    url = userconfig.tracker_url(tracker)
    token = userconfig.tracker_token(tracker_token_file) if url else None
    ssh = Ssh(settings_from_env(connect_timeout=10))
    n = 0
    tty = sys.stdout.isatty()
    while True:
        read_at = time.time()
        rows, problems, skipped = collect(url, token, boxes, ssh)
        check_known(boxes, rows, url)
        rows, kept, record_problems = apply_keeper(rows, default_bound=max_at_risk)
        hint = beat_hint(rows)
        notes = (tunnel_notes(ssh, boxes) if url else []) + record_problems + ([hint] if hint else [])
        if as_json:
            echo_json({"source": "tracker" if url else "ssh", "tracker": url, "read_at": read_at, "runs": [r.to_dict() for r in rows],
                       "problems": problems, "notes": notes, "keeper": kept, "skipped": [s.to_dict() for s in skipped]})
        else:
            # every line below may carry text from outside (box names, a tracker's word): shown, never obeyed
            said = ["! %s" % s.describe() for s in skipped] + ["! %s" % p for p in problems] + [
                "note: %s" % x for x in notes]
            head = source_line(url, read_at) + ("  (every %gs, Ctrl-C to stop)\n\n" % interval if watch else "\n")
            text = head + render_table(rows) + "".join(printable(line) + "\n" for line in said)
            if watch and tty:
                # home the cursor, rewrite each line, clear what is left: refresh in place without flicker
                sys.stdout.write(("\x1b[2J" if n == 0 else "") + "\x1b[H" + text.replace("\n", "\x1b[K\n") + "\x1b[J")
                sys.stdout.flush()
            else:
                if watch and n:
                    click.echo("")
                click.echo(text, nl=False)
        n += 1
        if not watch or (count is not None and n >= count):
            if problems:  # the table is shown, but a script must see that some box did not answer
                raise UnfitError("%d box(es) did not answer: %s" % (len(problems), "; ".join(problems)),
                                 hint="check the box is up (`ssh BOX true`); its job may still be running")
            return
        WAITS.sleep(interval)


@click.command("logs", cls=LaidOut, examples=[
    "onboxctl logs gpu1 RUN              # its last 50 lines", "onboxctl logs gpu1 RUN -n 500",
    "onboxctl logs gpu1 RUN -f           # and what follows, until Ctrl-C"])
@click.argument("box")
@click.argument("run", required=False)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output until Ctrl-C.")
@click.option("-n", "--lines", type=click.IntRange(1), default=50, show_default=True,
              help="Lines from the end to show first.")
def logs(box: str, run: Optional[str], follow: bool, lines: int) -> None:
    """Show (or follow) RUN's output log on BOX. Without RUN, or with one the box does not have, the box's runs
    are listed (exit 2)."""
    if run is not None:
        check_name(run)
    b = Inventory().resolve(box)
    ssh = Ssh(settings_from_env())
    runs = {r.run: r.state for r in box_rows(ssh, b)}
    if run is None or run not in runs:
        have = ", ".join("%s (%s)" % (printable(n), printable(st)) for n, st in sorted(runs.items())) or "no runs"
        first = printable(sorted(runs)[0]) if runs else "RUN"
        raise UsageError(("which run? %s has: %s" if run is None else "no run named %s on %s; it has: %s") % (
            *(() if run is None else (run,)), box, have),
            hint="`onboxctl logs %s %s`; `onboxctl status --box %s` shows each run" % (box, first, box))
    argv = [b.python, REMOTE_PYZ, "logs", run, "-n", str(lines)] + (["-f"] if follow else [])
    if not follow:
        click.echo(ssh.run(b.target(), argv, timeout=60, what="onbox logs").text, nl=False)
        return
    ssh.ensure_master(b.target())
    # following is open-ended by intent; ServerAlive still ends it within seconds when the link dies (U17)
    proc = subprocess.Popen(ssh.ssh_argv(b.target(), argv), stdin=subprocess.DEVNULL)
    if follow_until_interrupted(proc):
        return  # Ctrl-C is how a follow ends: exit 0, quietly, whatever ssh said as it went (255 on SIGTERM)
    if proc.returncode == SSH_FAILURE:
        raise unreachable(b.target(), "ssh exited 255 while following the log")
    if proc.returncode != 0:
        raise JobFailed("following the log of %s on %s ended with exit %d" % (run, box, proc.returncode))


def follow_until_interrupted(proc: "subprocess.Popen[bytes]") -> bool:
    """Wait for `proc`; a SIGINT (Ctrl-C: the terminal sends it to ssh too, or to us alone) ends it with SIGTERM.
    True when the wait ended by a SIGINT. The handler sets a flag rather than raising, so no moment of the wait
    lets a KeyboardInterrupt escape as click's "Aborted!"."""
    interrupted: List[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(signum)
        if proc.poll() is None:
            proc.terminate()

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        proc.wait()
    finally:
        signal.signal(signal.SIGINT, old)
    return bool(interrupted)
