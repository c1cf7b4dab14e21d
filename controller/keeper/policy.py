"""A run's recovery policy and its launch record: what `onboxctl run --recover pool:P` records so that `onboxctl
keep` can launch the same run again, on the same box or elsewhere, without the person who started it.

The launch record holds what `controller.launch.start.launch` (or `controller.launch.nodes.launch_group`) needs to start the run
again: the command, the `onbox run` options onboxctl forwarded (secrets by name only: `--secret NAME`, never a
value), the `ONBOX_<FIELD>` settings, the work dir, the tracker and whether it is tunnelled, plus what a fresh box
needs first (the local code dir and onbox.pyz to push, and the secret-looking files of that dir the user sent on
purpose with `--include-secret`: paths, never contents). Values are checked when the record is read back: it is a
file a person may edit.
"""
from __future__ import annotations

import dataclasses
import math
import re
import shlex
from typing import Any, Dict, List, Optional

from onbox import vocab
from onbox.errors import UsageError

DEFAULT_HEARTBEAT_INTERVAL = 30.0  # the agent's default (onbox/config.py)
LOST_AFTER_BEATS = 3.0  # default --lost-after, in heartbeat intervals: past the tracker's LATE (2), before SILENT (5)
MIN_LOST_AFTER = 5.0  # seconds: below this a single slow ssh handshake could declare a box lost
DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
POOL_PREFIX = "pool:"
PROVISION_TIMEOUT_RANGE = (1.0, 86400.0)  # seconds: renting a box takes seconds to tens of minutes, never 0 or a year
MAX_NUMBER = 1e10  # any number in a record (a time in seconds: the year 2286; a count): past it a hand edit


def parse_duration(text: Any, what: str) -> float:
    """Seconds from "90", "90s", "30m", "2h", "1d", "500ms"; anything else (negative, nan, "soon") a UsageError."""
    m = DURATION_RE.match(text) if isinstance(text, str) else None
    value = float(m.group(1)) * UNITS[m.group(2)] if m else float("nan")
    if not math.isfinite(value) or value > 366 * 86400.0:
        raise UsageError("%s %r is not a duration" % (what, text),
                         hint="a number with an optional unit: 45, 90s, 30m, 2h, 1d (at most 366 days)")
    return value


def check_provision_timeout(seconds: float, what: str = "--provision-timeout") -> float:
    """The provision command's timeout, refused (UsageError naming the flag and the range) outside 1 s to 24 h: at
    0 every try would fail before the command could print a box."""
    lo, hi = PROVISION_TIMEOUT_RANGE
    if not (finite(seconds) and lo <= seconds <= hi):
        raise UsageError(("%s %s" % (what, _shown(seconds))).strip() + " is out of range: it takes 1s to 24h",
                         hint="how long the provision command may take to rent a box and print it, e.g. "
                              "--provision-timeout 15m")
    return seconds


def _shown(seconds: Any) -> str:
    if finite(seconds) and abs(seconds) < 1e7:
        return "%gd" % (seconds / 86400.0) if abs(seconds) >= 86400 else "%gs" % seconds
    return repr(seconds)[:40]


def parse_recover(spec: str) -> str:
    """The pool of `--recover pool:P`."""
    from controller.boxes.inventory import check_pool

    if not isinstance(spec, str) or not spec.startswith(POOL_PREFIX):
        raise UsageError("--recover %r: expected pool:NAME" % (spec,),
                         hint="e.g. --recover pool:a100 (the spares added with `onboxctl box add NAME --host ... "
                              "--pool a100`)")
    return check_pool(spec[len(POOL_PREFIX):], where="--recover")


