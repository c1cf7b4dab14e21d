"""The inventory of boxes: $ONBOX_CONFIG_DIR/boxes.toml (default ~/.config/onbox/), or boxes.json.

One inventory only: when both boxes.toml and boxes.json exist, every command that reads the inventory is refused
naming both (reading one and ignoring the other without a word would send a box name to a host the user did
not mean). Both files are read with the same bounds (a regular file, 4 MiB, 64 levels deep), and a config dir
that is not a directory is refused rather than read as an empty inventory.

A box name that is not in the inventory is handed to ssh as a host alias, so ~/.ssh/config (HostName, Port,
User, ProxyJump, IdentityFile) and the agent decide how to reach it.

Host keys of inventory boxes are kept in known_hosts next to the inventory (controller/boxes/ssh.py): a new box's key
is accepted on first contact, a changed one refused until `onboxctl box forget-key NAME` (controller/boxes/hostkeys.py).
A box whose `options` set StrictHostKeyChecking or UserKnownHostsFile (or the like) keeps its own.

    [boxes.gpu1]
    host = "203.0.113.7"
    port = 22
    user = "root"
    profile = "runpod"
    identity = "~/.ssh/id_ed25519"
    pool = "a100"                 # a spare of pool a100: `onboxctl keep` may recover a run onto it
    price = 0.44                  # per hour: `onboxctl report` shows what each part of a run's time cost
    options = ["StrictHostKeyChecking=accept-new"]
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, List, Optional

from controller.boxes.ssh import Target, check_ssh_word, manages_host_keys
from onbox import untrusted
from onbox.environment import Environment
from onbox.errors import UsageError
from onbox.fsutil import atomic_write, nearest_existing

BOX_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
OPTION_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*=[^\n]*$")


def config_dir() -> str:
    """$ONBOX_CONFIG_DIR, else $XDG_CONFIG_HOME/onbox, else ~/.config/onbox. It need not exist yet (the first
    write makes it), but when it, or the nearest part of it that exists, is not a directory, every command that
    uses it is refused here: `box ls` must not say "no boxes yet" of an inventory it could never read."""
    environment = Environment.read()
    env = environment.config_dir
    if env:
        path, source = os.path.abspath(os.path.expanduser(env)), "ONBOX_CONFIG_DIR=%s" % env
    else:
        xdg = environment.xdg_config_home or os.path.join(os.path.expanduser("~"), ".config")
        path, source = os.path.join(xdg, "onbox"), "the onboxctl config dir %s" % os.path.join(xdg, "onbox")
    probe = nearest_existing(path, exists=os.path.lexists)
    if not os.path.isdir(probe):
        what = "is" if probe == path else "is under %s, which is" % probe
        raise UsageError("%s %s not a directory" % (source, what),
                         hint="point ONBOX_CONFIG_DIR at a directory (it holds boxes.toml, known_hosts, config.toml, "
                              "tunnels.json and pulls.json)%s" % (", or unset it to use ~/.config/onbox" if env else
                                                     ", or move %s aside" % probe))
    return path


@dataclasses.dataclass
class Box:
    name: str
    host: str
    port: Optional[int] = None
    user: Optional[str] = None
    profile: Optional[str] = None
    identity: Optional[str] = None
    python: str = "python3"  # the box's interpreter that runs onbox.pyz (AutoDL: /root/miniconda3/bin/python)
    options: List[str] = dataclasses.field(default_factory=list)
    pool: Optional[str] = None  # the pool this box serves as a spare of (`run --recover pool:P`, controller/keeper)
    price: Optional[float] = None  # what an hour of it costs (`onboxctl report`; else its profile's, prices.toml)
    in_inventory: bool = True
    # onbox's known_hosts for this box (the inventory's, set where it is read); never written to the inventory
    known_hosts: Optional[str] = dataclasses.field(default=None, compare=False)

    def target(self) -> Target:
        """What ssh needs. An inventory box's host key is checked against onbox's own known_hosts (accept-new),
        unless the box's options manage host keys themselves; an alias leaves them to ssh's own configuration."""
        known = None
        if self.in_inventory and not manages_host_keys(self.options):
            known = self.known_hosts or known_hosts_path()
        return Target(name=self.name, host=self.host, port=self.port, user=self.user, identity=self.identity,
                      options=tuple(self.options), known_hosts=known, alias=not self.in_inventory)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("in_inventory")
        d.pop("known_hosts")
        return {k: v for k, v in d.items() if v not in (None, [], "")}


def known_hosts_path(directory: Optional[str] = None) -> str:
    """onbox's own known_hosts: the host keys of inventory boxes, next to the inventory."""
    return os.path.join(directory or config_dir(), "known_hosts")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not BOX_NAME_RE.fullmatch(name):
        raise UsageError("invalid box name %r" % name, hint="use letters, digits, '.', '_' and '-' (at most 64)")
    return name


