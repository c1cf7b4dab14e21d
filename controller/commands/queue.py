"""`onboxctl queue BOX [--json]`: a box's run queue, read over ssh (`onbox queue ls --json` on the box)."""
from __future__ import annotations

import click

from controller.boxes.agent import REMOTE_PYZ, parse_json_any
from controller.boxes.inventory import Inventory
from controller.boxes.ssh import Ssh, settings_from_env
from onbox import vocab
from onbox.clikit import LaidOut, echo_json
from onbox.errors import UnfitError


@click.command("queue", cls=LaidOut, examples=["onboxctl queue gpu1", "onboxctl queue gpu1 --json"])
@click.argument("box")
@click.option("--json", "as_json", is_flag=True, help="Print the box's queue as JSON (with the box's name).")
def queue(box: str, as_json: bool) -> None:
    """BOX's run queue: each entry's state, run name, the run's own state and GPU, and the queue runner.

    Entries are added on the box (`onbox queue add ... -- CMD`); this reads them. Exit 3 when the box does not
    answer or its onbox has no queue (push a newer onbox.pyz).
    """
    from onbox.queue.render import render_queue

    b = Inventory().resolve(box)
    ssh = Ssh(settings_from_env())
    res = ssh.run(b.target(), [b.python, REMOTE_PYZ, "queue", "ls", "--json"], timeout=60, what="onbox queue ls",
                  check=False)
    doc = parse_json_any(res.text)
    if res.returncode != 0 or not isinstance(doc, dict) or doc.get("schema") != vocab.SCHEMA_QUEUE:
        said = (res.err_text or res.text.strip())[-300:] or "(no output)"
        raise UnfitError("%s did not answer with its queue (exit %d): %s" % (box, res.returncode, said),
                         hint="`onboxctl push %s` installs an onbox.pyz that has `onbox queue`" % box)
    if as_json:
        echo_json({"box": box, **doc})
    else:
        click.echo("box %s · %s" % (box, render_queue(doc)), nl=False)