def parse_provision(text: str) -> List[str]:
    """The provision command as an argv (split like a shell would, never run by one)."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise UsageError("--provision %r: %s" % (text, e))
    if not argv:
        raise UsageError("--provision is empty", hint="give the command that rents a box, e.g. --provision ./new-box.sh")
    return argv


@dataclasses.dataclass
class RecoveryPolicy:
    """How `onboxctl keep` recovers the run (README.md, "Leave it running")."""

    pool: str
    provision: Optional[List[str]] = None  # argv of the user's command that rents a box (None: spares only)
    lost_after: Optional[float] = None  # seconds of failed ssh probes (with late beats) before a box is lost
    max_recoveries: int = 10
    max_at_risk: Optional[float] = None  # seconds of training since the newest durable checkpoint: an alert beyond
    backoff: float = 30.0  # seconds before the second try to find a box; doubles, at most backoff_max
    backoff_max: float = 600.0
    tries: int = 3  # tries to find a box (a healthy spare, else one provisioned) before failed_no_resource
    provision_timeout: float = 600.0

    def lost_after_s(self, heartbeat_interval: float) -> float:
        """--lost-after, else LOST_AFTER_BEATS heartbeat intervals (at least MIN_LOST_AFTER)."""
        if self.lost_after is not None:
            return self.lost_after
        return max(MIN_LOST_AFTER, LOST_AFTER_BEATS * heartbeat_interval)

    def backoff_s(self, failed_tries: int) -> float:
        """The wait after `failed_tries` failed tries (1, 2, ...): backoff, doubled each time, capped."""
        return min(self.backoff_max, self.backoff * (2.0 ** min(60, max(0, failed_tries - 1))))


@dataclasses.dataclass
class LaunchRecord:
    """What `onboxctl run` did, and what `onboxctl keep` repeats."""

    run: str  # the run's name (node 0's for a group)
    boxes: List[str]  # where it was launched, node 0 first
    command: List[str]
    policy: RecoveryPolicy
    nodes: bool = False  # the boxes are the nodes of one job (`--nodes`)
    onbox_args: List[str] = dataclasses.field(default_factory=list)  # `onbox run` options as forwarded
    onbox_env: Dict[str, str] = dataclasses.field(default_factory=dict)  # ONBOX_<FIELD> settings, no tunnel URL
    workdir: Optional[str] = None
    code: Optional[str] = None  # local code dir pushed to a replacement box
    pyz: Optional[str] = None  # local onbox.pyz pushed to a replacement box
    durable: Optional[str] = None
    ckpt_dir: Optional[str] = None
    tracker: Optional[str] = None  # the tracker URL as given to `onboxctl run` (reachable from here)
    tunnel: bool = False  # the tracker is reached through a reverse ssh tunnel per box
    secrets: List[str] = dataclasses.field(default_factory=list)  # `--secret` specs: names, never values
    include_secrets: List[str] = dataclasses.field(default_factory=list)  # `--include-secret` paths of `code`
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    timeout: float = 60.0  # seconds one launch may take
    created: float = 0.0

    def node_runs(self) -> List[str]:
        """The run name on each box: `<run>` on node 0, `<run>.node<N>` on the others."""
        if not self.nodes:
            return [self.run]
        from onbox.multinode.role import node_run_name

        return [node_run_name(self.run, i) for i in range(len(self.boxes))]

    def lost_after_s(self) -> float:
        return self.policy.lost_after_s(self.heartbeat_interval)

    def to_dict(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), schema=LAUNCH_SCHEMA)


LAUNCH_SCHEMA = vocab.SCHEMA_LAUNCH


def finite(v: Any) -> bool:
    """A number a record may hold: no bool, nan, inf, 1e400 or 10**400 (which float() cannot even convert)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) <= MAX_NUMBER and (isinstance(v, int) or math.isfinite(v))


def _want(doc: Dict[str, Any], key: str, kind: Any, where: str, optional: bool = False) -> Any:
    v: Any = doc.get(key)
    if v is None and optional:
        return None
    number = kind in (int, float, (int, float))
    ok = isinstance(v, kind) and not (number and isinstance(v, bool))
    if ok and number and not finite(v):
        ok = False
    if not ok:
        raise ValueError("%s: %s is %s" % (where, key, repr(v)[:80]))
    return v