def check_pool(pool: str, where: str = "") -> str:
    """A pool name: the rule of box names (it becomes a word in `--recover pool:P` and in the inventory)."""
    if not isinstance(pool, str) or not BOX_NAME_RE.fullmatch(pool):
        raise UsageError("%sinvalid pool name %r" % (where + ": " if where else "", pool),
                         hint="use letters, digits, '.', '_' and '-' (at most 64), e.g. --pool a100")
    return pool


def check_box_fields(host: str, user: Optional[str], python: str = "python3", where: str = "") -> None:
    """What ssh gets as argv words: refused when ssh could read them as options (a host of `-oProxyCommand=...`
    runs a local command), with `where` (the inventory file and box) in the message."""
    try:
        check_ssh_word("host", host)
        if user is not None:
            check_ssh_word("user", user)
        if not python or python.startswith("-") or any(c in python for c in "\n\r\0"):
            raise UsageError("invalid python %r: give the box's interpreter, e.g. python3 or /opt/conda/bin/python"
                             % python)
    except UsageError as e:
        if where:
            e.message = "%s: %s" % (where, e.message)
        raise


class Inventory:
    """Reads and writes the boxes file. Writes are atomic (a crash never leaves half a file)."""

    def __init__(self, directory: Optional[str] = None) -> None:
        self.directory = directory or config_dir()

    @property
    def toml_path(self) -> str:
        return os.path.join(self.directory, "boxes.toml")

    @property
    def json_path(self) -> str:
        return os.path.join(self.directory, "boxes.json")

    def path(self) -> str:
        """boxes.toml, or boxes.json when only that one exists; both at once is refused (see the module doc)."""
        toml, js = os.path.lexists(self.toml_path), os.path.lexists(self.json_path)
        if toml and js:
            raise UsageError("box inventory: both %s and %s exist, and onboxctl reads one inventory only"
                             % (self.toml_path, self.json_path),
                             hint="move the boxes you need into boxes.toml and remove boxes.json (or the other way "
                                  "round)")
        return self.json_path if js else self.toml_path

    def load(self) -> Dict[str, Box]:
        path = self.path()
        if not os.path.lexists(path):
            return {}
        if path.endswith(".toml"):
            from onbox.tomlread import load_toml

            data = load_toml(path, "box inventory")
        else:
            data = _load_json(path)
        table = data.get("boxes", {})
        if not isinstance(table, dict):
            raise UsageError("box inventory %s: [boxes] must be a table" % path)
        out = {}
        for name, entry in table.items():
            out[name] = box_from_entry(name, entry, path)
            out[name].known_hosts = known_hosts_path(self.directory)
        return out

    def save(self, boxes: Dict[str, Box]) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = self.path()
        doc = {"boxes": {n: b.to_dict() for n, b in sorted(boxes.items())}}
        if path.endswith(".json"):
            atomic_write(path, json.dumps(doc, indent=2, sort_keys=True) + "\n", mode=0o600)
        else:
            atomic_write(path, to_toml(doc["boxes"]), mode=0o600)

    def add(self, box: Box, replace: bool = False) -> None:
        boxes = self.load()
        if box.name in boxes and not replace:
            raise UsageError("box %r is already in the inventory" % box.name,
                             hint="remove it first with `onboxctl box rm %s`, or pass --replace" % box.name)
        boxes[box.name] = box
        self.save(boxes)

    def remove(self, name: str) -> Box:
        boxes = self.load()
        if name not in boxes:
            raise UsageError("box %r is not in the inventory (%s)" % (name, self.path()))
        box = boxes.pop(name)
        self.save(boxes)
        return box

    def resolve(self, name: str) -> Box:
        """The inventory entry, or an ssh alias of that name (~/.ssh/config decides the rest)."""
        boxes = self.load()
        if name in boxes:
            return boxes[name]
        if not name or name.startswith("-") or any(c.isspace() or ord(c) < 32 for c in name):
            raise UsageError("invalid box name %r" % name,
                             hint="a box is an inventory name (onboxctl box ls) or an ssh host alias; neither "
                                  "starts with '-'")
        return Box(name=name, host=name, in_inventory=False)


