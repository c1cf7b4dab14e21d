"""`onboxctl box add|ls|rm`: the inventory of boxes."""
from __future__ import annotations

import os
from typing import Optional, Tuple

import click

from controller.boxes.inventory import OPTION_RE, Box, Inventory, check_box_fields, check_name, check_pool
from onbox.clikit import LaidOut, echo_json
from onbox.errors import OnboxError, UnfitError, UsageError
from onbox.untrusted import printable


@click.group("box")
def box() -> None:
    """Manage the inventory of boxes ($ONBOX_CONFIG_DIR/boxes.toml, default ~/.config/onbox/).

    A box name that is not in the inventory is used as an ssh host alias, so ~/.ssh/config applies. The host keys
    of inventory boxes are kept in $ONBOX_CONFIG_DIR/known_hosts: a new box's key is accepted on first contact,
    a changed one is refused until `onboxctl box forget-key NAME`.
    """


ADD_EXAMPLES = [
    "onboxctl box add gpu1 --host 203.0.113.7 --user root --profile runpod",
    "onboxctl box add gpu2 --host 203.0.113.9 --check     # added only once it answers over ssh",
    "onboxctl box add spare1 --host 203.0.113.8 --user root --pool a100 --price 1.19",
]


@box.command("add", cls=LaidOut, examples=ADD_EXAMPLES,
             sections=[("SSH", ["--identity", "--python", "--ssh-option"]), ("Spares and prices", ["--pool", "--price"])])
@click.argument("name")
@click.option("--host", required=True, help="Hostname, address or ~/.ssh/config alias.")
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="SSH port (default: ssh's).")
@click.option("--user", default=None, help="SSH user (default: ssh's).")
@click.option("--profile", default=None, help="Platform profile (runpod, vastai, lambda, autodl, ...).")
@click.option("--identity", default=None, help="Private key file for this box.")
@click.option("--python", "python", default="python3", show_default=True, help="The box's python that runs onbox.pyz.")
@click.option("--ssh-option", "options", multiple=True, metavar="KEY=VALUE", help="Extra ssh -o option (repeatable).")
@click.option("--pool", default=None, help="A spare of this pool: `onboxctl keep` may recover a run launched with "
                                            "`--recover pool:POOL` onto it (when it is healthy and idle).")
@click.option("--price", default=None, metavar="PER_HOUR",
              help="What an hour of this box costs (e.g. 0.44): `onboxctl report` shows what each part of a run's "
                   "time cost. Without it, its profile's price in prices.toml, if any.")
@click.option("--replace", is_flag=True, help="Replace an existing entry of that name.")
@click.option("--check", is_flag=True, help="First ssh to the box and say its python's version and whether "
              "onbox.pyz is there. A box that does not answer, or whose --python does not run, is NOT added (exit "
              "3, with what ssh said and what fixes it).")
def add(name: str, host: str, port: Optional[int], user: Optional[str], profile: Optional[str],
        identity: Optional[str], python: str, options: Tuple[str, ...], pool: Optional[str], price: Optional[str],
        replace: bool, check: bool) -> None:
    """Add box NAME to the inventory. With --check, only once it answers over ssh and its python runs."""
    check_name(name)
    check_box_fields(host, user, python)
    if pool is not None:
        check_pool(pool)
    per_hour = _price(price) if price is not None else None
    for opt in options:
        if not OPTION_RE.fullmatch(opt):
            raise UsageError("--ssh-option must look like Key=Value, not %r" % opt)
    if identity is not None and not os.path.isfile(os.path.expanduser(identity)):
        raise UsageError("identity file %s does not exist" % identity,
                         hint="give the private key ssh should use for this box (e.g. ~/.ssh/id_ed25519)")
    if profile is not None:
        _check_profile(profile)
    inv = Inventory()
    entry = Box(name=name, host=host, port=port, user=user, profile=profile, identity=identity, python=python,
                options=list(options), pool=pool, price=per_hour)
    if not replace and name in inv.load():  # refused before any connection, as the add itself would refuse it
        inv.add(entry)
    if check:
        try:
            click.echo(answers(entry))
        except OnboxError as e:  # the entry is not written: said, so no one looks for it in `box ls`
            e.message = "%s; box %s was not added to %s" % (e.message, name, inv.path())
            raise
    inv.add(entry, replace=replace)
    click.echo("added box %s (%s%s%s) to %s" % (name, host, ", pool %s" % pool if pool else "",
                                                ", %g an hour" % per_hour if per_hour is not None else "", inv.path()))


# one call: the python's version (or why it does not run), then whether onbox.pyz is there
_CHECK = ('v=$(%s -c "import sys; print(\'%%d.%%d.%%d\' %% sys.version_info[:3])" 2>&1) && echo "python $v" '
          '|| echo "python-fails $v"; [ -f %s ] && echo pyz || echo no-pyz')