def box_name_problem(name: Any) -> Optional[str]:
    """Why `name` is no box a record may name (None: it is one): an inventory name or an ssh alias, as
    `onboxctl run` takes them (controller/boxes/inventory.py Inventory.resolve). It is handed to ssh and printed: never empty,
    never starting with '-' (ssh would read an option), no whitespace or control characters."""
    if not isinstance(name, str) or not name or len(name) > 255:
        return "box %s is not a box name" % repr(name)[:80]
    if name.startswith("-") or any(c.isspace() or ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        return "box %s is not a box name (an inventory name or an ssh alias: no leading '-', no spaces or control " \
               "characters)" % repr(name)[:80]
    return None


def box_names(v: Any, where: str, key: str) -> List[str]:
    """A list of box names (ValueError naming the first bad one)."""
    names = _strings(v, where, key)
    bad = next((p for p in map(box_name_problem, names) if p), None)
    if bad:
        raise ValueError("%s: %s: %s" % (where, key, bad))
    return names


def _strings(v: Any, where: str, key: str) -> List[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("%s: %s must be a list of strings" % (where, key))
    return list(v)


def policy_from_dict(doc: Any, where: str) -> RecoveryPolicy:
    if not isinstance(doc, dict):
        raise ValueError("%s: policy must be an object" % where)
    from controller.boxes.inventory import BOX_NAME_RE

    pool = _want(doc, "pool", str, where)
    if not BOX_NAME_RE.fullmatch(pool):
        raise ValueError("%s: pool %r is not a pool name" % (where, pool))
    prov = doc.get("provision")
    p = RecoveryPolicy(
        pool=pool, provision=_strings(prov, where, "provision") if prov is not None else None,
        lost_after=_want(doc, "lost_after", (int, float), where, optional=True),
        max_recoveries=_want(doc, "max_recoveries", int, where),
        max_at_risk=_want(doc, "max_at_risk", (int, float), where, optional=True),
        backoff=_want(doc, "backoff", (int, float), where), backoff_max=_want(doc, "backoff_max", (int, float), where),
        tries=_want(doc, "tries", int, where), provision_timeout=_want(doc, "provision_timeout", (int, float), where))
    if p.provision == []:
        raise ValueError("%s: provision is an empty command" % where)
    try:
        check_provision_timeout(p.provision_timeout)
    except UsageError:
        raise ValueError("%s: provision_timeout %s is out of range (--provision-timeout takes 1s to 24h)"
                         % (where, _shown(p.provision_timeout)))
    for key in ("lost_after", "max_at_risk", "backoff", "backoff_max", "provision_timeout", "max_recoveries", "tries"):
        v = getattr(p, key)
        if v is not None and v < 0:
            raise ValueError("%s: %s is negative" % (where, key))
    return p


def launch_from_dict(doc: Any, where: str) -> LaunchRecord:
    """A launch record read back (ValueError naming the field when a hand edit broke it)."""
    from controller.launch.start import check_name

    if not isinstance(doc, dict) or doc.get("schema") != LAUNCH_SCHEMA:
        raise ValueError("%s is not a launch record (schema %s)" % (where, LAUNCH_SCHEMA))
    run = _want(doc, "run", str, where)
    try:
        check_name(run)
    except UsageError as e:
        raise ValueError("%s: %s" % (where, e.message))
    boxes = box_names(doc.get("boxes"), where, "boxes")
    if not boxes:
        raise ValueError("%s: boxes is empty" % where)
    env = doc.get("onbox_env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("%s: onbox_env must map names to strings" % where)
    rec = LaunchRecord(
        run=run, boxes=boxes, command=_strings(doc.get("command"), where, "command"),
        policy=policy_from_dict(doc.get("policy"), where + " policy"), nodes=doc.get("nodes") is True,
        onbox_args=_strings(doc.get("onbox_args", []), where, "onbox_args"), onbox_env=dict(env),
        workdir=_want(doc, "workdir", str, where, optional=True), code=_want(doc, "code", str, where, optional=True),
        pyz=_want(doc, "pyz", str, where, optional=True), durable=_want(doc, "durable", str, where, optional=True),
        ckpt_dir=_want(doc, "ckpt_dir", str, where, optional=True),
        tracker=_want(doc, "tracker", str, where, optional=True), tunnel=doc.get("tunnel") is True,
        secrets=_strings(doc.get("secrets", []), where, "secrets"),
        include_secrets=_strings(doc.get("include_secrets", []), where, "include_secrets"),
        heartbeat_interval=_want(doc, "heartbeat_interval", (int, float), where),
        timeout=_want(doc, "timeout", (int, float), where), created=_want(doc, "created", (int, float), where))
    if not rec.command:
        raise ValueError("%s: command is empty" % where)
    if rec.include_secrets and not rec.code:
        raise ValueError("%s: include_secrets names files of a code dir, and code is not set" % where)
    if rec.heartbeat_interval <= 0 or rec.timeout <= 0:
        raise ValueError("%s: heartbeat_interval and timeout must be > 0" % where)
    return rec