def _load_json(path: str) -> Dict[str, Any]:
    """boxes.json, read as boxes.toml is: a regular file of at most CONFIG_MAX_BYTES, nested at most 64 deep."""
    try:
        data = untrusted.read_json(path, untrusted.CONFIG_MAX_BYTES, "box inventory")
    except untrusted.UntrustedInput as e:
        raise UsageError(str(e), hint="boxes.json must be a regular JSON file (at most 4 MiB, 64 levels deep); or "
                                      "remove it and keep the inventory in boxes.toml")
    except IsADirectoryError:
        raise UsageError("box inventory %s is a directory, not a file" % path)
    except UnicodeDecodeError as e:
        raise UsageError("box inventory %s is not UTF-8 text (byte %d)" % (path, e.start), hint="save it as UTF-8")
    except ValueError as e:
        raise UsageError("box inventory %s is not valid JSON: %s" % (path, e))
    except OSError as e:
        raise UsageError("cannot read box inventory %s: %s" % (path, e.strerror or e))
    if not isinstance(data, dict):
        raise UsageError("box inventory %s is not a JSON object" % path, hint='e.g. {"boxes": {"gpu1": {"host": '
                                                                               '"203.0.113.7"}}}')
    return data


def box_from_entry(name: str, entry: Any, source: str) -> Box:
    if not isinstance(entry, dict):
        raise UsageError("box inventory %s: box %r must be a table" % (source, name))
    if not BOX_NAME_RE.fullmatch(name):
        raise UsageError("box inventory %s: invalid box name %r" % (source, name),
                         hint="use letters, digits, '.', '_' and '-' (at most 64)")
    known = {f.name for f in dataclasses.fields(Box)} - {"name", "in_inventory", "known_hosts"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise UsageError("box inventory %s: box %r has unknown key(s) %s" % (source, name, ", ".join(unknown)),
                         hint="known keys: %s" % ", ".join(sorted(known)))
    if not isinstance(entry.get("host"), str) or not entry["host"]:
        raise UsageError("box inventory %s: box %r needs a host" % (source, name))
    for key in ("user", "profile", "identity", "python", "pool"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise UsageError("box inventory %s: box %r: %s must be a string, not %r" % (source, name, key, entry[key]))
    check_box_fields(entry["host"], entry.get("user"), entry.get("python", "python3"),
                     where="box inventory %s: box %r" % (source, name))
    if entry.get("pool") is not None:
        check_pool(entry["pool"], where="box inventory %s: box %r" % (source, name))
    port = entry.get("port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise UsageError("box inventory %s: box %r: port must be 1-65535, not %r" % (source, name, port))
    price = entry.get("price")
    if price is not None:
        from controller.goodput.prices import price_problem

        why = price_problem(price)
        if why:
            raise UsageError("box inventory %s: box %r: price: %s" % (source, name, why), hint="e.g. price = 0.44")
    options = entry.get("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) and OPTION_RE.fullmatch(o) for o in options):
        raise UsageError("box inventory %s: box %r: options must be a list of \"Key=Value\"" % (source, name))
    return Box(name=name, host=entry["host"], port=port, user=entry.get("user"), profile=entry.get("profile"),
               identity=entry.get("identity"), python=entry.get("python", "python3"), options=list(options),
               pool=entry.get("pool"), price=float(price) if price is not None else None)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # TOML's float: 0.44, 1e-05
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string for these values


def to_toml(boxes: Dict[str, Dict[str, Any]]) -> str:
    lines = ["# onboxctl box inventory (edit freely; `onboxctl box add/rm` rewrite it)", ""]
    for name, entry in boxes.items():
        lines.append("[boxes.%s]" % json.dumps(name))
        for key, value in entry.items():
            if key == "name":
                continue
            lines.append("%s = %s" % (key, _toml_value(value)))
        lines.append("")
    return "\n".join(lines)