def answers(box: Box) -> str:
    """`box add --check`: ssh to the box (its host key recorded as on any first contact) and say, in one line,
    its python's version and whether onbox.pyz is there. Raises BoxUnreachable (exit 3) with what ssh said when
    it does not answer, UnfitError (exit 3) when its --python does not run."""
    import shlex

    from controller.boxes.agent import REMOTE_PYZ
    from controller.boxes.ssh import Ssh, settings_from_env

    ssh = Ssh(settings_from_env())
    try:
        out = ssh.run(box.target(), script=_CHECK % (shlex.quote(box.python), REMOTE_PYZ), timeout=60,
                      what="check the box").text
    finally:
        ssh.close(box.target())
    said = out.strip().splitlines()
    first = said[0] if said else ""
    if not first.startswith("python "):
        raise UnfitError("box %s answers, but its python %s does not run: %s" % (
            box.name, box.python, printable(first[len("python-fails "):].strip()) or "no output"),
            hint="give the box's interpreter: --python PATH (e.g. /usr/bin/python3 or a conda env's python)")
    pyz = "onbox.pyz is there" if "pyz" in said[1:] else "no onbox.pyz yet (`onboxctl push %s`)" % box.name
    return "box %s answers over ssh: %s %s; %s" % (box.name, box.python, printable(first[len("python "):]), pyz)


def _price(text: str) -> float:
    """--price as a number of money per hour (exit 2 naming the flag otherwise)."""
    from controller.goodput.prices import price_problem

    try:
        value = float(text)
    except ValueError:
        raise UsageError("--price %r is not a number" % text, hint="the box's price per hour, e.g. --price 0.44")
    why = price_problem(value)
    if why:
        raise UsageError("--price %r: %s" % (text, why), hint="the box's price per hour, e.g. --price 0.44")
    return value


@box.command("ls", cls=LaidOut, examples=["onboxctl box ls", "onboxctl box ls --json"])
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ls(as_json: bool) -> None:
    """List the boxes in the inventory."""
    boxes = Inventory().load()
    if as_json:
        echo_json({"boxes": [dict(b.to_dict(), name=n) for n, b in sorted(boxes.items())]})
        return
    if not boxes:
        click.echo("no boxes yet: add one with `onboxctl box add NAME --host HOST`")
        return
    priced = any(b.price is not None for b in boxes.values())  # the column only once a box has a price
    rows = [("NAME", "HOST", "PORT", "USER", "PROFILE", "POOL") + (("PRICE/H",) if priced else ())]
    for n, b in sorted(boxes.items()):
        rows.append((n, b.host, str(b.port or "-"), b.user or "-", b.profile or "-", b.pool or "-")
                    + (("%g" % b.price if b.price is not None else "-",) if priced else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@box.command("rm", cls=LaidOut, examples=["onboxctl box rm gpu1",
                                           "onboxctl box rm spare1     # the machine itself is not touched"])
@click.argument("name")
def rm(name: str) -> None:
    """Remove box NAME from the inventory (the machine itself is not touched)."""
    inv = Inventory()
    inv.remove(name)
    click.echo("removed box %s from %s" % (name, inv.path()))


def _check_profile(name: str) -> None:
    """Reject an unknown profile when the profile catalogue is available (foundation issue)."""
    try:
        from controller.boxes.profiles import known_profiles
    except ImportError:  # pragma: no cover
        return
    names = known_profiles()
    if names and name not in names:
        raise UsageError("unknown profile %r" % name, hint="known: %s" % ", ".join(sorted(names)))


@box.command("forget-key", cls=LaidOut, examples=[
    "onboxctl box forget-key gpu1          # the box was re-rented: the next contact records its new key",
    "onboxctl box forget-key gpu1 --json"])
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def forget_key(name: str, as_json: bool) -> None:
    """Forget the host key onbox recorded for box NAME (a re-rented or rebuilt box has a new one).

    onboxctl refuses a box whose host key changed since its first contact: either it is a new machine at the same
    address, or someone is in the middle. Once you know it is the first, this removes the old key from onbox's
    known_hosts (ssh-keygen keeps the file as it was in known_hosts.old); the next connection accepts and
    records the box's new key. Nothing else is touched.
    """
    from controller.boxes.hostkeys import forget_host_key
    from controller.boxes.ssh import Ssh, settings_from_env

    check_name(name)
    inv = Inventory()
    boxes = inv.load()
    if name not in boxes:
        raise UsageError("box %r is not in the inventory (%s)" % (name, inv.path()),
                         hint="`onboxctl box ls` lists it; a name that is not there is an ssh host alias, whose "
                              "host key is in ssh's own known_hosts (`ssh-keygen -R HOST`)")
    done = forget_host_key(Ssh(settings_from_env()), boxes[name])
    if as_json:
        echo_json(done.to_dict())
    elif done.fingerprints:
        for fp in done.fingerprints:
            click.echo("forgot the host key of box %s: %s" % (name, fp))
        click.echo("removed from %s; the next connection to %s accepts and records its new key" % (done.known_hosts,
                                                                                                  name))
    else:
        click.echo("no host key of box %s (%s) is recorded in %s: nothing to forget" % (
            name, ", ".join(done.hosts), done.known_hosts))
